"""Shared fixtures: the real Kafka broker and Redis servers, started once per session.

Integration tests never mock these. If they cannot start, the fixture raises and every
test that needs them errors (never skips), so a broken set-up cannot pass quietly.
Tests use Redis database 1 (the demo fleet uses 0) and a fresh key/topic prefix each,
so they neither see each other's keys nor a running demo's.
"""

from __future__ import annotations

import os
import uuid

import pytest
import redis as redis_lib

import kvfleet.infra as infra

TEST_DB = 1


@pytest.fixture(scope="session")
def local_infra() -> dict[str, str]:
    # No flush: each test writes under its own prefix, and test sessions may overlap.
    return infra.up()


@pytest.fixture(scope="session")
def kafka_bootstrap(local_infra) -> str:
    return local_infra["kafka"]


@pytest.fixture(scope="session")
def redis_url(local_infra) -> str:
    return local_infra["redis-state"].rsplit("/", 1)[0] + f"/{TEST_DB}"


@pytest.fixture(scope="session")
def cache_redis_url(local_infra) -> str:
    return local_infra["redis-cache"].rsplit("/", 1)[0] + f"/{TEST_DB}"


@pytest.fixture
def redis_client(redis_url):
    client = redis_lib.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def cache_client(cache_redis_url):
    client = redis_lib.Redis.from_url(cache_redis_url)
    yield client
    client.close()


@pytest.fixture
def prefix() -> str:
    """A fresh namespace for one test's Redis keys, Kafka topics and Celery queues."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture(autouse=True, scope="session")
def _torch_threads():
    # Two cores: one intra-op thread per process keeps parallel test processes from
    # fighting over them.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    yield


@pytest.fixture
def make_fleet(local_infra, redis_url, cache_redis_url, prefix, tmp_path):
    """Start a fleet with `make_fleet(workers=1, ...)`; everything is stopped at teardown."""
    from tests.fleet import Fleet

    fleets = []

    def make(*, workers: int = 1, model: str = "builtin:tiny", extra_env=None, wait: bool = True):
        fleet = Fleet(prefix=f"{prefix}{len(fleets)}", kafka=local_infra["kafka"], redis_url=redis_url,
                      cache_redis_url=cache_redis_url, log_dir=tmp_path, model=model, extra_env=extra_env)
        fleets.append(fleet)
        fleet.start("api")
        fleet.start("scheduler")
        for _ in range(workers):
            fleet.start("worker")
        if wait:
            fleet.wait_ready(workers=workers)
        return fleet

    yield make
    for fleet in fleets:
        fleet.stop()
