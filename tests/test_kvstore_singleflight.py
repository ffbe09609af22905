"""kvstore.singleflight: the races closed by looking again, with scripted lookups.

Each scripted lookup plays what another caller did between two of our steps.
"""

from __future__ import annotations

import math
import threading
import time

import pytest

from kvstore.lock import Lease
from kvstore.singleflight import NO_VALUE, Entry, SingleFlight


def scripted(*answers):
    it = iter(answers)
    return lambda: next(it)


def test_no_value_is_falsy_unique_and_not_none():
    assert not NO_VALUE and NO_VALUE is not None
    assert type(NO_VALUE)() is NO_VALUE
    assert repr(NO_VALUE) == "NO_VALUE"


def test_a_value_stored_just_before_we_took_the_lock_is_not_rebuilt(cache_client, prefix):
    # Our first read missed; the previous holder stored and released before our acquire.
    flight = SingleFlight(cache_client, name=prefix)
    lookup = scripted(NO_VALUE, Entry("theirs", math.inf))
    assert flight.run(f"{prefix}:lock", lookup, lambda: pytest.fail("built twice")) == "theirs"


def test_a_refresh_finished_just_before_we_took_the_lock_is_not_redone(cache_client, prefix):
    stale = Entry("old", time.time() - 1)
    flight = SingleFlight(cache_client, name=prefix, early_refresh_beta=0.0)
    lookup = scripted(stale, Entry("refreshed", time.time() + 60))
    assert flight.run(f"{prefix}:lock", lookup, lambda: pytest.fail("refreshed twice")) == "refreshed"


def test_a_stale_entry_still_stale_under_the_lock_is_rebuilt(cache_client, prefix):
    stale = Entry("old", time.time() - 1)
    flight = SingleFlight(cache_client, name=prefix, early_refresh_beta=0.0)
    assert flight.run(f"{prefix}:lock", scripted(stale, stale), lambda: "new") == "new"
    assert not cache_client.exists(f"{prefix}:lock")  # released in finally


def test_the_lock_is_released_when_the_build_raises(cache_client, prefix):
    flight = SingleFlight(cache_client, name=prefix)

    def boom():
        raise ValueError("no")

    with pytest.raises(ValueError):
        flight.run(f"{prefix}:lock", scripted(NO_VALUE, NO_VALUE), boom)
    assert not cache_client.exists(f"{prefix}:lock")


def test_settings_are_checked():
    with pytest.raises(ValueError):
        SingleFlight(None, lock_ttl_s=0)


def test_a_waiter_looks_again_once_subscribed(cache_client, prefix):
    # The holder stored and published between our failed acquire and our SUBSCRIBE:
    # no message will come, but the value is there.
    holder = Lease(cache_client, f"{prefix}:lock", 10_000)
    assert holder.acquire()
    # A poll and a wait bound far beyond the 30 s allowed below: only the look-again can answer in time.
    flight = SingleFlight(cache_client, name=prefix, poll_s=600, wait_timeout_s=600)
    lookup = scripted(NO_VALUE, Entry("theirs", math.inf))
    answer: list = []
    waiter = threading.Thread(target=lambda: answer.append(flight.run(f"{prefix}:lock", lookup, lambda: "built")),
                              daemon=True)
    waiter.start()
    waiter.join(30)
    holder.release()
    assert answer == ["theirs"]


def test_recheck_is_checked():
    with pytest.raises(ValueError):
        SingleFlight(None, recheck="sometimes")


def test_after_builds_a_miss_that_takes_the_lock_builds_without_looking_again(cache_client, prefix):
    # Nothing was built under this lock lately: what the caller's own read missed cannot
    # have been stored by a builder in between, so the lookup is not run again.
    flight = SingleFlight(cache_client, name=prefix, recheck="after_builds")
    assert flight.run(f"{prefix}:lock", scripted(), lambda: "built", missing=True) == "built"
    assert not cache_client.exists(f"{prefix}:lock")


def test_after_builds_a_miss_just_after_a_build_looks_again_under_the_lock(cache_client, prefix):
    # The previous holder built, stored and released between our read and our claim:
    # its record makes us look again (dogpile's double check) and take its value.
    flight = SingleFlight(cache_client, name=prefix, recheck="after_builds")
    assert flight.run(f"{prefix}:lock", scripted(), lambda: "theirs", missing=True) == "theirs"
    lookup = scripted(Entry("theirs", math.inf))
    assert flight.run(f"{prefix}:lock", lookup, lambda: pytest.fail("built twice"), missing=True) == "theirs"


