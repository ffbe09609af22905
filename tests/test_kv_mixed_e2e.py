"""A real fleet whose worker runs the FP16-K / INT8-V pool (KVFLEET_KV_CACHE_DTYPE=int8-v):
it serves jobs with the tokens a local engine on the same pool produces, publishes the
larger pool's capacity, and a worker asked for int8-v with the cold tier on refuses to
start, naming the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet import registry
from kvfleet.contracts import JobState
from kvfleet.settings import EngineConfig
from producer.client import Client
from workers.engine import Engine
from workers.engine.model_runner import kv_bytes_per_block
from workers.model.loader import load_model

KV_MEMORY = 8 * 2**20  # a small pool: the capacity in the heartbeat is exact, not a default
MIXED_ENV = {
    "KVFLEET_KV_CACHE_DTYPE": "int8-v", "KVFLEET_COLD_TIER": "0", "KVFLEET_KV_MEMORY_BYTES": str(KV_MEMORY),
    "KVFLEET_DTYPE": "float16", "KVFLEET_DEVICE": "cpu",
}
PROMPTS = ["The best way to", "A fool and his money", "Never trust a man who", "Life is what happens"]


@pytest.fixture(scope="module")
def english16():
    return load_model("builtin:english", device="cpu", dtype="float16")


def test_a_worker_on_the_mixed_pool_serves_jobs_and_refuses_the_cold_tier(make_fleet, english16):
    fleet = make_fleet(workers=1, model="builtin:english", extra_env=MIXED_ENV)
    (beat,) = registry.live(fleet.redis, fleet.keys)
    blocks = KV_MEMORY // kv_bytes_per_block(english16, 16, "int8-v")
    assert beat.capacity_tokens == blocks * 16
    assert beat.capacity_tokens > 1.3 * (KV_MEMORY // kv_bytes_per_block(english16, 16) * 16)

    with Client(fleet.url, tenant="acme") as client:
        jobs = [(client.submit(p, max_new_tokens=12), p) for p in PROMPTS]
        results = [(client.wait(job_id, timeout=180), p) for job_id, p in jobs]
    with Engine(english16, EngineConfig(kv_memory_bytes=KV_MEMORY, kv_cache_dtype="int8-v")) as local:
        for result, prompt in results:
            assert result.status is JobState.DONE, (result, fleet.logs())
            expected = local.generate(prompt, english16.tokenizer.encode(prompt), 12).tokens
            assert result.tokens == expected, prompt

    # The same setting with the cold tier on (its default) stops the worker at start-up.
    name = fleet.start("worker", name="with-cold-tier", env={"KVFLEET_COLD_TIER": "1"})
    fleet.killed.add(name)  # expected to exit: not a fleet failure
    proc = fleet.procs[name]
    fleet.wait_for(lambda: proc.poll() is not None, "the worker with int8-v and the cold tier to exit", timeout=60)
    log = (Path(fleet.log_dir) / f"{name}.log").read_text(errors="replace")
    assert proc.returncode != 0
    assert "KVFLEET_KV_CACHE_DTYPE=int8-v cannot run with the cold tier" in log and "KVFLEET_COLD_TIER=0" in log
    assert fleet.live_workers() == 1  # the refused worker never registered
