"""End to end through the real services: HTTP → Kafka → scheduler → Celery → engine → Redis.

Every output is compared with what the same model produces in this process for the
same prompt and sampling seed, so a fleet that loses, mixes up or corrupts jobs fails.
"""

from __future__ import annotations

import time

import httpx
import msgspec
import pytest

from kvfleet.contracts import JobState, Sampling
from producer.client import Client
from workers.engine import Engine, EngineConfig
from workers.model.loader import load_model


@pytest.fixture(scope="module")
def local_engine():
    engine = Engine(load_model("builtin:tiny"), EngineConfig())
    yield engine
    engine.shutdown()


def expected_tokens(engine: Engine, prompt: str, max_new_tokens: int, sampling: Sampling) -> list[int]:
    tokens = engine.loaded.tokenizer.encode(prompt)
    return engine.generate(f"local-{time.monotonic_ns()}", tokens, max_new_tokens, sampling).tokens


def torch_threads_of_the_model(fleet) -> list[int]:
    """What each worker's "model loaded" line says its engine's step thread runs with."""
    return [msgspec.json.decode(line)["torch_threads"] for path in sorted(fleet.log_dir.glob("worker-*.log"))
            for line in path.read_bytes().splitlines() if b'"model loaded"' in line]


def frozen_heaps(fleet) -> dict[str, list[int]]:
    """Each service's "startup heap frozen" lines (kvfleet/heap.py): objects frozen, by log file."""
    return {path.stem: [msgspec.json.decode(line)["objects"] for line in path.read_bytes().splitlines()
                        if b'"startup heap frozen"' in line]
            for path in sorted(fleet.log_dir.glob("*.log"))}


def test_sixty_jobs_three_priorities_two_tenants(make_fleet, local_engine):
    fleet = make_fleet(workers=1)
    # One intra-op thread by default (KVFLEET_WORKER_TORCH_THREADS), on the thread the model runs on.
    assert torch_threads_of_the_model(fleet) == [1]
    jobs = []
    clients = {t: Client(fleet.url, tenant=t) for t in ("acme", "globex")}
    for i in range(60):
        tenant = ("acme", "globex")[i % 2]
        priority = ("high", "normal", "low")[i % 3]
        sampling = Sampling() if i % 4 else Sampling(temperature=0.9, top_k=40, top_p=0.95, seed=1000 + i)
        prompt = f"job {i}: the quick brown fox {'jumps ' * (i % 7)}"
        job_id = clients[tenant].submit(prompt, priority=priority, max_new_tokens=4 + i % 9,
                                        temperature=sampling.temperature, top_k=sampling.top_k,
                                        top_p=sampling.top_p, seed=sampling.seed)
        jobs.append((job_id, tenant, priority, prompt, 4 + i % 9, sampling))
    for job_id, tenant, priority, prompt, max_new, sampling in jobs:
        result = clients[tenant].wait(job_id, timeout=180)
        assert result.status is JobState.DONE, (result, fleet.logs())
        assert result.priority.value == priority and result.tenant == tenant
        assert result.tokens == expected_tokens(local_engine, prompt, max_new, sampling), job_id
        assert result.usage.completion_tokens == len(result.tokens)
        t = result.timings
        assert t.queued_at <= t.admitted_at <= t.started_at <= t.first_token_at <= t.finished_at
    for client in clients.values():
        client.close()
    # Every service ran these jobs with its startup heap out of the collector (the
    # default): the worker's holds the model, torch and Celery, far more than the others'.
    frozen = frozen_heaps(fleet)
    assert sorted(frozen) == [f"{role}-{i}" for i, role in enumerate(("api", "scheduler", "worker"), 1)], frozen
    assert all(len(counts) == 1 and counts[0] > 10_000 for counts in frozen.values()), frozen
    assert frozen["worker-3"][0] > frozen["scheduler-2"][0], frozen


