"""kvstore.cache.Cache and kvstore.singleflight in one process (threads) against real Redis.

The cross-process stampede and SIGKILL cases are in test_kvstore_stampede.py.
"""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client import REGISTRY

from kvfleet.constants import Keys
from kvstore.cache import Cache
from kvstore.lock import Lease
from kvstore.singleflight import NO_VALUE


def metric(name: str, cache: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"cache": cache, **labels}) or 0.0


class Builder:
    """A build function that counts its runs, optionally slow, optionally failing."""

    def __init__(self, value=None, *, delay_s: float = 0.0, fail: bool = False) -> None:
        self.value, self.delay_s, self.fail = value, delay_s, fail
        self.runs = 0
        self.started = threading.Event()

    def __call__(self):
        self.runs += 1
        self.started.set()
        time.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("build failed")
        return self.value


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
    for i in range(40):
        cache.set(f"{prefix}:k{i}", i)
    pttls = [cache_client.pttl(f"{prefix}:k{i}") for i in range(40)]
    assert all(139_000 <= p <= 160_000 for p in pttls)  # (100 ± 10%) + 50 s
    assert len(set(pttls)) > 30  # written together, expiring apart
    entry = cache.entry(f"{prefix}:k0")
    assert 89 < entry.expires_at - time.time() < 111  # the logical expiry inside the value


def test_stale_value_is_served_while_exactly_one_caller_rebuilds(make_cache, prefix):
    cache = make_cache(ttl_s=0.2, grace_s=30)
    key = f"{prefix}:k"
    cache.set(key, "old")
    time.sleep(0.3)  # logically expired, physically present
    rebuild = Builder("new", delay_s=0.6)
    refresher = threading.Thread(target=lambda: cache.get_or_build(key, rebuild))
    refresher.start()
    assert rebuild.started.wait(5)

    others = Builder("other")
    for _ in range(10):
        started = time.perf_counter()
        assert cache.get_or_build(key, others) == "old"
        assert time.perf_counter() - started < 0.2  # served at once, not after the rebuild
    refresher.join()
    assert rebuild.runs == 1 and others.runs == 0
    assert cache.get_or_build(key, others) == "new"  # the next read sees the rebuilt value
    assert metric("kvfleet_cache_hits_total", prefix, state="stale") == 10


def test_waiters_are_woken_by_the_release_not_by_polling(make_cache, prefix):
    cache = make_cache(poll_s=5.0)  # polling alone would take 5 s
    build = Builder("v", delay_s=0.3)
    holder = threading.Thread(target=lambda: cache.get_or_build(f"{prefix}:k", build))
    holder.start()
    assert build.started.wait(5)
    started = time.perf_counter()
    assert cache.get_or_build(f"{prefix}:k", Builder("waiter")) == "v"
    assert time.perf_counter() - started < 2.0
    holder.join()
    assert metric("kvfleet_cache_lock_waits_total", prefix) == 1


def test_xfetch_refreshes_a_fresh_entry_early(make_cache, prefix):
    eager = make_cache(ttl_s=60, early_refresh_beta=1e9)  # δ·β dwarfs the 60 s left
    eager.set(f"{prefix}:k", "old", build_s=0.5)
    assert eager.get_or_build(f"{prefix}:k", Builder("new")) == "new"
    assert metric("kvfleet_cache_early_refreshes_total", prefix) == 1

    lazy = make_cache(ttl_s=60, early_refresh_beta=0.0)
    lazy.set(f"{prefix}:j", "old", build_s=0.5)
    assert lazy.get_or_build(f"{prefix}:j", Builder("new")) == "old"


def test_a_waiter_takes_over_when_the_builder_fails(make_cache, prefix):
    cache = make_cache(poll_s=0.05)
    failing = Builder(delay_s=0.3, fail=True)
    errors = []

    def holder():
        try:
            cache.get_or_build(f"{prefix}:k", failing)
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=holder)
    thread.start()
    assert failing.started.wait(5)
    second = Builder("second")
    assert cache.get_or_build(f"{prefix}:k", second) == "second"
    thread.join()
    assert len(errors) == 1  # the failure reaches the caller that ran the build
    assert second.runs == 1
    assert metric("kvfleet_cache_lock_takeovers_total", prefix) == 1


def test_a_waiter_builds_itself_after_the_timeout(make_cache, cache_client, prefix):
    cache = make_cache(wait_timeout_s=0.3, poll_s=0.05)
    hung = Lease(cache_client, Keys(prefix).lock(f"{prefix}:k"), 10_000)
    assert hung.acquire()  # a holder that keeps its lease but never finishes
    started = time.perf_counter()
    assert cache.get_or_build(f"{prefix}:k", Builder("mine")) == "mine"
    assert time.perf_counter() - started >= 0.3
    assert metric("kvfleet_cache_wait_timeouts_total", prefix) == 1
    hung.release()


def test_without_the_lock_every_missing_caller_builds(make_cache, prefix):
    cache = make_cache(use_lock=False)
    build = Builder("v", delay_s=0.2)
    threads = [threading.Thread(target=lambda: cache.get_or_build(f"{prefix}:k", build)) for _ in range(5)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert build.runs == 5


@pytest.mark.parametrize("garbage", [b"", b"nonsense", b"KVC1\x09" + bytes(19) + b"x", b"KVC1\x01" + bytes(19) + b"\xc1"])
def test_an_undecodable_value_is_deleted_and_rebuilt(make_cache, cache_client, prefix, garbage):
    cache_client.set(f"{prefix}:k", garbage)
    cache = make_cache()
    assert cache.get(f"{prefix}:k") is NO_VALUE
    assert not cache_client.exists(f"{prefix}:k")
    assert cache.get_or_build(f"{prefix}:k", Builder("fresh")) == "fresh"
    assert metric("kvfleet_cache_corrupt_values_total", prefix) == 1
