"""The OpenAI-compatible routes through the real fleet (API, scheduler, a worker, Kafka,
Redis), driven by the official `openai` client as users drive it."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest

from kvfleet import streams
from kvfleet.modelinfo import load_model_info
from kvfleet.chat import normalize_messages
from tests.fleet import Fleet, running_fleet

MODEL = "builtin:tiny"
TENANTS = {"tenants": [
    {"name": "acme", "tier": "silver", "tokens_per_minute": 6_000_000, "api_keys": ["sk-acme-test"]},
    # 60 tokens a minute, 100 at once: the second 60-token request is over quota.
    {"name": "small", "tier": "silver", "tokens_per_minute": 60, "burst_tokens": 100, "api_keys": ["sk-small-test"]},
]}


@pytest.fixture(scope="module")
def fleet(local_infra, redis_url, cache_redis_url, tmp_path_factory):
    with running_fleet(local_infra, redis_url, cache_redis_url, tmp_path_factory.mktemp("openai"),
                       extra_env={"KVFLEET_TENANTS": json.dumps(TENANTS)}) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def client(fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="sk-acme-test", max_retries=0, timeout=120)


def job(fleet: Fleet, job_id: str, key: str = "sk-acme-test") -> dict:
    response = httpx.get(f"{fleet.url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()


def test_models_lists_what_live_workers_serve(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "kvfleet" and models.data[0].object == "model"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_completion_is_a_job_found_by_its_id(client, fleet):
    done = client.completions.create(model=MODEL, prompt="Hello, fleet", max_tokens=8, temperature=0)
    native = job(fleet, done.id)
    assert native["status"] == "done" and native["tenant"] == "acme" and native["priority"] == "normal"
    assert done.object == "text_completion" and done.model == MODEL
    assert done.choices[0].text == native["text"] and done.choices[0].index == 0
    assert done.choices[0].finish_reason in ("stop", "length")
    assert done.usage.prompt_tokens == len("Hello, fleet") + 1  # bytes + BOS
    assert done.usage.completion_tokens == native["usage"]["completion_tokens"]
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    assert done.usage.prompt_tokens_details.cached_tokens == native["usage"]["cached_tokens"]
    assert done.system_fingerprint.startswith("fp_")


def test_token_prompt_and_max_tokens(client, fleet):
    done = client.completions.create(model=MODEL, prompt=[256, 72, 105], max_tokens=5, temperature=0)
    assert done.usage.prompt_tokens == 3 and done.usage.completion_tokens <= 5
    assert fleet.redis.exists(fleet.keys.job_stream(done.id)) == 0  # nobody followed it: no stream written


def test_chat_completion_uses_the_template(client, fleet):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    done = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6, temperature=0)
    assert done.object == "chat.completion" and done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == job(fleet, done.id)["text"]
    assert done.usage.prompt_tokens == len(load_model_info(MODEL).encode_chat(normalize_messages(messages)))


def test_streams_concatenate_to_the_final_text(client, fleet):
    stream = client.completions.create(model=MODEL, prompt="Stream me", max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    ids = {c.id for c in chunks}
    assert len(ids) == 1
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    final = job(fleet, ids.pop())
    assert text == final["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == final["usage"]["completion_tokens"]
    # Marked followed before it was queued: its worker streamed it from its start.
    entries = fleet.redis.xrange(fleet.keys.job_stream(final["job_id"]))
    assert entries and streams.decode_entry(entries[0][0].decode(), entries[0][1]).kind == streams.START

    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go"}],
                                               max_tokens=16, temperature=0, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].choices[0].finish_reason in ("stop", "length") and chat[-1].usage is None
    content = "".join(c.choices[0].delta.content or "" for c in chat)
    assert content == job(fleet, chat[0].id)["text"]


def test_seed_reproduces_a_sampled_completion(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="Once upon", max_tokens=16, temperature=1.0,
                                         seed=seed).choices[0].text
    assert sample(1234) == sample(1234)


def test_stop_list_cuts_the_text(client):
    free = client.completions.create(model=MODEL, prompt="abc", max_tokens=24, temperature=0).choices[0].text
    assert len(free) >= 4, free
    stop = free[2:4]
    cut = client.completions.create(model=MODEL, prompt="abc", max_tokens=24, temperature=0, stop=[stop, "\x00zz"])
    assert cut.choices[0].text == free[:free.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_api_keys(fleet):
    for key in ("sk-wrong", ""):
        bad = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=key or "x", max_retries=0)
        if not key:
            bad = bad.with_options(default_headers={"Authorization": ""})
        with pytest.raises(openai.AuthenticationError) as raised:
            bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert raised.value.type == "authentication_error"


def test_over_quota_is_a_rate_limit_error_with_headers(fleet):
    small = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="sk-small-test", max_retries=0)
    first = small.completions.with_raw_response.create(model=MODEL, prompt=[256] * 10, max_tokens=50, temperature=0)
    assert first.headers["x-ratelimit-limit-tokens"] == "60"
    assert int(first.headers["x-ratelimit-remaining-tokens"]) < 100 - 60 + 5  # 60 taken, a little refilled
    assert first.headers["x-ratelimit-reset-tokens"].endswith("s")
    with pytest.raises(openai.RateLimitError) as raised:
        small.completions.create(model=MODEL, prompt=[256] * 10, max_tokens=50)
    assert int(raised.value.response.headers["Retry-After"]) >= 1
    assert raised.value.code == "rate_limit_exceeded"
    assert "x-ratelimit-remaining-tokens" in raised.value.response.headers


@pytest.mark.parametrize("extra, param", [
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"logit_bias": {"65": 10}}, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"n": 2}, "n"),
    ({"extra_body": {"mystery": 1}}, "mystery"),
    ({"temperature": 9}, "temperature"),
])
def test_unsupported_or_bad_fields_are_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       **extra)
    assert raised.value.param == param, raised.value.body
    assert raised.value.type == "invalid_request_error"


def test_harmless_defaults_that_clients_send_are_accepted(client):
    done = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          n=1, presence_penalty=0, frequency_penalty=0, logprobs=False,
                                          user="end-user-7")
    assert len(done.choices) == 1


def test_too_long_a_prompt_says_how_much_to_cut(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt=[65] * 1441, max_tokens=16)
    assert raised.value.code == "context_length_exceeded"
    assert "shorten the prompt by 433 tokens" in raised.value.message, raised.value.message


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert raised.value.code == "model_not_found" and MODEL in raised.value.message


def test_service_tier_and_priority_map_to_classes(client, fleet):
    # The client takes service_tier on chat only; a completion sends it in the body.
    flex = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                          service_tier="flex")
    assert job(fleet, flex.id)["priority"] == "low"
    tier = client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"service_tier": "priority"})
    assert job(fleet, tier.id)["priority"] == "high"
    high = client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"priority": "high"})
    assert job(fleet, high.id)["priority"] == "high"
    header = client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_headers={"X-Priority": "low"})
    assert job(fleet, header.id)["priority"] == "low"


def test_a_retried_request_with_its_job_id_runs_once(client, fleet):
    job_id = f"oa-{uuid.uuid4().hex[:12]}"
    first = client.completions.create(model=MODEL, prompt="once", max_tokens=4, temperature=0,
                                      extra_body={"job_id": job_id})
    again = client.completions.create(model=MODEL, prompt="once", max_tokens=4, temperature=0,
                                      extra_body={"job_id": job_id})
    assert first.id == again.id == job_id and first.choices[0].text == again.choices[0].text
    assert fleet.field(job_id, "attempts") == "1"
    keyed = [client.completions.create(model=MODEL, prompt="k", max_tokens=2,
                                       extra_headers={"Idempotency-Key": "retry-me"}).id for _ in range(2)]
    assert keyed[0] == keyed[1]
