"""The Files and Batch APIs through the real fleet (API with its batch driver, scheduler,
a worker, Kafka, Redis), driven by the official `openai` client as users drive it."""

from __future__ import annotations

import contextlib
import io
import json
import signal

import openai
import pytest

from tests.fleet import Fleet, running_fleet

MODEL = "builtin:tiny"
TENANTS = {"tenants": [
    {"name": "acme", "tier": "silver", "tokens_per_minute": 60_000_000, "api_keys": ["sk-acme-batch"]},
    {"name": "other", "tier": "silver", "tokens_per_minute": 60_000_000, "api_keys": ["sk-other-batch"]},
]}
MAX_FILE_BYTES = 64 * 1024  # lowered so a test can go over it


@pytest.fixture(scope="module")
def fleet(local_infra, redis_url, cache_redis_url, tmp_path_factory):
    logs = tmp_path_factory.mktemp("batch")
    with running_fleet(local_infra, redis_url, cache_redis_url, logs, extra_env={
            "KVFLEET_TENANTS": json.dumps(TENANTS), "KVFLEET_FILES_DIR": str(logs / "files"),
            "KVFLEET_FILES_MAX_BYTES": str(MAX_FILE_BYTES), "KVFLEET_BATCH_MIN_WINDOW_S": "1",
            "KVFLEET_BATCH_ORDER_WINDOW": "16", "KVFLEET_BATCH_MAX_IN_FLIGHT": "32"}) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def client(fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="sk-acme-batch", max_retries=0, timeout=120)


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def completion_line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": MODEL, **body}}


GOOD = completion_line("ok", prompt="hi", max_tokens=2)


def upload(client: openai.OpenAI, data: bytes, name: str = "batch.jsonl"):
    return client.files.create(file=(name, io.BytesIO(data)), purpose="batch")


def wait_status(fleet: Fleet, client: openai.OpenAI, batch_id: str, statuses: set[str], timeout: float = 150.0):
    return fleet.wait_for(lambda: (b := client.batches.retrieve(batch_id)).status in statuses and b,
                          f"batch {batch_id} to reach {statuses}", timeout=timeout)


def read_jsonl(client: openai.OpenAI, file_id) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def check_every_line_once(batch, outputs: list[dict], errors: list[dict], custom_ids: list[str]) -> None:
    seen = [line["custom_id"] for line in outputs + errors]
    assert sorted(seen) == sorted(custom_ids), "every custom_id exactly once in the output or the error file"
    counts = batch.request_counts
    assert counts.total == len(custom_ids)
    assert (counts.completed, counts.failed) == (len(outputs), len(errors))


