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
CALLERS = PROCESSES * THREADS
#: The most any wait below may take; only a broken behaviour reaches it.
TIMEOUT_S = 60.0
#: The killed builder's lease: renewed every third, so a renewer thread held up by a
#: busy machine still has two chances before the lease would lapse under a live holder.
VICTIM_LEASE_S = 2.0


def make_cache(url: str, prefix: str, **options) -> Cache:
    client = redis_lib.Redis.from_url(url, max_connections=64)
    options.setdefault("lock_ttl_s", 2.0)
    options.setdefault("wait_timeout_s", 2 * TIMEOUT_S)  # waiters never give up while a test still waits
    return Cache(client, Keys(prefix), name=prefix, ttl_s=30, early_refresh_beta=0.0, **options)


def wait_until(condition, what: str, *, timeout_s: float = TIMEOUT_S, poll_s: float = 0.01) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting until {what}")
        time.sleep(poll_s)


def counted_build(client: redis_lib.Redis, prefix: str, value: str, *, until_arrived: int = 0):
    """A build counted in Redis that returns only once `until_arrived` callers have asked."""

    def build() -> str:
        client.incr(f"{prefix}:builds")
        wait_until(lambda: int(client.get(f"{prefix}:arrived") or 0) >= until_arrived, "every caller has asked",
                   poll_s=0.05)  # up to 200 builders polling at once without the lock
        return value

    return build


def callers(url: str, prefix: str, use_lock: bool, ready, go, results) -> None:
    """One process: THREADS threads ask for the same missing key at the same moment."""
    cache = make_cache(url, prefix, use_lock=use_lock)
    # No value is stored before all CALLERS have asked: every one of them meets the
    # first build in flight, with the lock or without it.
    build = counted_build(cache.client, prefix, "value", until_arrived=CALLERS)
    out: list[str] = []
    barrier = threading.Barrier(THREADS)

    def one() -> None:
        barrier.wait()
        cache.client.incr(f"{prefix}:arrived")
        out.append(cache.get_or_build(f"{prefix}:hot", build))

    threads = [threading.Thread(target=one) for _ in range(THREADS)]
    ready.put(os.getpid())
    go.wait(TIMEOUT_S)
    [t.start() for t in threads]
    [t.join() for t in threads]
    results.put(out)


def stampede(url: str, prefix: str, *, use_lock: bool) -> tuple[int, list[str]]:
    ctx = mp.get_context("spawn")
    ready, go, results = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=callers, args=(url, prefix, use_lock, ready, go, results)) for _ in range(PROCESSES)]
    [p.start() for p in procs]
    for _ in procs:
        ready.get(timeout=TIMEOUT_S)  # every process imported and connected: start them together
    go.set()
    values = [v for _ in procs for v in results.get(timeout=TIMEOUT_S)]
    [p.join(10) for p in procs]
    assert all(p.exitcode == 0 for p in procs)
    return int(redis_lib.Redis.from_url(url).get(f"{prefix}:builds") or 0), values


def test_stampede_with_the_lock_builds_once(cache_redis_url, prefix):
    builds, values = stampede(cache_redis_url, prefix, use_lock=True)
    assert values == ["value"] * CALLERS
    assert builds == 1


def test_stampede_without_the_lock_builds_many_times(cache_redis_url, prefix):
    builds, values = stampede(cache_redis_url, prefix, use_lock=False)
    assert values == ["value"] * CALLERS
    assert builds > 1  # what the lock prevents (typically close to 200)


def hung_builder(url: str, prefix: str) -> None:
    """Takes the lock, starts building, and never finishes (the test SIGKILLs it)."""
    cache = make_cache(url, prefix, lock_ttl_s=VICTIM_LEASE_S)

    def build() -> str:
        cache.client.incr(f"{prefix}:builds")
        cache.client.set(f"{prefix}:started", 1)
        threading.Event().wait()  # hangs until killed
        return "never"

    cache.get_or_build(f"{prefix}:hot", build)


def wait_for_renewals(client: redis_lib.Redis, key: str, count: int) -> None:
    """Until the lease under `key` was renewed `count` times: its PTTL went back up."""
    seen = [0, client.pttl(key)]

    def renewed() -> bool:
        pttl = client.pttl(key)
        assert pttl > 0, "the lease ran out while its holder was alive"
        seen[0] += pttl > seen[1]
        seen[1] = pttl
        return seen[0] >= count

    wait_until(renewed, f"the lease was renewed {count} times")


def test_a_killed_builder_is_taken_over_after_the_lock_ttl(cache_redis_url, cache_client, prefix):
    ctx = mp.get_context("spawn")
    victim = ctx.Process(target=hung_builder, args=(cache_redis_url, prefix))
    victim.start()
    try:
        wait_until(lambda: cache_client.exists(f"{prefix}:started") or not victim.is_alive(), "the victim builds")
        assert victim.is_alive()
        lock_key = Keys(prefix).lock(f"{prefix}:hot")
        cache = make_cache(cache_redis_url, prefix, lock_ttl_s=1.0, poll_s=0.1)
        build = counted_build(cache.client, prefix, "rebuilt")
        values: list[str] = []
        waiters = [threading.Thread(target=lambda: values.append(cache.get_or_build(f"{prefix}:hot", build)),
                                    daemon=True) for _ in range(10)]
        [t.start() for t in waiters]
        # The waiters wait on a live holder, which keeps its lease past its TTL by renewing it.
        wait_until(lambda: cache_client.pubsub_numsub(lock_key)[0][1] == 10, "all ten wait")
        wait_for_renewals(cache_client, lock_key, 4)  # more than one whole TTL
        assert values == [] and int(cache_client.get(f"{prefix}:builds")) == 1
        os.kill(victim.pid, signal.SIGKILL)
        [t.join(TIMEOUT_S) for t in waiters]
    finally:
        victim.kill()  # a no-op once it is dead
        victim.join(10)

    assert values == ["rebuilt"] * 10
    assert int(cache_client.get(f"{prefix}:builds")) == 2  # the killed build, and exactly one more
    # Taken over when the dead holder's lease expired, not built by waiters giving up.
    assert REGISTRY.get_sample_value("kvfleet_cache_lock_takeovers_total", {"cache": prefix}) == 1
    assert not REGISTRY.get_sample_value("kvfleet_cache_wait_timeouts_total", {"cache": prefix})
