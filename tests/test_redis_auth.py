"""The fleet against a Redis that requires a password (Redis AUTH through the URL, as
docs/operations.md describes): the API, the scheduler, the worker, the Celery broker and
the cold tier all authenticate, and a job runs end to end."""

from __future__ import annotations

import secrets
import shutil
import subprocess
import uuid

import pytest
import redis

from producer.client import Client
from tests.fleet import Fleet, free_port, wait_for


@pytest.fixture
def locked_redis(tmp_path):
    port, password = free_port(), secrets.token_hex(12)
    server = subprocess.Popen([shutil.which("redis-server") or "/usr/bin/redis-server", "--port", str(port),
                               "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                               "--requirepass", password, "--dir", str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        client = redis.Redis(port=port, password=password)
        wait_for(lambda: _pings(client), "the password-protected Redis", timeout=20)
        yield port, password
    finally:
        server.terminate()
        server.wait(timeout=10)


def _pings(client: redis.Redis) -> bool:
    try:
        return client.ping()
    except redis.ConnectionError:
        return False


def test_a_job_runs_against_a_redis_that_requires_a_password(locked_redis, local_infra, tmp_path):
    port, password = locked_redis
    with pytest.raises(redis.AuthenticationError):  # the server really refuses strangers
        redis.Redis(port=port).ping()
    url = f"redis://:{password}@127.0.0.1:{port}"
    fleet = Fleet(prefix=f"auth{uuid.uuid4().hex[:8]}", kafka=local_infra["kafka"], redis_url=f"{url}/0",
                  cache_redis_url=f"{url}/1", log_dir=tmp_path)
    try:
        for role in ("api", "scheduler", "worker"):
            fleet.start(role)
        fleet.wait_ready(workers=1)
        with Client(fleet.url, tenant="acme") as client:
            result = client.wait(client.submit("authenticated", max_new_tokens=4), timeout=120)
        assert result.status.value == "done" and len(result.tokens) == 4
        assert redis.Redis(port=port, password=password, db=0).exists(fleet.keys.job(result.job_id))
    finally:
        fleet.stop()
    assert password not in (tmp_path / "worker-3.log").read_text()  # logs show no secret
