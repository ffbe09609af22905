"""Unit: the wire contracts decode, validate and round-trip."""

from __future__ import annotations

import time
import uuid

import msgspec
import pytest

from kvfleet.contracts import (
    ALLOWED_TRANSITIONS, SCHEMA_VERSION, JobRequest, JobState, Priority, decode_request, decode_submit, encode,
    new_job_id, request_from_builtins, to_builtins,
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


def test_job_ids_are_uuid7_and_time_ordered():
    a = new_job_id()
    time.sleep(0.002)
    b = new_job_id()
    assert uuid.UUID(a).version == 7 and a < b
