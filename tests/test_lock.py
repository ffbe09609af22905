"""kvstore.lock.Lease against the real cache Redis: exclusivity, ownership, expiry, renewal."""

from __future__ import annotations

import threading
import time

import redis as redis_lib

from kvstore.lock import Lease, Renewer

#: The most any wait below may take; only a broken behaviour reaches it.
TIMEOUT_S = 30.0


def wait_until(condition, what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


def held(lease: Lease) -> bool:
    """The lease's key holds its token: read from Redis, not from the lease."""
    return lease.client.get(lease.key) in (lease.token, lease.token.encode())


def test_only_one_caller_acquires(cache_client, prefix):
    a, b = Lease(cache_client, f"{prefix}:l", 5000), Lease(cache_client, f"{prefix}:l", 5000)
    assert a.acquire()
    assert not b.acquire()
    assert held(a) and not held(b)


def test_only_the_owner_releases(cache_client, prefix):
    a, b = Lease(cache_client, f"{prefix}:l", 5000), Lease(cache_client, f"{prefix}:l", 5000)
    assert a.acquire()
    assert not b.release()  # compare-and-delete refuses a stranger
    assert held(a)
    assert a.release()
    assert not cache_client.exists(a.key)


def test_expired_lease_is_taken_over_and_a_late_release_spares_the_new_owner(cache_client, prefix):
    dead, taker = Lease(cache_client, f"{prefix}:l", 200), Lease(cache_client, f"{prefix}:l", 5000)
    assert dead.acquire()
    wait_until(lambda: not cache_client.exists(dead.key), "the key expired")  # the holder stopped renewing
    assert taker.acquire()
    assert not dead.renew()
    assert not dead.release()
    assert held(taker)


def test_keep_alive_outlives_the_ttl_until_release(cache_client, prefix):
    # A TTL that leaves a renewer held up by a busy machine two chances (it renews every third).
    a, b = Lease(cache_client, f"{prefix}:l", 1000), Lease(cache_client, f"{prefix}:l", 1000)
    assert a.acquire()
    a.keep_alive()
    renewals, last = 0, cache_client.pttl(a.key)

    def renewed_beyond_the_ttl() -> bool:
        nonlocal renewals, last
        pttl = cache_client.pttl(a.key)
        assert held(a) and not b.acquire(), "the lease lapsed while kept alive"
        renewals, last = renewals + (pttl > last), pttl  # its PTTL went back up
        return renewals >= 10  # renewed every third of the TTL: ten renewals outlast three TTLs

    wait_until(renewed_beyond_the_ttl, "the lease was renewed past three TTLs")
    assert held(a) and not b.acquire()
    assert a.release()
    assert not cache_client.exists(a.key)
    assert a._renewer is None  # joined: nothing renews a lease we no longer hold


def test_renewer_stops_on_a_stolen_lease(cache_client, prefix):
    a, b = Lease(cache_client, f"{prefix}:l", 300), Lease(cache_client, f"{prefix}:l", 5000)
    assert a.acquire()
    a.keep_alive()
    cache_client.delete(a.key)  # e.g. evicted by allkeys-lru
    assert b.acquire()
    wait_until(lambda: not a._renewer.is_alive(), "the renewer found the lease gone and stopped")
    assert held(b)
    a.release()
    assert held(b)


def test_a_decoding_client_works(cache_redis_url, prefix):
    client = redis_lib.Redis.from_url(cache_redis_url, decode_responses=True)
    try:
        a = Lease(client, f"{prefix}:l", 5000)
        assert a.acquire() and held(a)
        assert a.release() and not client.exists(a.key)
    finally:
        client.close()


def test_a_renewer_keeps_many_leases_alive_from_one_thread_until_dropped(cache_client, prefix):
    renewer = Renewer(name=f"renewer-{prefix}")
    # A TTL that leaves a renewer held up by a busy machine two chances, as above.
    leases = [Lease(cache_client, f"{prefix}:l{i}", 1000) for i in range(3)]
    for lease in leases:
        assert lease.acquire()
        renewer.hold(lease)
    renewers = [t for t in threading.enumerate() if t.name == renewer.name]
    assert len(renewers) == 1  # one thread for all of them
    time.sleep(2.5)  # two and a half TTLs: only renewals keep them
    assert all(held(lease) for lease in leases)
    renewer.drop(leases[0])
    wait_until(lambda: not cache_client.exists(leases[0].key), "the dropped lease expired")
    assert held(leases[1]) and held(leases[2])
    assert renewer.held == 2
    for lease in leases[1:]:
        renewer.drop(lease)
        assert lease.release()
    assert renewer.held == 0


def test_a_renewer_lets_go_of_a_stolen_lease_and_renews_nothing_it_does_not_own(cache_client, prefix):
    renewer = Renewer(name=f"renewer-{prefix}")
    a, b = Lease(cache_client, f"{prefix}:l", 300), Lease(cache_client, f"{prefix}:l", 5000)
    assert a.acquire()
    renewer.hold(a)
    cache_client.delete(a.key)  # e.g. evicted by allkeys-lru
    assert b.acquire()
    wait_until(lambda: renewer.held == 0, "the renewer found the lease gone and dropped it")
    assert held(b) and cache_client.pttl(b.key) > 4000  # b's TTL, never a's 300 ms


def test_a_lease_held_shorter_than_a_third_of_its_ttl_costs_no_renewal(cache_client, prefix):
    renewer = Renewer(name=f"renewer-{prefix}")
    a = Lease(cache_client, f"{prefix}:l", 6000)  # due 2 s after it is taken
    assert a.acquire()
    renewed = []
    renew = renewer._renew
    renewer._renew = lambda due: (renewed.extend(due), renew(due))
    renewer.hold(a)
    time.sleep(0.3)
    renewer.drop(a)
    assert a.release()
    time.sleep(2.2)  # past when it would have come due
    assert renewed == []


def test_a_renewer_outlives_an_unexpected_error_and_keeps_renewing(cache_client, prefix):
    renewer = Renewer(name=f"renewer-{prefix}")
    a = Lease(cache_client, f"{prefix}:l", 1500)  # the failed round and the retry: 500 ms apart, 1,000 before expiry
    assert a.acquire()
    failed, renew = [], renewer._renew

    def once_broken(due):
        if not failed:
            failed.append(due)
            raise RuntimeError("a bug in one renewal")
        return renew(due)

    renewer._renew = once_broken
    renewer.hold(a)
    time.sleep(4.0)  # over two and a half TTLs: the failed round, then renewals again
    assert failed and held(a)
    renewer.drop(a)
    assert a.release()


def test_the_leases_of_one_client_share_their_scripts_and_still_work_after_redis_forgets_them(cache_client, prefix):
    # Registered once per client, not per lease (a worker makes two leases a job).
    first = Lease(cache_client, f"{prefix}:shared:a", 5_000)
    second = Lease(cache_client, f"{prefix}:shared:b", 5_000)
    assert first._release is second._release and first._renew is second._renew
    assert first.acquire() and second.acquire()
    cache_client.script_flush()  # a restarted Redis: the shared scripts load themselves again
    assert first.renew() and second.release()
    assert first.release() and cache_client.exists(f"{prefix}:shared:a", f"{prefix}:shared:b") == 0
