"""kvstore.cache.Cache and kvstore.singleflight in one process (threads) against real Redis.

The cross-process stampede and SIGKILL cases are in test_kvstore_stampede.py.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import pytest
from prometheus_client import REGISTRY

from kvfleet.constants import Keys
from kvstore.cache import Cache
from kvstore.lock import Lease
from kvstore.singleflight import NO_VALUE

#: The most any wait below may take. Far above what the step needs, so only a broken
#: behaviour (a caller that blocks, a wake-up that never comes) can reach it.
TIMEOUT_S = 30.0


def metric(name: str, cache: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"cache": cache, **labels}) or 0.0


class Builder:
    """A build function that counts its runs, optionally held by `hold()`, optionally failing."""

    def __init__(self, value=None, *, hold: Callable[[], object] = lambda: None, fail: bool = False) -> None:
        self.value, self.hold, self.fail = value, hold, fail
        self.runs = 0
        self._runs_lock = threading.Lock()
        self.started = threading.Event()

    def __call__(self):
        with self._runs_lock:
            self.runs += 1
        self.started.set()
        self.hold()
        if self.fail:
            raise RuntimeError("build failed")
        return self.value


class Call:
    """`fn()` on a daemon thread; `result()` fails the test if it has not returned in time."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self._done = threading.Event()
        self._outcome: tuple[bool, object] = (False, None)

        def run() -> None:
            try:
                self._outcome = (True, fn())
            except BaseException as exc:  # handed to result()
                self._outcome = (False, exc)
            finally:
                self._done.set()

        threading.Thread(target=run, daemon=True).start()

    def result(self, timeout_s: float = TIMEOUT_S):
        assert self._done.wait(timeout_s), f"still running after {timeout_s} s"
        ok, value = self._outcome
        if not ok:
            raise value
        return value


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


def count_lookups(cache: Cache) -> list:
    """From now on, every lookup `cache` makes is appended to the returned list."""
    lookups, entry = [], cache.entry

    def counted(key: str):
        found = entry(key)
        lookups.append(found)
        return found

    cache.entry = counted  # get_or_build looks values up through the instance
    return lookups


def subscribers(client, channel: str) -> int:
    """How many callers listen on `channel`: a waiter subscribes to its lock key's channel."""
    return client.pubsub_numsub(channel)[0][1]


@pytest.fixture
def make_cache(cache_client, prefix):
    def make(**options) -> Cache:
        options.setdefault("early_refresh_beta", 0.0)  # deterministic unless a test asks
        return Cache(cache_client, Keys(prefix), name=prefix, **options)

    return make


def test_fresh_value_is_built_once_then_served(make_cache, prefix):
    cache, build = make_cache(ttl_s=30), Builder({"answer": 42})
    assert cache.get_or_build(f"{prefix}:k", build) == {"answer": 42}
    assert cache.get_or_build(f"{prefix}:k", build) == {"answer": 42}
    assert build.runs == 1
    assert metric("kvfleet_cache_misses_total", prefix) == 1
    assert metric("kvfleet_cache_hits_total", prefix, state="fresh") == 1
    assert metric("kvfleet_cache_builds_total", prefix) == 1
    assert metric("kvfleet_cache_build_seconds_count", prefix) == 1


def test_none_is_a_value_and_no_value_means_absent(make_cache, prefix):
    cache, build = make_cache(), Builder(None)
    assert cache.get(f"{prefix}:k") is NO_VALUE
    assert cache.get_or_build(f"{prefix}:k", build) is None
    assert cache.get_or_build(f"{prefix}:k", build) is None
    assert build.runs == 1
    assert cache.get(f"{prefix}:k") is None


def test_physical_ttl_is_logical_plus_grace_and_jittered(make_cache, cache_client, prefix):
    cache = make_cache(ttl_s=100, grace_s=50, jitter=0.1)
    before, written = time.time(), time.monotonic()
    for i in range(40):
        cache.set(f"{prefix}:k{i}", i)
    pttls = [cache_client.pttl(f"{prefix}:k{i}") for i in range(40)]
    ran_down_ms = (time.monotonic() - written) * 1000  # however long the writes and reads took
    assert all(140_000 - ran_down_ms - 1 <= p <= 160_000 for p in pttls)  # (100 ± 10%) + 50 s
    assert len(set(pttls)) > 30  # written together, expiring apart
    entry = cache.entry(f"{prefix}:k0")
    # The logical expiry inside the value: 100 s ± 10% after a moment between the two reads.
    assert before + 90 - 1e-3 <= entry.expires_at <= time.time() + 110


def test_stale_value_is_served_while_exactly_one_caller_rebuilds(make_cache, prefix):
    cache = make_cache(ttl_s=0.2, grace_s=30)
    key = f"{prefix}:k"
    cache.set(key, "old")
    wait_until(lambda: cache.entry(key).stale(time.time()), "the value is logically expired")  # physically present
    release = threading.Event()
    rebuild = Builder("new", hold=lambda: release.wait(TIMEOUT_S))
    refresher = Call(lambda: cache.get_or_build(key, rebuild))
    others = Builder("other")
    try:
        assert rebuild.started.wait(TIMEOUT_S)
        # The rebuild cannot finish before `release`: these reads return without waiting for it.
        reads = Call(lambda: [cache.get_or_build(key, others) for _ in range(10)])
        assert reads.result() == ["old"] * 10
    finally:
        release.set()
    assert refresher.result() == "new"
    assert rebuild.runs == 1 and others.runs == 0
    assert cache.get_or_build(key, others) == "new"  # the next read sees the rebuilt value
    assert metric("kvfleet_cache_hits_total", prefix, state="stale") == 10


