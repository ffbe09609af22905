"""The API's admission checks through the real API process, Redis and Kafka (no
scheduler, no workers, so nothing leaves the queue): quotas with Retry-After, the
class ceiling, the class backlog bound, bronze under overload, tenants and API keys,
and cancelling a job."""

from __future__ import annotations

import json
import math
import time
import uuid

import httpx
import pytest

from kvfleet.constants import Keys
from kvfleet.jobstore import Admit, JobStore
from kvfleet.contracts import JobRequest, JobState, Priority
from tests.fleet import Fleet

TENANTS = {"tenants": [
    # 600 tokens a minute = 10 a second, at most 100 at once.
    {"name": "acme", "tier": "silver", "tokens_per_minute": 600, "burst_tokens": 100, "api_keys": ["key-acme-1"]},
    {"name": "globex", "tier": "silver", "tokens_per_minute": 600_000, "api_keys": ["key-globex-1"]},
    {"name": "cheap", "tier": "bronze", "tokens_per_minute": 600_000, "api_keys": ["key-cheap-1"]},
]}
ENV = {
    "KVFLEET_TENANTS": json.dumps(TENANTS),
    "KVFLEET_API_KEYS": "key-acme-2:acme",  # the older variable still works, joined with the above
    "KVFLEET_BASE_CEILING_TOKENS": "400",  # high 800, normal 400, low 100
    "KVFLEET_MAX_BACKLOG_LOW": "3",
    "KVFLEET_OVERLOAD_BACKLOG": "1",
}


@pytest.fixture(scope="module")
def api(local_infra, redis_url, cache_redis_url, tmp_path_factory):
    fleet = Fleet(prefix=f"t{uuid.uuid4().hex[:10]}", kafka=local_infra["kafka"], redis_url=redis_url,
                  cache_redis_url=cache_redis_url, log_dir=tmp_path_factory.mktemp("quota"), extra_env=ENV)
    fleet.start("api")
    fleet.wait_ready(workers=0)
    yield fleet
    fleet.stop()


def post(fleet: Fleet, key: str, tokens: int = 10, max_new: int = 40, priority: str = "normal") -> httpx.Response:
    """A job costing `tokens` + `max_new` tokens."""
    return httpx.post(f"{fleet.url}/v1/jobs", json={"prompt_tokens": [7] * tokens, "max_new_tokens": max_new},
                      headers={"X-API-Key": key, "X-Priority": priority})


def test_over_quota_gets_429_with_a_retry_after_that_is_right(api):
    assert post(api, "key-acme-1").status_code == 202  # 50 tokens
    assert post(api, "key-acme-2").status_code == 202  # the same tenant's other key: 100, the bucket is empty
    refused = post(api, "key-acme-1")
    assert refused.status_code == 429 and "quota" in refused.json()["error"]["message"]
    # The bucket as the refusal left it, on the server's clock (Redis TIME): `level`
    # tokens at `ts`, refilling at 10 a second. The same 50 tokens pass once it holds 50.
    level, refused_at = _bucket(api, "acme")
    ready_at = refused_at + (50 - level) / 10
    # Retry-After is that wait as an integer ceiling (5 s when the refusal came right after the drain).
    assert refused.headers["Retry-After"] == str(math.ceil(ready_at - refused_at))
    assert post(api, "key-globex-1").status_code == 202  # another tenant is unaffected
    # Every try the server evaluates before ready_at is refused, the first one after it
    # passes: judged by when the server says it took each try, not by how long we slept.
    deadline = time.monotonic() + 60
    while True:
        response = post(api, "key-acme-1")
        _, asked_at = _bucket(api, "acme")  # each take, refused or not, stamps the bucket
        if response.status_code == 202:
            assert asked_at >= ready_at - CLOCK_EPS_S, "accepted before the Retry-After"
            break
        assert response.status_code == 429, response.text
        assert asked_at < ready_at + CLOCK_EPS_S, "still refused after the Retry-After"
        assert time.monotonic() < deadline, "the bucket never refilled"
        time.sleep(0.25)


def test_a_job_larger_than_the_bucket_gets_413(api):
    response = post(api, "key-acme-1", tokens=61, max_new=40)
    assert response.status_code == 413 and "at most 100" in response.json()["error"]["message"]


def test_over_the_class_ceiling_gets_422_naming_the_ceilings(api):
    response = post(api, "key-globex-1", tokens=10, max_new=100, priority="low")  # 110 > low's 100
    assert response.status_code == 422, response.text
    error = response.json()["error"]["message"]
    assert "ceiling is 100" in error and "high 800" in error and "normal 400" in error


