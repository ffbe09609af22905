"""A job's stream (kvfleet/streams.py) -> OpenAI's server-sent events.

    data: {chunk}        one per delta of text, first the assistant role (chat)
    data: {chunk}        the last: empty delta, its finish_reason
    data: {usage chunk}  with stream_options.include_usage: empty choices, the usage
    data: [DONE]

A job that ends without a completion (failed, expired, cancelled) ends the stream with
`data: {"error": {...}}`, which OpenAI's clients raise as an APIError.

A worker that dies mid-job: the job is run again from the start (a "start" event with
attempt > 1). Text already sent cannot be taken back, so the relay says so in an SSE
comment (`: kvfleet: ...`, which clients ignore) and checks the rerun against what was
sent: while the rerun repeats it (greedy and seeded sampling do), it is not sent
again, and the stream goes on from where it was; if the rerun differs, the stream ends
with an error naming GET /v1/jobs/{id}, where the final result is. Never a repeated or
dropped token.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional

import msgspec

from kvfleet.contracts import JobResult, JobState, Priority, Timings, Usage
from kvfleet.streams import StreamEvent
from producer.openai import responses
from producer.openai.schemas import ChoiceDelta, CompletionUsage, PromptTokensDetails

KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"


@dataclass
class Chunks:
    """Builds one route's chunks (chat or legacy completions) for one job."""

    job_id: str
    created: int
    model: str
    fingerprint: Optional[str]
    chat: bool
    include_usage: bool

    def first(self) -> Optional[bytes]:
        if not self.chat:
            return None
        return self._sse(responses.chat_chunk(self.job_id, self.created, self.model, self.fingerprint,
                                              delta=ChoiceDelta(role="assistant", content="")))

    def text(self, text: str) -> bytes:
        if self.chat:
            chunk = responses.chat_chunk(self.job_id, self.created, self.model, self.fingerprint,
                                         delta=ChoiceDelta(content=text))
        else:
            chunk = responses.completion_chunk(self.job_id, self.created, self.model, self.fingerprint, text=text)
        return self._sse(chunk)

    def finish(self, reason: Optional[str], usage: Optional[Usage]) -> bytes:
        make: Callable = responses.chat_chunk if self.chat else responses.completion_chunk
        out = self._sse(make(self.job_id, self.created, self.model, self.fingerprint, reason=reason or "stop"))
        if self.include_usage and usage is not None:
            total = CompletionUsage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                                    total_tokens=usage.prompt_tokens + usage.completion_tokens,
                                    prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens))
            out += self._sse(make(self.job_id, self.created, self.model, self.fingerprint, usage_=total,
                                  final_usage=True))
        return out

    @staticmethod
    def _sse(chunk: msgspec.Struct) -> bytes:
        return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


def error_event(message: str, code: str, *, type_: str = "server_error") -> bytes:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


async def relay(events: AsyncIterator[StreamEvent], chunks: Chunks, *, deadline: float) -> AsyncIterator[bytes]:
    """The SSE bytes for one job, from its stream events. `deadline` (unix seconds):
    past it, the stream ends with an error rather than wait for a job nobody runs."""
    first = chunks.first()
    if first is not None:
        yield first
    sent = ""  # text the client has, all from one attempt
    redo: Optional[str] = None  # after a restart: the rerun's text, while it repeats `sent`
    async for event in until(events, deadline):
        if event.kind == "start":
            if event.attempt > 1 and (sent or redo is not None):
                redo = ""
                yield (f": kvfleet: the job's worker was lost; attempt {event.attempt} runs it again from the "
                       "start, and text already sent is not sent again\n\n").encode()
            continue
        if event.kind == "delta":
            if redo is None:
                sent += event.text
                if event.text:
                    yield chunks.text(event.text)
                continue
            redo += event.text
            if not (sent.startswith(redo) or redo.startswith(sent)):
                yield error_event(f"the job's worker was lost mid-stream and its rerun wrote different text; the "
                                  f"final result is at GET /v1/jobs/{chunks.job_id}", "stream_restarted")
                return
            if len(redo) > len(sent):
                yield chunks.text(redo[len(sent):])
                sent, redo = redo, None
            continue
        if event.kind == "end":
            if event.status is not JobState.DONE:
                error = responses.not_done(_as_result(chunks.job_id, event))
                yield error_event(error.message, error.code or "failed", type_=error.type)
            elif redo is not None and redo != sent:
                yield error_event(f"the job's worker was lost mid-stream and its rerun wrote different text; the "
                                  f"final result is at GET /v1/jobs/{chunks.job_id}", "stream_restarted")
            else:
                yield chunks.finish(event.finish_reason, event.usage)
                yield DONE
            return
    yield error_event(f"job {chunks.job_id} did not finish in time; its result will be at GET /v1/jobs/"
                      f"{chunks.job_id}", "still_running")


async def until(events: AsyncIterator[StreamEvent], deadline: float) -> AsyncIterator[StreamEvent]:
    """`events` until `deadline` (unix seconds), then stop: a job that nobody runs (no
    scheduler, no worker) must not hold the connection for ever."""
    while True:
        try:
            yield await asyncio.wait_for(anext(events), timeout=max(0.0, deadline - time.time()))
        except (StopAsyncIteration, asyncio.TimeoutError):
            return


def _as_result(job_id: str, event: StreamEvent) -> JobResult:
    # Only what `responses.not_done` reads; tenant and priority are not needed there.
    return JobResult(job_id=job_id, status=event.status or JobState.FAILED, tenant="", priority=Priority.NORMAL,
                     error=event.error, timings=Timings())
