"""Turns what a client sent into a `JobRequest`, or a message saying what to fix.

Shape and ranges are checked by msgspec while decoding (`contracts.SubmitRequest`);
what depends on the served model (its name, context length, vocabulary) is checked
here, where the model's limits are known.
"""

from __future__ import annotations

from typing import Optional

from kvfleet.contracts import JobRequest, Priority, SubmitRequest, new_job_id
from kvfleet.modelinfo import ModelInfo
from producer.errors import BadRequest


def build_request(
    submit: SubmitRequest,
    model: ModelInfo,
    *,
    tenant: str,
    priority: Priority,
    now: float,
    default_timeout_s: float,
) -> JobRequest:
    """The job, its prompt as token ids: a text prompt is tokenized here, once, and the
    ids travel with the job, so the scheduler and the worker never tokenize it again."""
    if (submit.prompt is None) == (submit.prompt_tokens is None):
        raise BadRequest("give exactly one of `prompt` (text) or `prompt_tokens` (a list of token ids)")
    if submit.model is not None and submit.model != model.name:
        raise BadRequest(f"unknown model {submit.model!r}: this fleet serves {model.name!r} (or leave `model` out)")
    if submit.prompt is not None:
        if not submit.prompt.strip():
            raise BadRequest("`prompt` is blank; send some text to complete")
        tokens = model.encode(submit.prompt)
    else:
        tokens = submit.prompt_tokens
        bad = next((t for t in tokens if t >= model.vocab_size), None)
        if bad is not None:
            raise BadRequest(f"`prompt_tokens` contains id {bad}, outside the model's vocabulary of {model.vocab_size}")
    prompt_len = len(tokens)
    if prompt_len + submit.max_new_tokens > model.max_context:
        raise BadRequest(
            f"the prompt is {prompt_len} tokens and `max_new_tokens` is {submit.max_new_tokens}, "
            f"but the model's context is {model.max_context} tokens: shorten the prompt or lower max_new_tokens "
            f"to at most {max(model.max_context - prompt_len, 0)}"
        )
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
