"""Which workers are alive, and their heartbeats, in Redis.

A worker's heartbeat lives under `Keys.worker(id)` with a short TTL: the key's
existence *is* the liveness. The index `Keys.workers_index` (a sorted set of worker ids,
scored by when their last heartbeat expires) only lists where to look, so a reader does
one ZRANGE and one MGET instead of SCANning the whole keyspace (which also holds every
job's state and would grow with traffic). Index entries are pruned well after their
score, so clock skew between hosts can never drop a live worker: a dead one is dropped
by its key's TTL, whatever the index says.
"""

from __future__ import annotations

import logging
import time

import msgspec
import redis

from kvfleet.constants import Keys
from kvfleet.contracts import WorkerHeartbeat

log = logging.getLogger(__name__)
_decoder = msgspec.json.Decoder(WorkerHeartbeat)
#: Index entries this long past their expiry are removed (generous: it is only an index).
PRUNE_AFTER_S = 300.0


def publish(client: redis.Redis, keys: Keys, beat: WorkerHeartbeat, *, ttl_ms: int) -> None:
    pipe = client.pipeline(transaction=True)  # key and index entry together
    pipe.set(keys.worker(beat.worker_id), msgspec.json.encode(beat), px=ttl_ms)
    pipe.zadd(keys.workers_index, {beat.worker_id: time.time() + ttl_ms / 1000})
    pipe.execute()


def withdraw(client: redis.Redis, keys: Keys, worker_id: str) -> None:
    pipe = client.pipeline(transaction=True)
    pipe.delete(keys.worker(worker_id))
    pipe.zrem(keys.workers_index, worker_id)
    pipe.execute()


def live(client: redis.Redis, keys: Keys) -> list[WorkerHeartbeat]:
    """The heartbeats of the workers alive now."""
    client.zremrangebyscore(keys.workers_index, "-inf", time.time() - PRUNE_AFTER_S)
    ids = [i.decode() for i in client.zrange(keys.workers_index, 0, -1)]
    beats = []
    for worker_id, raw in zip(ids, client.mget([keys.worker(i) for i in ids]) if ids else []):
        if raw is None:
            continue  # its key expired: that worker is gone
        try:
            beats.append(_decoder.decode(raw))
        except msgspec.DecodeError as exc:
            # One bad writer must not zero the fleet's capacity: skip it, loudly.
            log.warning("ignoring malformed heartbeat of %s: %s", worker_id, exc)
    return beats
