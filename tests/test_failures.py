"""Failure paths through the real services: bad HTTP input, malformed Kafka messages,
a worker killed in the middle of a job."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
from kafka import KafkaConsumer, KafkaProducer

from kvfleet.contracts import JobState, Sampling
from producer.client import Client
from tests.fleet import Fleet
from workers.engine import Engine, EngineConfig
from workers.model.loader import load_model

BAD_INPUTS = [
    ({"max_new_tokens": 4}, "prompt"),  # neither prompt nor prompt_tokens
    ({"prompt": "hi", "prompt_tokens": [1, 2]}, "exactly one"),
    ({"prompt": "hi", "max_new_tokens": "ten"}, "max_new_tokens"),
    ({"prompt": "hi", "max_new_tokens": 0}, "max_new_tokens"),
    ({"prompt": "hi", "max_new_tokens": 100000}, "max_new_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "   "}, "blank"),
    ({"prompt": "hi", "priority": "urgent"}, "priority"),
    ({"prompt": "hi", "temperature": 0.5}, "temperature"),  # unknown field: belongs in `sampling`
    ({"prompt": "hi", "sampling": {"top_p": 0}}, "top_p"),
    ({"prompt": "hi", "model": "gpt-9"}, "unknown model"),
    ({"prompt": "x" * 5000, "max_new_tokens": 8}, "context"),  # tiny model: 1024-token context
    ({"prompt_tokens": [1, 99999]}, "vocabulary"),
]


@pytest.mark.parametrize("body,mentions", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_gets_a_4xx_that_says_what_to_fix(api_fleet, body, mentions):
    response = httpx.post(f"{api_fleet.url}/v1/jobs", json=body, headers={"X-Tenant-ID": "acme"})
    assert 400 <= response.status_code < 500, response.text
    assert mentions in response.json()["error"]["message"], response.json()


def test_bad_priority_header_and_body(api_fleet):
    r = httpx.post(f"{api_fleet.url}/v1/jobs", json={"prompt": "hi"}, headers={"X-Priority": "asap"})
    assert r.status_code == 422 and "X-Priority" in r.json()["error"]["message"]
    r = httpx.post(f"{api_fleet.url}/v1/jobs", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "JSON" in r.json()["error"]["message"]
    r = httpx.get(f"{api_fleet.url}/v1/jobs/nope", headers={"X-Tenant-ID": "acme"})
    assert r.status_code == 404


def test_openapi_document_describes_the_job_api(api_fleet):
    doc = httpx.get(f"{api_fleet.url}/openapi.json").json()
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/healthz", "/readyz", "/metrics"} <= set(doc["paths"])
    body = doc["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "SubmitRequest" in str(body)


def test_metrics_endpoint(api_fleet):
    text = httpx.get(f"{api_fleet.url}/metrics").text
    assert "kvfleet_api_request_duration_seconds" in text


@pytest.fixture(scope="module")
def api_fleet(local_infra, redis_url, cache_redis_url, tmp_path_factory):
    """Only the API: input checks happen before anything reaches Kafka."""
    fleet = Fleet(prefix=f"t{uuid.uuid4().hex[:10]}", kafka=local_infra["kafka"], redis_url=redis_url,
                  cache_redis_url=cache_redis_url, log_dir=tmp_path_factory.mktemp("api"))
    fleet.start("api")
    fleet.wait_ready(workers=0)
    yield fleet
    fleet.stop()


def test_malformed_kafka_message_goes_to_the_dlq_and_the_next_job_completes(make_fleet):
    fleet = make_fleet(workers=1)
    topic = f"{fleet.prefix}.requests.normal"
    producer = KafkaProducer(bootstrap_servers=fleet.env["KVFLEET_KAFKA_BOOTSTRAP"], acks="all")
    producer.send(topic, key=b"acme", value=b"{this is not json", headers=[("job_id", b"broken-1")]).get(10)
    producer.send(topic, key=b"acme", value=b'{"job_id": "bad-2", "tenant": "acme"}').get(10)
    producer.close()
    with Client(fleet.url, tenant="acme") as client:
        job_id = client.submit("after the poison", max_new_tokens=3)
        assert client.wait(job_id, timeout=60).status is JobState.DONE
    consumer = KafkaConsumer(f"{fleet.prefix}.requests.dlq", bootstrap_servers=fleet.env["KVFLEET_KAFKA_BOOTSTRAP"],
                             auto_offset_reset="earliest", consumer_timeout_ms=10_000)
    dead = []
    for record in consumer:
        dead.append({k: v.decode() for k, v in record.headers})
        if len(dead) == 2:
            break
    consumer.close()
    assert [d["reason"] for d in dead] == ["undecodable", "invalid"]
    assert dead[0]["job_id"] == "broken-1" and dead[0]["source_topic"] == topic
    assert "priority" in dead[1]["detail"] or "Object missing required field" in dead[1]["detail"]


def test_worker_killed_mid_job_completes_once_with_a_true_state(make_fleet):
    # A short visibility timeout so the orphaned task comes back within seconds; the
    # bench model decodes slowly enough on CPU that the kill lands mid-generation.
    env = {"KVFLEET_VISIBILITY_TIMEOUT_S": "6"}
    fleet = make_fleet(workers=1, model="builtin:bench", extra_env=env)
    sampling = Sampling(temperature=0.7, seed=42)
    with Client(fleet.url, tenant="acme") as client:
        job_id = client.submit("survive a crash", max_new_tokens=300, temperature=0.7, seed=42)
        states = [_wait_for_state(fleet, job_id, "running")]
        # api-1, scheduler-2, worker-3. kill() returns once the process is reaped: the
        # worker can write nothing more, so the state read next is the one it left.
        fleet.kill("worker-3")
        states.append(client.get(job_id).status.value)
        assert states[-1] == "running"  # not lost, not falsely finished
        fleet.start("worker")
        result = client.wait(job_id, timeout=180)
    assert result.status is JobState.DONE, fleet.logs()
    assert int(fleet.redis.hget(fleet.keys.job(job_id), "attempts")) == 2
    engine = Engine(load_model("builtin:bench"), EngineConfig())
    try:
        expected = engine.generate("local", engine.loaded.tokenizer.encode("survive a crash"), 300, sampling).tokens
    finally:
        engine.shutdown()
    assert result.tokens == expected


def _wait_for_state(fleet, job_id: str, state: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        raw = fleet.redis.hget(fleet.keys.job(job_id), "state")
        if raw and raw.decode() == state:
            return state
        time.sleep(0.05)
    raise TimeoutError(f"job {job_id} never reached {state}\n{fleet.logs()}")