def test_keys_and_tenants(api):
    assert httpx.post(f"{api.url}/v1/jobs", json={"prompt": "hi"}).status_code == 401
    assert httpx.post(f"{api.url}/v1/jobs", json={"prompt": "hi"}, headers={"X-API-Key": "nope"}).status_code == 401
    other = httpx.post(f"{api.url}/v1/jobs", json={"prompt": "hi"},
                       headers={"X-API-Key": "key-acme-1", "X-Tenant-ID": "globex"})
    assert other.status_code == 403


def test_a_class_backlog_over_its_bound_gets_429_and_other_classes_pass(api):
    for _ in range(4):
        assert post(api, "key-globex-1", max_new=8, priority="low").status_code == 202
    response = _eventually(lambda: post(api, "key-globex-1", max_new=8, priority="low"), 429)
    assert "low jobs are waiting (bound 3)" in response.json()["error"]["message"]
    assert int(response.headers["Retry-After"]) >= 1  # nothing drains here: the longest hint
    assert post(api, "key-globex-1", max_new=8, priority="high").status_code == 202


def test_bronze_gets_503_under_overload_and_silver_does_not(api):
    store = JobStore(api.redis, Keys(api.prefix))
    api.fake_capacity(100)
    load = f"load-{uuid.uuid4().hex[:8]}"
    store.create(JobRequest(job_id=load, tenant="globex", priority=Priority.NORMAL, model="builtin:tiny",
                            max_new_tokens=90, submitted_at=time.time(), prompt_tokens=[7] * 5))
    # 95% of the budget in use (admitted as the scheduler would); jobs wait on Kafka.
    assert store.admit_many([Admit(load, 95, "globex", Priority.NORMAL)], capacity=100, lease_s=60,
                            now=time.time(), by="test")[0].reserved
    try:
        response = _eventually(lambda: post(api, "key-cheap-1", max_new=8), 503)
        assert "overloaded" in response.json()["error"]["message"] and response.headers["Retry-After"] == "30"
        assert post(api, "key-globex-1", max_new=8).status_code == 202
    finally:
        store.fail(load, JobState.CANCELLED, "cancelled", "the test's load ends", now=time.time())
    assert _eventually(lambda: post(api, "key-cheap-1", max_new=8), 202).status_code == 202


def test_cancel_releases_the_reservation_and_is_tenant_checked(api):
    job_id = post(api, "key-globex-1", max_new=8).json()["job_id"]
    store = JobStore(api.redis, Keys(api.prefix))
    api.fake_capacity(10_000)
    # Admitted as the scheduler would: its tokens are reserved.
    assert store.admit_many([Admit(job_id, 18, "globex", Priority.NORMAL)], capacity=10_000, lease_s=60,
                            now=time.time(), by="test")[0].reserved
    assert api.reserved(job_id) == 18
    url = f"{api.url}/v1/jobs/{job_id}"
    assert httpx.delete(url, headers={"X-API-Key": "key-acme-1"}).status_code == 404
    cancelled = httpx.delete(url, headers={"X-API-Key": "key-globex-1"})
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert api.reserved(job_id) is None
    again = httpx.delete(url, headers={"X-API-Key": "key-globex-1"})
    assert again.status_code == 409 and "cancelled" in again.json()["error"]["message"]
    # A cancelled job is never admitted again.
    assert not store.admit_many([Admit(job_id, 18, "globex", Priority.NORMAL)], capacity=10_000, lease_s=60,
                                now=time.time(), by="test")[0].reserved


#: The bucket stores its numbers as Lua prints them (14 digits): ~0.1 ms on today's clock.
CLOCK_EPS_S = 0.01


def _bucket(fleet: Fleet, tenant: str) -> tuple[float, float]:
    """The tenant's quota bucket: tokens left, and the server time of the last take."""
    level, ts = fleet.redis.hmget(Keys(fleet.prefix).quota(tenant), "level", "ts")
    return float(level), float(ts)


def _eventually(request, status: int, timeout: float = 60.0) -> httpx.Response:
    """The load readings refresh about once a second: retry until the answer changes."""
    deadline = time.monotonic() + timeout
    while True:
        response = request()
        if response.status_code == status or time.monotonic() > deadline:
            assert response.status_code == status, response.text
            return response
        time.sleep(0.3)
