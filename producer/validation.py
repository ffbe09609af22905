"""Turns what a client sent into a `JobRequest`, or a message saying what to fix.

Shape and ranges are checked by msgspec while decoding (`contracts.SubmitRequest`);
what depends on the served model (its name, context length, vocabulary) is checked
here, where the model's limits are known. Every message names the field the client
sent (`FieldNames`) and a change that would make the request pass.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import anyio

from kvfleet.contracts import JobRequest, Priority, SubmitRequest, new_job_id
from kvfleet.modelinfo import ModelInfo
from producer.errors import BadRequest


class FieldNames(NamedTuple):
    """What the client called each field, so that a message names the field it sent:
    the OpenAI routes say `max_tokens` where the native API says `max_new_tokens`."""

    prompt: str = "prompt"
    prompt_tokens: str = "prompt_tokens"
    max_new_tokens: str = "max_new_tokens"


def build_request(
    submit: SubmitRequest,
    model: ModelInfo,
    *,
    tenant: str,
    priority: Priority,
    now: float,
    default_timeout_s: float,
    names: FieldNames = FieldNames(),
) -> JobRequest:
    """The job, its prompt as token ids: a text prompt is tokenized here, once, and the
    ids travel with the job, so the scheduler and the worker never tokenize it again."""
    if (submit.prompt is None) == (submit.prompt_tokens is None):
        raise BadRequest(f"give exactly one of `{names.prompt}` (text) or `{names.prompt_tokens}` "
                         "(a list of token ids)", param=names.prompt)
    if submit.model is not None and submit.model != model.name:
        raise BadRequest(f"unknown model {submit.model!r}: this fleet serves {model.name!r} (or leave `model` out)",
                         param="model", code="model_not_found")
    if submit.prompt is not None:
        if not submit.prompt.strip():
            raise BadRequest(f"`{names.prompt}` is blank; send some text to complete", param=names.prompt)
        tokens = model.encode(submit.prompt)
    else:
        tokens = submit.prompt_tokens
        bad = next((t for t in tokens if t >= model.vocab_size), None)
        if bad is not None:
            raise BadRequest(f"`{names.prompt_tokens}` contains id {bad}, outside the model's vocabulary of "
                             f"{model.vocab_size}", param=names.prompt_tokens)
    check_context(len(tokens), submit.max_new_tokens, model.max_context, names)
    timeout_s: Optional[float] = submit.timeout_s or default_timeout_s
    return JobRequest(
        job_id=submit.job_id or new_job_id(),
        tenant=tenant,
        priority=priority,
        model=model.name,
        max_new_tokens=submit.max_new_tokens,
        submitted_at=now,
        deadline=now + timeout_s,
        prompt_tokens=tokens,
        sampling=submit.sampling,
    )


#: A text prompt longer than this (characters) is tokenized on a worker thread, not on
#: the event loop: 1,024 characters take a BPE tokenizer about half a millisecond here
#: (16,000 about 11 ms), several thread hand-offs' worth; shorter ones stay on the loop.
OFF_LOOP_PROMPT_CHARS = 1024


async def build_request_off_loop(submit: SubmitRequest, model: ModelInfo, **kwargs) -> JobRequest:
    """`build_request`, with a long text prompt tokenized on a worker thread so that the
    other requests' I/O goes on meanwhile."""
    if submit.prompt is not None and len(submit.prompt) > OFF_LOOP_PROMPT_CHARS:
        return await anyio.to_thread.run_sync(functools.partial(build_request, submit, model, **kwargs))
    return build_request(submit, model, **kwargs)


def check_context(prompt_len: int, max_new_tokens: int, max_context: int, names: FieldNames = FieldNames()) -> None:
    """Refuse a job whose prompt and output cannot fit the model's context, saying by how
    much: the tokens to cut from the prompt and, when the prompt leaves room for any
    output at all, the largest output that fits."""
    over = prompt_len + max_new_tokens - max_context
    if over <= 0:
        return
    room = max_context - prompt_len  # output tokens that fit after this prompt
    fixes = [f"shorten the prompt by {over} tokens (to {prompt_len - over}) to keep `{names.max_new_tokens}` "
             f"at {max_new_tokens}"]
    if room >= 1:
        fixes.append(f"lower `{names.max_new_tokens}` to at most {room}")
    else:
        fixes.append(f"by at least {1 - room} tokens (to {max_context - 1}) for a one-token answer")
    raise BadRequest(
        f"the prompt is {prompt_len} tokens and `{names.max_new_tokens}` is {max_new_tokens}, but the model's "
        f"context is {max_context} tokens: {fixes[0]}, or {fixes[1]}",
        param=names.prompt if room < 1 else names.max_new_tokens, code="context_length_exceeded",
    )
