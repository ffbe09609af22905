"""The OpenAI request policy without a fleet: which fields pass, which are refused and
how the refusal names them; service tiers; idempotency keys; rate-limit durations."""

from __future__ import annotations

import json

import pytest

from kvfleet.contracts import JobResult, JobState, Priority, Usage
from producer.errors import BadRequest
from producer.openai import requests, responses
from producer.openai.schemas import ChatCompletionRequest, CompletionRequest
from producer.ratelimit import duration


def decode(kind=CompletionRequest, **fields):
    return requests.decode(json.dumps({"model": "m", "prompt": "hi", "messages": [{"role": "user", "content": "x"}],
                                       **fields}).encode() if kind is ChatCompletionRequest
                           else json.dumps({"model": "m", "prompt": "hi", **fields}).encode(), kind)


def refusal(kind=CompletionRequest, **fields) -> BadRequest:
    with pytest.raises(BadRequest) as raised:
        decode(kind, **fields)
    return raised.value


def test_served_fields_decode():
    r = decode(max_tokens=5, temperature=0.5, top_p=0.9, stop="x", seed=3, n=1, stream=True,
               stream_options={"include_usage": True}, user="u", service_tier="flex", top_k=-1, job_id="j-1",
               timeout_s=30)
    assert r.max_tokens == 5 and r.stop == "x" and r.stream_options.include_usage
    sampling = requests.sampling_of(r)
    assert sampling.stop == ["x"] and sampling.top_k == 0 and sampling.temperature == 0.5 and sampling.seed == 3


def test_openai_default_temperature_is_one():
    assert requests.sampling_of(decode()).temperature == 1.0


@pytest.mark.parametrize("field, value", [("frequency_penalty", 0), ("presence_penalty", 0.0), ("logprobs", False),
                                          ("n", 1), ("best_of", 1), ("echo", False), ("logit_bias", {}),
                                          ("response_format", {"type": "text"}), ("tools", []),
                                          ("parallel_tool_calls", True), ("store", False)])
def test_noop_values_pass(field, value):
    decode(**{field: value})


@pytest.mark.parametrize("field, value", [("frequency_penalty", 0.1), ("logprobs", True), ("best_of", 2),
                                          ("echo", True), ("suffix", "end"), ("logit_bias", {"1": 5}),
                                          ("response_format", {"type": "json_object"}),
                                          ("tools", [{"type": "function"}]), ("store", True),
                                          ("mystery", 1)])
def test_other_values_are_refused_by_name(field, value):
    error = refusal(**{field: value})
    assert error.param == field and error.code == "unsupported_parameter" and f"`{field}`" in error.message


def test_type_errors_name_the_field():
    assert refusal(temperature="hot").param == "temperature"
    assert refusal(stop=["a", 3]).param == "stop[1]"  # as precise as msgspec says
    assert refusal(max_tokens=0).param == "max_tokens"
    assert refusal(n=3).param == "n"
    assert refusal(stream_options={"include_usage": True}).param == "stream_options"
    assert "JSON object" in requests_decode_error(b"[1, 2]")


def requests_decode_error(body: bytes) -> str:
    with pytest.raises(BadRequest) as raised:
        requests.decode(body, CompletionRequest)
    return raised.value.message


def test_service_tiers_map_to_classes_and_headers_win():
    assert requests.priority_of(decode(service_tier="priority"), None) is Priority.HIGH
    assert requests.priority_of(decode(service_tier="auto"), None) is Priority.NORMAL
    assert requests.priority_of(decode(service_tier="flex"), None) is Priority.LOW
    assert requests.priority_of(decode(service_tier="flex", priority="high"), None) is Priority.HIGH
    assert requests.priority_of(decode(priority="high"), "low") is Priority.LOW
    with pytest.raises(BadRequest):
        requests.priority_of(decode(), "urgent")


def test_idempotency_key_is_per_tenant_and_a_valid_job_id():
    r = decode()
    a = requests.job_id_of(r, {"idempotency-key": "k 1/é"}, "acme")
    assert a == requests.job_id_of(r, {"idempotency-key": "k 1/é"}, "acme")
    assert a != requests.job_id_of(r, {"idempotency-key": "k 1/é"}, "globex")
    assert a.startswith("idem-") and len(a) <= 64
    assert requests.job_id_of(decode(job_id="mine"), {"idempotency-key": "k"}, "acme") == "mine"
    assert requests.job_id_of(r, {}, "acme") is None


def test_a_batch_of_prompts_is_refused_with_the_way_to_send_it():
    with pytest.raises(BadRequest) as raised:
        requests.completion_submit(decode(prompt=["a", "b"]), None, None, default_max_tokens=lambda p: 16)
    assert raised.value.param == "prompt" and "Batch API" in raised.value.message
    one, _ = requests.completion_submit(decode(prompt=[[1, 2]]), None, None, default_max_tokens=lambda p: 16)
    assert one.prompt_tokens == [1, 2] and one.max_new_tokens == 16


def test_finish_reasons_and_not_done_statuses():
    assert responses.finish_reason("eos") == "stop" and responses.finish_reason("length") == "length"
    base = dict(job_id="j", tenant="t", priority=Priority.NORMAL, usage=Usage())
    assert responses.not_done(JobResult(status=JobState.EXPIRED, **base)).status == 503
    assert responses.not_done(JobResult(status=JobState.FAILED, **base)).status == 500
    assert responses.not_done(JobResult(status=JobState.CANCELLED, **base)).status == 409
    running = responses.not_done(JobResult(status=JobState.RUNNING, **base))
    assert running.status == 504 and "GET /v1/jobs/j" in running.message


def test_reset_durations_read_like_openais():
    assert duration(0.02) == "20ms" and duration(1.5) == "1.5s" and duration(62.5) == "1m2.5s"
    assert duration(360) == "6m0s"
