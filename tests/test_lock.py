"""kvstore.lock.Lease against the real cache Redis: exclusivity, ownership, expiry, renewal."""

from __future__ import annotations

import time

import redis as redis_lib

from kvstore.lock import Lease


def test_only_one_caller_acquires(cache_client, prefix):
    a, b = Lease(cache_client, f"{prefix}:l", 5000), Lease(cache_client, f"{prefix}:l", 5000)
    assert a.acquire()
    assert not b.acquire()
    assert a.held() and not b.held() and b.holder_exists()


def test_only_the_owner_releases(cache_client, prefix):
    a, b = Lease(cache_client, f"{prefix}:l", 5000), Lease(cache_client, f"{prefix}:l", 5000)
    assert a.acquire()
    assert not b.release()  # compare-and-delete refuses a stranger
    assert a.held()
    assert a.release()
    assert not a.holder_exists()


def test_expired_lease_is_taken_over_and_a_late_release_spares_the_new_owner(cache_client, prefix):
    dead, taker = Lease(cache_client, f"{prefix}:l", 200), Lease(cache_client, f"{prefix}:l", 5000)
    assert dead.acquire()
    time.sleep(0.3)  # the holder stopped renewing: the key expired
    assert taker.acquire()
    assert not dead.renew()
    assert not dead.release()
    assert taker.held()


def test_keep_alive_outlives_the_ttl_until_release(cache_client, prefix):
    a, b = Lease(cache_client, f"{prefix}:l", 300), Lease(cache_client, f"{prefix}:l", 300)
    assert a.acquire()
    a.keep_alive()
    time.sleep(1.0)  # more than three TTLs
    assert a.held() and not b.acquire()
    assert a.release()
    assert not a.holder_exists()
    assert a._renewer is None  # joined: nothing renews a lease we no longer hold


def test_renewer_reports_a_stolen_lease(cache_client, prefix):
    a, b = Lease(cache_client, f"{prefix}:l", 300), Lease(cache_client, f"{prefix}:l", 5000)
    assert a.acquire()
    a.keep_alive()
    cache_client.delete(a.key)  # e.g. evicted by allkeys-lru
    assert b.acquire()
    assert a.lost.wait(1.0)
    assert b.held()
    a.release()
    assert b.held()


def test_reacquiring_clears_lost(cache_client, prefix):
    a = Lease(cache_client, f"{prefix}:l", 5000)
    a.lost.set()
    assert a.acquire()
    assert not a.lost.is_set()


def test_held_works_with_a_decoding_client(cache_redis_url, prefix):
    client = redis_lib.Redis.from_url(cache_redis_url, decode_responses=True)
    try:
        a = Lease(client, f"{prefix}:l", 5000)
        assert a.acquire() and a.held()
    finally:
        client.close()
