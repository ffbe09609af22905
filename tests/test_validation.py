"""A long text prompt is tokenized off the event loop, a short one on it, and both give
the job `build_request` gives (producer/validation.py)."""

from __future__ import annotations

import asyncio
import threading

import msgspec

from kvfleet.contracts import Priority, SubmitRequest
from kvfleet.modelinfo import load_model_info
from producer.validation import OFF_LOOP_PROMPT_CHARS, build_request, build_request_off_loop


class RecordingModel:
    """A built-in model, noting the thread each prompt is tokenized on."""

    def __init__(self) -> None:
        self.model = load_model_info("builtin:bench")  # a context of 4,096: room for a long prompt
        self.threads: list[str] = []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return self.model.encode(text)


def test_a_long_prompt_is_tokenized_on_a_worker_thread_and_a_short_one_on_the_loop():
    model = RecordingModel()
    fields = dict(tenant="acme", priority=Priority.NORMAL, now=1.0, default_timeout_s=60.0)
    short = SubmitRequest(prompt="a" * OFF_LOOP_PROMPT_CHARS, max_new_tokens=4, job_id="short")
    long = SubmitRequest(prompt="b" * (OFF_LOOP_PROMPT_CHARS + 1), max_new_tokens=4, job_id="long")

    async def build():
        return ([await build_request_off_loop(s, model, **fields) for s in (short, long)],
                threading.current_thread().name)

    jobs, loop_thread = asyncio.run(build())
    assert model.threads[0] == loop_thread and model.threads[1] != loop_thread
    assert [msgspec.to_builtins(j) for j in jobs] == [
        msgspec.to_builtins(build_request(s, model, **fields)) for s in (short, long)]
