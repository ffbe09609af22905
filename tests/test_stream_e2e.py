"""GET /v1/jobs/{id}/stream through the real fleet: the deltas add up to the job's final
text (multi-byte characters included), a client that reconnects with Last-Event-ID gets
the rest exactly once, and a worker killed mid-stream shows as a rerun, not as repeated
or missing text."""

from __future__ import annotations

import threading
from typing import Callable, Optional

import httpx
import msgspec
import pytest

from kvfleet.streams import DELTA, END, START, StreamEvent
from tests.fleet import Fleet, running_fleet
from workers.engine.stops import REPLACEMENT

TENANT = {"X-Tenant-ID": "acme"}
#: The bench model (byte-level, random weights) decodes slowly enough on CPU for a
#: client to leave, or a worker to die, mid-job; with this seed and prompt its text has
#: characters of two and three bytes, split over tokens.
SAMPLING = {"temperature": 1.0, "seed": 1}
PROMPT = [256, *b"stream"]


class Sse(msgspec.Struct):
    id: Optional[str]
    event: Optional[str]
    data: str

    @property
    def stream_event(self) -> StreamEvent:
        return msgspec.json.decode(self.data, type=StreamEvent)


def read_sse(url: str, headers: dict[str, str], *, until: Callable[[list[Sse]], bool] = lambda _: False) -> list[Sse]:
    """The messages of one connection, until the server ends it or `until` says stop
    (then the client hangs up)."""
    messages: list[Sse] = []
    with httpx.stream("GET", url, headers={**TENANT, **headers}, timeout=httpx.Timeout(120)) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        fields: dict[str, str] = {}
        for line in response.iter_lines():
            if line.startswith(":"):
                continue  # a comment: keep-alive
            if line:
                name, _, value = line.partition(":")
                fields[name] = value[1:] if value.startswith(" ") else value
                continue
            if fields:
                messages.append(Sse(fields.get("id"), fields.get("event"), fields["data"]))
                fields = {}
                if until(messages):
                    break
    return messages


def events_of(messages: list[Sse]) -> list[StreamEvent]:
    events = [m.stream_event for m in messages if m.data != "[DONE]"]
    for m, e in zip(messages, events):
        assert m.id == e.id and m.event == e.kind
    return events


def text_of(events: list[StreamEvent]) -> str:
    text = ""
    for e in events:
        text = "" if e.kind == START else text + e.text
    return text


def result(fleet: Fleet, job_id: str) -> dict:
    return httpx.get(f"{fleet.url}/v1/jobs/{job_id}", headers=TENANT, params={"wait": 60}, timeout=90).json()


def streams_open(fleet: Fleet) -> float:
    return fleet.metrics(fleet.port).get("kvfleet_api_streams_open", -1.0)


@pytest.fixture(scope="module")
def fleet(local_infra, redis_url, cache_redis_url, tmp_path_factory):
    with running_fleet(local_infra, redis_url, cache_redis_url, tmp_path_factory.mktemp("stream"),
                       model="builtin:bench") as fleet:
        yield fleet


def test_deltas_concatenate_to_the_final_text(fleet):
    job_id = fleet.submit(prompt_len=0, prompt_tokens=PROMPT, max_new_tokens=64, sampling=SAMPLING)
    messages = read_sse(f"{fleet.url}/v1/jobs/{job_id}/stream", {})
    assert messages[-1].data == "[DONE]"
    events = events_of(messages)
    assert [e.kind for e in events[:1] + events[-1:]] == [START, END] and events[0].attempt == 1
    assert all(e.kind == DELTA for e in events[1:-1])
    final = result(fleet, job_id)
    assert final["status"] == "done" and events[-1].status.value == "done"
    assert text_of(events) == final["text"]
    assert sum(len(e.token_ids) for e in events) == len(final["tokens"])
    assert any(ord(c) > 127 and c != REPLACEMENT for c in final["text"]), f"no multi-byte character: {final['text']!r}"
    # Another tenant's job is a 404, exactly like GET /v1/jobs/{id}.
    other = httpx.get(f"{fleet.url}/v1/jobs/{job_id}/stream", headers={"X-Tenant-ID": "globex"})
    plain = httpx.get(f"{fleet.url}/v1/jobs/{job_id}", headers={"X-Tenant-ID": "globex"})
    assert other.status_code == plain.status_code == 404 and other.json() == plain.json()


