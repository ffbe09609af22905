"""A client that retries as the docs say gets its job run exactly once, through the real
fleet: a 503 (Kafka did not take the job) records nothing, so the retry under the same
job_id is a fresh submission, not the answer "that job failed"; and an API that died
between recording a job and producing it (the record queued, nothing on Kafka) loses
nothing either: the retry produces the recorded job."""

from __future__ import annotations

import time

import httpx
import msgspec
from fastapi.testclient import TestClient

from kvfleet.constants import Keys
from kvfleet.contracts import JobRequest, Priority
from kvfleet.jobstore import JobStore
from kvfleet.settings import KafkaSettings, RedisSettings, Settings
from producer.api import create_app


def test_a_retry_after_a_503_runs_the_job_exactly_once(make_fleet, redis_url):
    fleet = make_fleet(workers=1)
    # The same fleet's API, in process, but its Kafka is unreachable (nothing listens on 1).
    settings = Settings().replace(
        kafka=KafkaSettings(bootstrap="127.0.0.1:1", topic_prefix=fleet.env["KVFLEET_TOPIC_PREFIX"]),
        redis=RedisSettings(url=redis_url, key_prefix=fleet.prefix))
    body = {"job_id": "retry-me-1", "prompt_tokens": [7] * 8, "max_new_tokens": 3}
    app = create_app(settings)
    try:
        down = TestClient(app).post("/v1/jobs", json=body, headers={"X-Tenant-ID": "acme"})
    finally:
        # No lifespan ran (its startup would wait for the unreachable Kafka), so nothing
        # closes the producer: let it go here, or librdkafka logs a failed connect to
        # the test run's stderr until the process exits.
        app.state.ctx.publisher.close(timeout_s=0)
    assert down.status_code == 503 and "retry" in down.json()["error"]["message"]
    assert fleet.state("retry-me-1") is None  # nothing recorded: nothing to poison the id

    retried = httpx.post(f"{fleet.url}/v1/jobs", json=body, headers={"X-Tenant-ID": "acme"})
    assert retried.status_code == 202, retried.text
    fleet.wait_for(lambda: fleet.state("retry-me-1") == "done", "the retried job done", timeout=60)
    assert fleet.field("retry-me-1", "attempts") == "1"
    again = httpx.post(f"{fleet.url}/v1/jobs", json=body, headers={"X-Tenant-ID": "acme"})
    assert again.status_code == 200 and again.json()["status"] == "done"  # a third try: the same job
    result = msgspec.json.decode(fleet.field("retry-me-1", "result"))
    assert result["usage"]["completion_tokens"] == 3


def test_a_retry_after_the_api_died_before_its_produce_runs_the_recorded_job_once(make_fleet, redis_client):
    fleet = make_fleet(workers=1)
    # What the API's submit script leaves when its process dies before the produce.
    recorded = JobRequest(job_id="orphan-1", tenant="acme", priority=Priority.NORMAL, model="builtin:tiny",
                          max_new_tokens=3, submitted_at=time.time(), prompt_tokens=[7] * 8)
    JobStore(redis_client, Keys(fleet.prefix)).create(recorded)
    # The client's retry, with another body under the same id: the recorded job is the one that runs.
    body = {"job_id": "orphan-1", "prompt_tokens": [9] * 4, "max_new_tokens": 5}
    retried = httpx.post(f"{fleet.url}/v1/jobs", json=body, headers={"X-Tenant-ID": "acme"})
    assert retried.status_code == 200 and retried.json()["status"] == "queued", retried.text
    fleet.wait_for(lambda: fleet.state("orphan-1") == "done", "the recorded job done", timeout=60)
    assert fleet.field("orphan-1", "attempts") == "1"
    result = msgspec.json.decode(fleet.field("orphan-1", "result"))
    assert (result["usage"]["prompt_tokens"], result["usage"]["completion_tokens"]) == (8, 3)
