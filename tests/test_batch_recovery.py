"""A batch survives every service dying midway: every line ends exactly once.

A batch of a few thousand short lines runs on the real fleet; once part of it is done
the API (whose process drives the batch), the scheduler and the worker are SIGKILLed
and started again. The new API takes the batch's lease over, resumes at its durable
cursor, re-submits the window in flight (each line's job id is deterministic, so those
are found, not run again) and finalizes it."""

from __future__ import annotations

import io
import json

import openai

LINES = 3000
TENANTS = {"tenants": [{"name": "acme", "tier": "silver", "tokens_per_minute": 100_000_000,
                        "api_keys": ["sk-acme-recovery"]}]}


def test_every_line_exactly_once_across_a_fleet_restart(make_fleet, tmp_path):
    env = {"KVFLEET_TENANTS": json.dumps(TENANTS), "KVFLEET_FILES_DIR": str(tmp_path / "files")}
    fleet = make_fleet(extra_env=env)
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="sk-acme-recovery", max_retries=2, timeout=60)
    lines = [{"custom_id": f"r-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "builtin:tiny", "prompt": f"Item {i % 97}: {i}", "max_tokens": 1 + i % 2,
                       "temperature": 0}} for i in range(LINES)]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    file = client.files.create(file=("big.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")

    fleet.wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= LINES // 5,
                   "a fifth of the batch to finish", timeout=180)
    before = client.batches.retrieve(batch.id).request_counts.completed
    for name in list(fleet.procs):
        fleet.kill(name)  # SIGKILL: no lease released, no offsets committed, jobs mid-run
    assert before < LINES, "the batch was still running when the fleet died"
    fleet.start("api")
    fleet.start("scheduler")
    fleet.start("worker")
    fleet.wait_ready(workers=1)

    done = fleet.wait_for(lambda: (b := client.batches.retrieve(batch.id)).status in
                          ("completed", "failed", "expired", "cancelled") and b, "the batch to end", timeout=300)
    assert done.status == "completed", done
    outputs = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    errors = ([json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
              if done.error_file_id else [])
    seen = [line["custom_id"] for line in outputs + errors]
    assert len(seen) == LINES and set(seen) == {line["custom_id"] for line in lines}, "every line exactly once"
    assert not errors, errors[:3]
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (LINES, LINES, 0)
    # One job per line, each its own id; and none ran to completion twice.
    request_ids = [o["response"]["request_id"] for o in outputs]
    assert len(set(request_ids)) == LINES
    assert all(o["response"]["body"]["usage"]["completion_tokens"] >= 1 for o in outputs)