def test_waiters_are_woken_by_the_release_not_by_polling(make_cache, prefix):
    # A poll and a wait bound far beyond TIMEOUT_S: only the release's message can wake the waiter in time.
    cache = make_cache(poll_s=600, wait_timeout_s=600)
    key = f"{prefix}:k"
    release = threading.Event()
    build = Builder("v", hold=lambda: release.wait(TIMEOUT_S))
    holder = Call(lambda: cache.get_or_build(key, build))
    try:
        assert build.started.wait(TIMEOUT_S)  # the holder looks nothing up from here on
        lookups = count_lookups(cache)
        waiter = Call(lambda: cache.get_or_build(key, Builder("waiter")))
        # Its first miss, its look-again once subscribed, and one more when the subscription's
        # confirmation ends its first wait. Its next wait is the long one.
        wait_until(lambda: len(lookups) >= 3, "the waiter settles into its wait")
    finally:
        release.set()
    assert waiter.result() == "v"
    assert holder.result() == "v"
    assert metric("kvfleet_cache_lock_waits_total", prefix) == 1


def test_xfetch_refreshes_a_fresh_entry_early(make_cache, prefix):
    eager = make_cache(ttl_s=60, early_refresh_beta=1e9)  # δ·β dwarfs the 60 s left
    eager.set(f"{prefix}:k", "old", build_s=0.5)
    assert eager.get_or_build(f"{prefix}:k", Builder("new")) == "new"
    assert metric("kvfleet_cache_early_refreshes_total", prefix) == 1

    lazy = make_cache(ttl_s=60, early_refresh_beta=0.0)
    lazy.set(f"{prefix}:j", "old", build_s=0.5)
    assert lazy.get_or_build(f"{prefix}:j", Builder("new")) == "old"


def test_a_waiter_takes_over_when_the_builder_fails(make_cache, cache_client, prefix):
    cache = make_cache(poll_s=0.05)
    key = f"{prefix}:k"
    release = threading.Event()
    failing = Builder(hold=lambda: release.wait(TIMEOUT_S), fail=True)
    holder = Call(lambda: cache.get_or_build(key, failing))
    second = Builder("second")
    try:
        assert failing.started.wait(TIMEOUT_S)
        waiter = Call(lambda: cache.get_or_build(key, second))
        wait_until(lambda: subscribers(cache_client, Keys(prefix).lock(key)) == 1, "the second caller waits")
    finally:
        release.set()  # now the build fails
    assert waiter.result() == "second"
    with pytest.raises(RuntimeError, match="build failed"):
        holder.result()  # the failure reaches the caller that ran the build
    assert second.runs == 1
    assert metric("kvfleet_cache_lock_takeovers_total", prefix) == 1


def test_a_waiter_builds_itself_after_the_timeout(make_cache, cache_client, prefix):
    cache = make_cache(wait_timeout_s=0.3, poll_s=0.05)
    hung = Lease(cache_client, Keys(prefix).lock(f"{prefix}:k"), 10_000)
    assert hung.acquire()  # a holder that keeps its lease but never finishes
    started = time.perf_counter()
    assert cache.get_or_build(f"{prefix}:k", Builder("mine")) == "mine"
    # A lower bound only, kept by the waiter's own deadline: a slow machine can only add to it.
    assert time.perf_counter() - started >= 0.3
    assert cache_client.get(hung.key) == hung.token.encode()  # built beside the holder, not after taking its lease over
    assert metric("kvfleet_cache_wait_timeouts_total", prefix) == 1
    hung.release()


def test_without_the_lock_every_missing_caller_builds(make_cache, prefix):
    cache = make_cache(use_lock=False)
    everyone = threading.Barrier(5)
    # Each build waits for all five to be building: none can store the value early.
    build = Builder("v", hold=lambda: everyone.wait(TIMEOUT_S))
    calls = [Call(lambda: cache.get_or_build(f"{prefix}:k", build)) for _ in range(5)]
    assert [c.result() for c in calls] == ["v"] * 5
    assert build.runs == 5


@pytest.mark.parametrize("garbage", [b"", b"nonsense", b"KVC1\x09" + bytes(19) + b"x", b"KVC1\x01" + bytes(19) + b"\xc1"])
def test_an_undecodable_value_is_deleted_and_rebuilt(make_cache, cache_client, prefix, garbage):
    cache_client.set(f"{prefix}:k", garbage)
    cache = make_cache()
    assert cache.get(f"{prefix}:k") is NO_VALUE
    assert not cache_client.exists(f"{prefix}:k")
    assert cache.get_or_build(f"{prefix}:k", Builder("fresh")) == "fresh"
    assert metric("kvfleet_cache_corrupt_values_total", prefix) == 1