def test_a_build_record_is_left_before_the_release_and_lasts_the_lock_ttl(cache_client, prefix):
    flight = SingleFlight(cache_client, name=prefix, lock_ttl_s=0.5, recheck="after_builds")
    flight.run(f"{prefix}:lock", scripted(), lambda: "built", missing=True)
    assert cache_client.exists(f"{prefix}:lock:stored") and 0 < cache_client.pttl(f"{prefix}:lock:stored") <= 500
    time.sleep(0.6)
    assert flight.run(f"{prefix}:lock", scripted(), lambda: "again", missing=True) == "again"  # no look again


def test_a_build_that_stored_nothing_leaves_no_record(cache_client, prefix):
    flight = SingleFlight(cache_client, name=prefix, recheck="after_builds")
    assert flight.run(f"{prefix}:lock", scripted(), lambda: "kept", missing=True, stored=lambda: False) == "kept"
    assert not cache_client.exists(f"{prefix}:lock:stored")
    assert flight.run(f"{prefix}:lock", scripted(), lambda: "again", missing=True) == "again"  # no look again


def test_a_flight_that_always_looks_again_leaves_no_record(cache_client, prefix):
    flight = SingleFlight(cache_client, name=prefix)
    assert flight.run(f"{prefix}:lock", scripted(NO_VALUE, NO_VALUE), lambda: "built") == "built"
    assert not cache_client.exists(f"{prefix}:lock:stored")


def test_a_failed_build_leaves_no_record(cache_client, prefix):
    flight = SingleFlight(cache_client, name=prefix, recheck="after_builds")

    def boom():
        raise ValueError("no")

    with pytest.raises(ValueError):
        flight.run(f"{prefix}:lock", scripted(), boom, missing=True)
    assert not cache_client.exists(f"{prefix}:lock") and not cache_client.exists(f"{prefix}:lock:stored")


def test_a_build_longer_than_the_lock_ttl_keeps_the_lock_without_a_thread_of_its_own(cache_client, prefix):
    flight = SingleFlight(cache_client, name=prefix, lock_ttl_s=1.0)  # two renewal chances on a busy machine
    other = Lease(cache_client, f"{prefix}:lock", 10_000)
    before = {t.name for t in threading.enumerate()}

    def build():
        time.sleep(2.5)  # two and a half TTLs: only the renewer keeps the lock
        assert not other.acquire(), "the lock lapsed mid-build"
        return "built"

    assert flight.run(f"{prefix}:lock", scripted(NO_VALUE, NO_VALUE), build) == "built"
    started = {t.name for t in threading.enumerate()} - before
    assert started <= {flight.renewer.name}  # the flight's one renewer, never a thread per build
    assert flight.renewer.held == 0 and not cache_client.exists(f"{prefix}:lock")


def test_store_if_waited_stores_only_when_somebody_waits_and_nobody_waiting_is_one_release(cache_client, prefix):
    flight = SingleFlight(cache_client, name=prefix, recheck="after_builds")
    lock, stores = f"{prefix}:lock", []
    assert flight.run(lock, scripted(), lambda: "alone", missing=True, store_if_waited=lambda: stores.append(1)) == "alone"
    assert stores == [] and not cache_client.exists(lock, f"{lock}:stored")  # released, nothing stored, no record

    listener = cache_client.pubsub(ignore_subscribe_messages=True)

    def build_while_one_waits() -> str:
        listener.subscribe(lock)  # as a waiter does, on the lock's channel
        assert cache_client.pubsub_numsub(lock) == [(lock.encode(), 1)]
        return "shared"

    try:
        assert flight.run(lock, scripted(), build_while_one_waits, missing=True,
                          store_if_waited=lambda: stores.append(1)) == "shared"
        assert stores == [1] and not cache_client.exists(lock)  # stored for the waiter, then released
        assert cache_client.exists(f"{lock}:stored")  # so the next claim looks again
        heard, deadline = None, time.monotonic() + 5
        while heard is None and time.monotonic() < deadline:  # None: the subscribe's own confirmation
            heard = listener.get_message(timeout=1)
        assert heard is not None and heard["data"] == b"released"  # and the waiter was told
    finally:
        listener.close()


def test_release_unless_waited_leaves_a_lease_it_lost(cache_client, prefix):
    flight = SingleFlight(cache_client, name=prefix)
    lease = Lease(cache_client, f"{prefix}:lock", 5000)
    assert lease.acquire()
    other = Lease(cache_client, f"{prefix}:lock", 5000, token="someone-else")
    assert flight.release_unless_waited(other) == -1 and cache_client.get(lease.key).decode() == lease.token
    assert flight.release_unless_waited(lease) == 0 and not cache_client.exists(lease.key)