def test_a_client_that_reconnects_gets_the_rest_exactly_once(fleet):
    job_id = fleet.submit(prompt_len=0, prompt_tokens=PROMPT, max_new_tokens=400, sampling=SAMPLING)
    url = f"{fleet.url}/v1/jobs/{job_id}/stream"
    first = read_sse(url, {}, until=lambda ms: sum(m.event == DELTA for m in ms) >= 2)  # then hang up
    assert first[-1].event == DELTA
    # The relay of the dropped connection stops (no XREAD loop left behind).
    fleet.wait_for(lambda: streams_open(fleet) == 0, "the relay of a closed stream stopped")
    rest = read_sse(url, {"Last-Event-ID": first[-1].id})
    assert rest[-1].data == "[DONE]"
    before, after = events_of(first), events_of(rest)
    assert not {e.id for e in before} & {e.id for e in after}
    final = result(fleet, job_id)
    assert text_of(before + after) == final["text"] and after[-1].kind == END
    # `?after=` is the same position for clients that cannot set the header.
    assert events_of(read_sse(url + f"?after={first[0].id}", {})) == events_of(first)[1:] + after
    bad = httpx.get(url, headers={**TENANT, "Last-Event-ID": "nonsense"})
    assert bad.status_code == 422 and "position" in bad.json()["error"]["message"]


def test_a_worker_killed_mid_stream_shows_as_a_rerun(make_fleet):
    # A short visibility timeout so the orphaned task comes back within seconds.
    fleet = make_fleet(workers=1, model="builtin:bench", extra_env={"KVFLEET_VISIBILITY_TIMEOUT_S": "6"})
    job_id = fleet.submit(prompt_len=0, prompt_tokens=PROMPT, max_new_tokens=300, sampling=SAMPLING)
    messages: list[Sse] = []
    streaming = threading.Event()

    def follow() -> None:
        def seen(ms: list[Sse]) -> bool:
            messages[:] = ms
            if any(m.event == DELTA for m in ms):
                streaming.set()
            return False
        read_sse(f"{fleet.url}/v1/jobs/{job_id}/stream", {}, until=seen)

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    assert streaming.wait(120), fleet.logs()
    fleet.kill("worker-3")  # api-1, scheduler-2, worker-3: mid-job, its text half streamed
    fleet.start("worker")
    reader.join(240)
    assert not reader.is_alive(), fleet.logs()
    assert messages[-1].data == "[DONE]"
    events = events_of(messages)
    starts = [(i, e.attempt) for i, e in enumerate(events) if e.kind == START]
    assert [a for _, a in starts] == [1, 2], starts
    rerun = events[starts[1][0]:]
    assert all(e.attempt == 2 for e in rerun) and rerun[-1].kind == END and rerun[-1].status.value == "done"
    final = result(fleet, job_id)
    assert text_of(events) == final["text"] == "".join(e.text for e in rerun)
    assert sum(len(e.token_ids) for e in rerun) == len(final["tokens"]) == 300
    assert int(fleet.redis.hget(fleet.keys.job(job_id), "attempts")) == 2


def test_a_job_nobody_follows_has_no_stream_and_one_followed_midway_streams_the_rest(fleet):
    quiet = fleet.submit(prompt_len=0, prompt_tokens=PROMPT, max_new_tokens=8, sampling=SAMPLING)
    assert result(fleet, quiet)["status"] == "done"
    assert fleet.redis.exists(fleet.keys.job_stream(quiet)) == 0  # the worker wrote none
    job_id = fleet.submit(prompt_len=0, prompt_tokens=PROMPT, max_new_tokens=300, sampling=SAMPLING)
    fleet.wait_for(lambda: httpx.get(f"{fleet.url}/v1/jobs/{job_id}", headers=TENANT).json()["status"] == "running",
                   "the job running before anyone follows it")
    events = events_of(read_sse(f"{fleet.url}/v1/jobs/{job_id}/stream", {}))
    final = result(fleet, job_id)
    assert events[0].kind == START and events[-1].kind == END and text_of(events) == final["text"]
    # Streamed by the worker as it ran (real entry ids), not made up from the result.
    real = [e for e in events if e.kind == DELTA and ":" not in e.id]
    assert len(real) >= 2, [e.id for e in events]
    assert sum(len(e.token_ids) for e in events) == len(final["tokens"]) == 300
    # The quiet job, followed once it is done, is told from its result.
    told = events_of(read_sse(f"{fleet.url}/v1/jobs/{quiet}/stream", {}))
    assert text_of(told) == result(fleet, quiet)["text"] and told[-1].kind == END
