"""Fleet capacity from live worker heartbeats on the real Redis."""

from __future__ import annotations

import time


from kvfleet import registry
from kvfleet.capacity import FleetCapacity
from kvfleet.constants import Keys
from kvfleet.contracts import WorkerHeartbeat


def publish_heartbeat(client, keys: Keys, worker_id: str, capacity: int, *, ttl_s: float = 10.0) -> None:
    """What workers/heartbeat.py writes."""
    beat = WorkerHeartbeat(worker_id=worker_id, capacity_tokens=capacity)
    registry.publish(client, keys, beat, ttl_ms=int(ttl_s * 1000))


def test_sums_live_workers_and_drops_silent_ones(redis_client, prefix):
    keys = Keys(prefix)
    publish_heartbeat(redis_client, keys, "w1", 32_768)
    publish_heartbeat(redis_client, keys, "w2", 16_384)
    capacity = FleetCapacity(redis_client, keys, cache_s=0.0)
    assert capacity.read() == 49_152
    assert sorted(b.worker_id for b in capacity.heartbeats()) == ["w1", "w2"]
    publish_heartbeat(redis_client, keys, "w2", 16_384, ttl_s=0.3)  # its last beat: then it goes silent
    deadline = time.monotonic() + 30
    while redis_client.exists(keys.worker("w2")):  # until its heartbeat's TTL runs out
        assert time.monotonic() < deadline, "the heartbeat never expired"
        time.sleep(0.01)
    assert capacity.read() == 32_768


def test_ceiling_caps_and_malformed_beats_are_skipped(redis_client, prefix):
    keys = Keys(prefix)
    publish_heartbeat(redis_client, keys, "w1", 32_768)
    redis_client.set(keys.worker("broken"), b'{"worker_id": "broken"}', px=10_000)
    redis_client.zadd(keys.workers_index, {"broken": time.time() + 10})
    assert FleetCapacity(redis_client, keys, cache_s=0.0).read() == 32_768
    assert FleetCapacity(redis_client, keys, ceiling_tokens=20_000, cache_s=0.0).read() == 20_000


def test_reads_are_cached_for_cache_s(redis_client, prefix):
    keys, now = Keys(prefix), [0.0]
    capacity = FleetCapacity(redis_client, keys, cache_s=1.0, clock=lambda: now[0])
    assert capacity.read() == 0
    publish_heartbeat(redis_client, keys, "w1", 32_768)
    now[0] = 0.5
    assert capacity.read() == 0  # within cache_s: the earlier sum
    now[0] = 1.0
    assert capacity.read() == 32_768


def test_jobs_per_message_is_what_every_live_worker_takes(redis_client, prefix):
    keys = Keys(prefix)
    capacity = FleetCapacity(redis_client, keys, cache_s=0.0)
    assert capacity.jobs_per_message() == 1  # no worker: nothing to pack for
    for worker_id, most in (("w1", 64), ("w2", 16)):
        registry.publish(redis_client, keys, WorkerHeartbeat(worker_id=worker_id, capacity_tokens=1024,
                                                             jobs_per_message=most), ttl_ms=10_000)
    assert capacity.jobs_per_message() == 16
    publish_heartbeat(redis_client, keys, "old", 1024)  # a worker from before: one job per message
    assert capacity.jobs_per_message() == 1