def test_tenants_cannot_read_each_others_results(make_fleet):
    fleet = make_fleet(workers=1)
    with Client(fleet.url, tenant="acme") as acme:
        job_id = acme.submit("secret plans", max_new_tokens=2)
        assert acme.wait(job_id, timeout=60).status is JobState.DONE
    response = httpx.get(f"{fleet.url}/v1/jobs/{job_id}", headers={"X-Tenant-ID": "globex"})
    assert response.status_code == 404 and "secret" not in response.text


def test_resubmitting_the_same_job_id_runs_once(make_fleet):
    fleet = make_fleet(workers=1)
    with Client(fleet.url, tenant="acme") as client:
        first = client.submit("idempotent", max_new_tokens=3, job_id="client-chosen-1")
        second = client.submit("idempotent", max_new_tokens=3, job_id="client-chosen-1")
        assert first == second == "client-chosen-1"
        assert client.wait(first, timeout=60).status is JobState.DONE
    assert int(fleet.redis.hget(fleet.keys.job(first), "attempts")) == 1
    other = httpx.post(f"{fleet.url}/v1/jobs", json={"prompt": "x", "job_id": "client-chosen-1"},
                       headers={"X-Tenant-ID": "globex"})
    assert other.status_code == 409


def test_long_poll_returns_when_the_job_finishes(make_fleet):
    # The server may hold a poll for an hour; our read gives up after two minutes. A
    # terminal answer within them can only come from the finish, not from the poll's timeout.
    # Also a fleet with Python's collector left as it is (KVFLEET_GC_FREEZE=0): it runs the
    # same, and no service freezes anything.
    fleet = make_fleet(workers=1, extra_env={"KVFLEET_MAX_WAIT_S": "3600", "KVFLEET_GC_FREEZE": "0"})
    with Client(fleet.url, tenant="acme") as client:
        job_id = client.submit("wait for me", max_new_tokens=8)
    response = httpx.get(f"{fleet.url}/v1/jobs/{job_id}", params={"wait": 3600}, headers={"X-Tenant-ID": "acme"},
                         timeout=120)
    assert response.status_code == 200 and response.json()["status"] == JobState.DONE.value, response.text
    assert frozen_heaps(fleet) == {"api-1": [], "scheduler-2": [], "worker-3": []}


def test_cli_submit_waits_and_prints_the_result(make_fleet):
    import subprocess
    import sys

    fleet = make_fleet(workers=1)
    out = subprocess.run(
        [sys.executable, "-m", "kvfleet.cli", "submit", "hello from the CLI", "--priority", "high",
         "--tenant", "acme", "--max-new-tokens", "5", "--wait", "--json", "--url", fleet.url],
        capture_output=True, text=True, timeout=120, env=fleet.env,
    )
    assert out.returncode == 0, out.stderr
    result = msgspec.json.decode(out.stdout)
    assert result["status"] == "done" and result["priority"] == "high" and len(result["tokens"]) == 5


def test_forty_concurrent_jobs_are_batched_by_one_worker(make_fleet, local_engine):
    from tests.fleet import free_port

    port = free_port()
    fleet = make_fleet(workers=1, extra_env={"KVFLEET_WORKER_METRICS_PORT": str(port),
                                             "KVFLEET_WORKER_TORCH_THREADS": "2"})
    assert torch_threads_of_the_model(fleet) == [2]  # its outputs are checked below as well
    prompts = [f"concurrent {i} " + "abc" * (i % 11) for i in range(40)]
    with Client(fleet.url, tenant="acme") as client:
        ids = [client.submit(p, max_new_tokens=32) for p in prompts]
        results = [client.wait(job_id, timeout=180) for job_id in ids]
    for prompt, result in zip(prompts, results):
        assert result.status is JobState.DONE
        assert result.tokens == expected_tokens(local_engine, prompt, 32, Sampling())
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    buckets = {}
    for line in metrics.splitlines():
        if line.startswith("kvfleet_engine_batch_size_sequences_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets[le] = float(line.rsplit(" ", 1)[1])
    steps = buckets["+Inf"]
    assert steps > buckets["1.0"], "every engine step ran a single sequence"
    assert buckets["4.0"] < steps  # some step batched more than 4 jobs
