"""Unit: the wire contracts decode, validate and round-trip."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace

import msgspec
import pytest

from kvfleet.contracts import (
    ALLOWED_TRANSITIONS, SCHEMA_VERSION, JobRequest, JobState, Priority, decode_request, decode_submit, encode,
    WorkerHeartbeat, new_job_id, request_from_builtins, to_builtins, token_cost,
)


def _request(**changes) -> JobRequest:
    fields = dict(job_id="j-1", tenant="acme", priority=Priority.LOW, model="builtin:tiny", max_new_tokens=8,
                  submitted_at=time.time(), prompt="hello")
    fields.update(changes)
    return JobRequest(**fields)


def test_request_round_trips_through_kafka_json_and_celery_builtins():
    job = _request()
    assert decode_request(encode(job)) == job
    assert request_from_builtins(to_builtins(job)) == job
    assert b'"v":1' in encode(job)


def test_exactly_one_prompt_form():
    with pytest.raises(msgspec.ValidationError, match="exactly one"):
        decode_request(encode(_request(prompt=None)))
    bad = msgspec.json.encode({**to_builtins(_request()), "prompt_tokens": [1]})
    with pytest.raises(msgspec.ValidationError, match="exactly one"):
        decode_request(bad)


def test_other_schema_versions_are_refused():
    raw = msgspec.json.encode({**to_builtins(_request()), "v": SCHEMA_VERSION + 1})
    with pytest.raises(msgspec.ValidationError, match="schema version"):
        decode_request(raw)


def test_older_v1_messages_still_decode():
    # An API from before tokenized prompts sent the text with its length; a worker sent
    # more heartbeat fields (the model's name and fingerprint are read again, for
    # GET /v1/models). Both still read, so a fleet upgrades one process at a time.
    old = msgspec.json.encode({**to_builtins(_request()), "prompt_len": 6})
    assert decode_request(old).prompt == "hello"
    beat = msgspec.json.encode({"worker_id": "w", "model": "m", "fingerprint": "f", "capacity_tokens": 7,
                                "tokens_in_use": 0, "running": 0, "waiting": 0, "ts": 1.0, "v": 1})
    assert msgspec.json.decode(beat, type=WorkerHeartbeat) == WorkerHeartbeat(
        worker_id="w", capacity_tokens=7, model="m", fingerprint="f")


def test_a_job_costs_its_prompt_tokens_and_every_new_token():
    assert _request(prompt=None, prompt_tokens=[1, 2, 3]).cost == token_cost(3, 8) == 11
    with pytest.raises(ValueError, match="tokenize it"):
        _request().cost  # a text prompt's length depends on the model's tokenizer


def test_submit_errors_name_the_field():
    with pytest.raises(msgspec.ValidationError, match=r"\$\.max_new_tokens"):
        decode_submit(b'{"prompt": "x", "max_new_tokens": -1}')
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        decode_submit(b'{"prompt": "x", "max_tokens": 5}')


def test_states_only_move_forward():
    order = [JobState.QUEUED, JobState.ADMITTED, JobState.RUNNING, JobState.DONE]
    for earlier, later in zip(order, order[1:]):
        assert later in ALLOWED_TRANSITIONS[earlier]
        assert earlier not in ALLOWED_TRANSITIONS[later]
    for state in JobState:
        if state.terminal:
            assert not ALLOWED_TRANSITIONS[state]


def test_job_ids_are_uuid7_and_time_ordered(monkeypatch):
    clock = iter([1_700_000_000.0, 1_700_000_000.125])  # two ids 125 ms apart (exact in binary)
    monkeypatch.setattr("kvfleet.contracts.time", SimpleNamespace(time=lambda: next(clock)))
    a, b = new_job_id(), new_job_id()
    assert uuid.UUID(a).version == 7 and a < b
    assert uuid.UUID(a).int >> 80 == 1_700_000_000_000  # the id leads with its millisecond timestamp