def test_a_batch_runs_every_line_once_with_the_online_answers(client, fleet):
    system = "You are a terse assistant. Answer in one word. " * 3  # a shared prefix, ordered together
    lines = [completion_line(f"c-{i}", prompt=system + f"Question {i}?", max_tokens=6, temperature=0.8,
                             seed=100 + i) for i in range(12)]
    lines.append(completion_line("tokens", prompt=[256, 72, 105], max_tokens=4, temperature=0))
    file = upload(client, jsonl(lines))
    assert file.purpose == "batch" and file.bytes == len(jsonl(lines)) and file.id.startswith("file-")
    assert client.files.retrieve(file.id).filename == "batch.jsonl"
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h",
                                  metadata={"run": "test"})
    assert batch.status == "validating" and batch.metadata == {"run": "test"} and batch.request_counts.total == 13
    done = wait_status(fleet, client, batch.id, {"completed", "failed", "expired", "cancelled"})
    assert done.status == "completed", done
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.error_file_id is None
    outputs = read_jsonl(client, done.output_file_id)
    check_every_line_once(done, outputs, [], [line["custom_id"] for line in lines])
    assert [o["custom_id"] for o in outputs] == [line["custom_id"] for line in lines], "output in input order"
    by_id = {o["custom_id"]: o for o in outputs}
    cached = [by_id[f"c-{i}"]["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for i in range(12)]
    # The shared system prompt (142 byte tokens with BOS) is prefilled once: by the line
    # that builds it for the fleet's prefix single flight, whose own job is the prefill
    # (so it reports nothing cached), while every other line finds its full 16-token
    # blocks cached, in the pool or loaded, instead of prefilling it again.
    assert sum(c < 128 for c in cached) <= 1 and sorted(cached)[1] >= 128, cached
    for o in outputs:
        assert o["error"] is None and o["response"]["status_code"] == 200
        assert o["response"]["body"]["object"] == "text_completion"
        assert o["response"]["request_id"] == o["response"]["body"]["id"]
    for i in (0, 5, 11):  # the same seeded request online gives the same text
        online = client.completions.create(model=MODEL, prompt=system + f"Question {i}?", max_tokens=6,
                                           temperature=0.8, seed=100 + i)
        assert by_id[f"c-{i}"]["response"]["body"]["choices"][0]["text"] == online.choices[0].text
    job = fleet.field(by_id["c-0"]["response"]["request_id"], "priority")
    assert job == "low", "a silver tenant's batch runs at low priority"
    assert any(b.id == batch.id for b in client.batches.list(limit=5).data)
    output_file = client.files.retrieve(done.output_file_id)
    assert output_file.purpose == "batch_output"


def test_a_chat_batch_answers_chat_completions(client, fleet):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    lines = [{"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": messages, "max_tokens": 5, "temperature": 0}} for i in range(3)]
    batch = client.batches.create(input_file_id=upload(client, jsonl(lines)).id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = wait_status(fleet, client, batch.id, {"completed", "failed", "expired", "cancelled"})
    outputs = read_jsonl(client, done.output_file_id)
    check_every_line_once(done, outputs, [], ["chat-0", "chat-1", "chat-2"])
    online = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    for o in outputs:
        body = o["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == online.choices[0].message.content


def _long_batch(client, n: int, window: str):
    lines = [completion_line(f"l-{i}", prompt=f"Line {i} of a long batch", max_tokens=48, temperature=0)
             for i in range(n)]
    batch = client.batches.create(input_file_id=upload(client, jsonl(lines)).id, endpoint="/v1/completions",
                                  completion_window=window)
    return batch, [line["custom_id"] for line in lines]


def _done_jobs(fleet: Fleet, batch_id: str, n: int) -> set[str]:
    """The batch's jobs that finished `done`, by id (line i of the file is line number i+1)."""
    return {f"{batch_id}-{i}" for i in range(1, n + 1) if fleet.state(f"{batch_id}-{i}") == "done"}


@contextlib.contextmanager
def worker_paused(fleet: Fleet):
    """SIGSTOP the worker, so whatever the batch has not finished stays unfinished until the
    batch has ended (no race with a fast tiny model); SIGCONT and wait for it after."""
    name = next(n for n in fleet.procs if n.startswith("worker"))
    fleet.procs[name].send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        fleet.procs[name].send_signal(signal.SIGCONT)
        fleet.wait_for(lambda: fleet.live_workers() >= 1, "the worker to heartbeat again")


def test_cancel_mid_batch_returns_what_ran_and_stops_the_rest(client, fleet):
    batch, custom_ids = _long_batch(client, 200, "24h")
    fleet.wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1,
                   "a first line to finish", timeout=120)
    with worker_paused(fleet):
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
        done = wait_status(fleet, client, batch.id, {"cancelled"})
    outputs, errors = read_jsonl(client, done.output_file_id), read_jsonl(client, done.error_file_id)
    check_every_line_once(done, outputs, errors, custom_ids)
    assert outputs and errors
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert {o["response"]["request_id"] for o in outputs} == _done_jobs(fleet, batch.id, 200)
    states = {fleet.state(f"{batch.id}-{i}") for i in range(1, 201)}
    assert states <= {"done", "cancelled", None}, "nothing of a cancelled batch is left queued or running"
    assert client.batches.cancel(done.id).status == "cancelled", "cancelling again answers the batch as it is"


def test_a_finished_batch_cannot_be_cancelled(client, fleet):
    batch = client.batches.create(input_file_id=upload(client, jsonl([GOOD])).id, endpoint="/v1/completions",
                                  completion_window="24h")
    assert wait_status(fleet, client, batch.id, {"completed", "failed", "expired", "cancelled"}).status == "completed"
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_expiry_returns_finished_lines_and_expires_the_rest(client, fleet):
    batch, custom_ids = _long_batch(client, 300, "30s")
    fleet.wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1,
                   "a first line to finish", timeout=25)
    with worker_paused(fleet):
        done = wait_status(fleet, client, batch.id, {"expired", "completed"}, timeout=60)
    assert done.status == "expired" and done.expired_at
    outputs, errors = read_jsonl(client, done.output_file_id), read_jsonl(client, done.error_file_id)
    check_every_line_once(done, outputs, errors, custom_ids)
    assert errors and {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert {o["response"]["request_id"] for o in outputs} == _done_jobs(fleet, batch.id, 300)
    states = {fleet.state(f"{batch.id}-{i}") for i in range(1, 301)}
    assert states <= {"done", "cancelled", "expired", None}


@pytest.mark.parametrize("data, line, fragment", [
    (b"this is not json\n", 1, "not a JSON object"),
    (jsonl([GOOD, {**completion_line("e", prompt="x"), "url": "/v1/embeddings"}]), 2, "`url`"),
    (jsonl([GOOD, {k: v for k, v in completion_line("m", prompt="x").items() if k != "custom_id"}]), 2,
     "`custom_id` is missing"),
    (jsonl([GOOD, completion_line("b", prompt="y"), completion_line("ok", prompt="z")]), 3, "already used on line 1"),
    (jsonl([GOOD, completion_line("long", prompt=[65] * 1441, max_tokens=16)]), 2, "shorten the prompt by 433"),
    (jsonl([GOOD, completion_line("p", prompt="x", frequency_penalty=0.5)]), 2, "frequency_penalty"),
])
def test_a_bad_line_is_refused_naming_it(client, data, line, fragment):
    with pytest.raises(openai.BadRequestError) as raised:
        upload(client, data)
    message = raised.value.message
    assert f"line {line}:" in message and fragment in message, message
    assert raised.value.code == "invalid_batch_file"


def test_a_file_over_the_size_limit_is_refused(client):
    lines = [completion_line(f"big-{i}", prompt="x" * 200, max_tokens=1) for i in range(400)]
    data = jsonl(lines)
    assert len(data) > MAX_FILE_BYTES
    with pytest.raises(openai.APIStatusError) as raised:
        upload(client, data)
    assert raised.value.status_code == 413 and f"{MAX_FILE_BYTES} bytes" in raised.value.message
    assert not [f for f in client.files.list().data if f.bytes == len(data)], "nothing of it is kept"


def test_batch_refuses_a_mismatched_endpoint_and_a_bad_window(client):
    file = upload(client, jsonl([GOOD]))
    with pytest.raises(openai.BadRequestError) as raised:
        client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert raised.value.param == "endpoint"
    with pytest.raises(openai.BadRequestError) as raised:
        client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="soon")
    assert raised.value.param == "completion_window"


def test_another_tenant_sees_neither_files_nor_batches(client, fleet):
    file = upload(client, jsonl([GOOD]))
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    other = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="sk-other-batch", max_retries=0)
    for call in (lambda: other.files.retrieve(file.id), lambda: other.files.content(file.id),
                 lambda: other.files.delete(file.id), lambda: other.batches.retrieve(batch.id),
                 lambda: other.batches.cancel(batch.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError):
        other.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    assert file.id not in {f.id for f in other.files.list().data}
    assert batch.id not in {b.id for b in other.batches.list().data}
    assert client.files.delete(file.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file.id)


def test_cli_submits_waits_and_downloads(fleet, tmp_path, capsys):
    from kvfleet.cli import main

    path = tmp_path / "cli.jsonl"
    path.write_bytes(jsonl([completion_line(f"cli-{i}", prompt=f"cli {i}", max_tokens=3, temperature=0)
                            for i in range(5)]))
    out = tmp_path / "out.jsonl"
    auth = ["--url", fleet.url, "--api-key", "sk-acme-batch"]
    assert main(["batch", "submit", str(path), "--wait", "--output", str(out), *auth]) == 0
    assert sorted(json.loads(x)["custom_id"] for x in out.read_text().splitlines()) == [f"cli-{i}" for i in range(5)]
    batch_id = capsys.readouterr().err.split()[0]
    assert main(["batch", "status", batch_id, *auth]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["status"] == "completed" and status["request_counts"]["completed"] == 5
