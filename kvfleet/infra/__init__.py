"""Local infrastructure for development and tests: the real Kafka broker and Redis.

`up()` is idempotent: what runs already is reused, what was fetched is not fetched again.
"""

from __future__ import annotations

from kvfleet.infra import kafka, redis


def up() -> dict[str, str]:
    addresses = {"kafka": kafka.start()}
    for inst in redis.INSTANCES:
        addresses[f"redis-{inst.name}"] = redis.start(inst)
    return addresses


def down() -> None:
    kafka.stop()
    for inst in redis.INSTANCES:
        redis.stop(inst)


def status() -> dict[str, bool]:
    result = {"kafka": kafka.running()}
    for inst in redis.INSTANCES:
        result[f"redis-{inst.name}"] = redis.running(inst)
    return result
