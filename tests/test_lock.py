"""kvstore.lock.Lease against the real cache Redis: exclusivity, ownership, expiry, renewal."""

from __future__ import annotations

import time

import redis as redis_lib

from kvstore.lock import Lease

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
