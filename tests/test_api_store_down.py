"""The API with its state Redis gone: a submission is refused with 503 and "nothing
was queued" (it answered 500 before; bench/chaos.py found it), through the real API
process, the real Kafka and a real redis-server that this test stops."""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid

import httpx
import redis

from tests.fleet import Fleet, free_port, wait_for

TENANTS = {"tenants": [{"name": "acme", "tier": "silver", "tokens_per_minute": 600_000, "api_keys": ["key-acme"]}]}


def test_a_submission_while_the_state_redis_is_down_is_a_503_that_queued_nothing(local_infra, cache_redis_url,
                                                                                   tmp_path):
    port = free_port()
    server = subprocess.Popen([shutil.which("redis-server") or "/usr/bin/redis-server", "--port", str(port),
                               "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    fleet = None
    try:
        wait_for(lambda: _pings(url), "the test's redis-server to answer", 20)
        fleet = Fleet(prefix=f"t{uuid.uuid4().hex[:10]}", kafka=local_infra["kafka"], redis_url=url,
                      cache_redis_url=cache_redis_url, log_dir=tmp_path,
                      extra_env={"KVFLEET_TENANTS": json.dumps(TENANTS)})
        fleet.start("api")
        fleet.wait_ready(workers=0)
        body = {"prompt_tokens": [7] * 8, "max_new_tokens": 4}
        headers = {"Authorization": "Bearer key-acme"}
        assert httpx.post(f"{fleet.url}/v1/jobs", json=body, headers=headers).status_code == 202
        server.terminate()
        server.wait(timeout=20)
        refused = httpx.post(f"{fleet.url}/v1/jobs", json=body, headers=headers, timeout=30)
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert "nothing was queued" in error["message"] and "retry" in error["message"]
    finally:
        if server.poll() is None:
            server.kill()
        if fleet is not None:
            fleet.stop()


def _pings(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1).ping())
    except redis.RedisError:
        return False
