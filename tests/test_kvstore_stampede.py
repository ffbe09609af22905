"""The stampede cases across OS processes (multiprocessing 'spawn'), against real Redis.

Builds are counted with INCR in Redis, so every process's builds land in one number.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import redis as redis_lib
from prometheus_client import REGISTRY

from kvfleet.constants import Keys
from kvstore.cache import Cache

PROCESSES = 8
THREADS = 25
BUILD_S = 0.5  # long enough that all 200 callers arrive while the first build runs


def make_cache(url: str, prefix: str, **options) -> Cache:
    client = redis_lib.Redis.from_url(url, max_connections=64)
    options.setdefault("lock_ttl_s", 2.0)
    return Cache(client, Keys(prefix), name=prefix, ttl_s=30, early_refresh_beta=0.0, **options)


def counted_build(client: redis_lib.Redis, prefix: str, value: str, delay_s: float):
    def build() -> str:
        client.incr(f"{prefix}:builds")
        time.sleep(delay_s)
        return value

    return build


def callers(url: str, prefix: str, use_lock: bool, ready, go, results) -> None:
    """One process: THREADS threads ask for the same missing key at the same moment."""
    cache = make_cache(url, prefix, use_lock=use_lock)
    build = counted_build(cache.client, prefix, "value", BUILD_S)
    out: list[str] = []
    barrier = threading.Barrier(THREADS)

    def one() -> None:
        barrier.wait()
        out.append(cache.get_or_build(f"{prefix}:hot", build))

    threads = [threading.Thread(target=one) for _ in range(THREADS)]
    ready.put(os.getpid())
    go.wait(60)
    [t.start() for t in threads]
    [t.join() for t in threads]
    results.put(out)


def stampede(url: str, prefix: str, *, use_lock: bool) -> tuple[int, list[str]]:
    ctx = mp.get_context("spawn")
    ready, go, results = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=callers, args=(url, prefix, use_lock, ready, go, results)) for _ in range(PROCESSES)]
    [p.start() for p in procs]
    for _ in procs:
        ready.get(timeout=60)  # every process imported and connected: start them together
    go.set()
    values = [v for _ in procs for v in results.get(timeout=60)]
    [p.join(10) for p in procs]
    assert all(p.exitcode == 0 for p in procs)
    return int(redis_lib.Redis.from_url(url).get(f"{prefix}:builds") or 0), values


def test_stampede_with_the_lock_builds_once(cache_redis_url, prefix):
    builds, values = stampede(cache_redis_url, prefix, use_lock=True)
    assert values == ["value"] * PROCESSES * THREADS
    assert builds == 1


def test_stampede_without_the_lock_builds_many_times(cache_redis_url, prefix):
    builds, values = stampede(cache_redis_url, prefix, use_lock=False)
    assert values == ["value"] * PROCESSES * THREADS
    assert builds > 1  # what the lock prevents (typically close to 200)


def hung_builder(url: str, prefix: str) -> None:
    """Takes the lock, starts building, and never finishes (the test SIGKILLs it)."""
    cache = make_cache(url, prefix, lock_ttl_s=1.0)

    def build() -> str:
        cache.client.incr(f"{prefix}:builds")
        cache.client.set(f"{prefix}:started", 1)
        time.sleep(600)
        return "never"

    cache.get_or_build(f"{prefix}:hot", build)


def test_a_killed_builder_is_taken_over_after_the_lock_ttl(cache_redis_url, cache_client, prefix):
    ctx = mp.get_context("spawn")
    victim = ctx.Process(target=hung_builder, args=(cache_redis_url, prefix))
    victim.start()
    deadline = time.monotonic() + 60
    while not cache_client.exists(f"{prefix}:started"):
        assert time.monotonic() < deadline and victim.is_alive()
        time.sleep(0.02)

    cache = make_cache(cache_redis_url, prefix, lock_ttl_s=1.0, poll_s=0.1)
    build = counted_build(cache.client, prefix, "rebuilt", 0.1)
    values: list[str] = []
    waiters = [threading.Thread(target=lambda: values.append(cache.get_or_build(f"{prefix}:hot", build))) for _ in range(10)]
    [t.start() for t in waiters]
    time.sleep(0.5)  # the waiters are waiting on a live holder, renewing its lease
    assert values == []
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    [t.join(30) for t in waiters]
    victim.join(10)

    assert values == ["rebuilt"] * 10
    assert int(cache_client.get(f"{prefix}:builds")) == 2  # the killed build, and exactly one more
    assert time.monotonic() - killed_at < 1.0 + 0.1 + 1.0  # lease TTL + a poll + slack
    assert REGISTRY.get_sample_value("kvfleet_cache_lock_takeovers_total", {"cache": prefix}) == 1
