"""Turns what a client sent into a `JobRequest`, or a message saying what to fix.

Shape and ranges are checked by msgspec while decoding (`contracts.SubmitRequest`);
what depends on the served model (its name, context length, vocabulary) is checked
here, where the model's limits are known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from kvfleet.contracts import JobRequest, Priority, SubmitRequest, new_job_id


class BadRequest(ValueError):
    """The client's input cannot be run; the message says what to change."""


@dataclass(frozen=True)
class ModelLimits:
    name: str
    max_context: int
    vocab_size: int
    encode: Callable[[str], list[int]]


def load_limits(source: str) -> ModelLimits:
    """Reads the served model's tokenizer and config (not its weights)."""
    from workers.model.loader import load_tokenizer_and_config

    tokenizer, config, name = load_tokenizer_and_config(source)
    return ModelLimits(name=name, max_context=config.max_position_embeddings,
                       vocab_size=config.vocab_size, encode=tokenizer.encode)


def build_request(
    submit: SubmitRequest,
    limits: ModelLimits,
    *,
    tenant: str,
    priority: Priority,
    now: float,
    default_timeout_s: float,
) -> tuple[JobRequest, int]:
    """Returns the request and its prompt length in tokens."""
    if (submit.prompt is None) == (submit.prompt_tokens is None):
        raise BadRequest("give exactly one of `prompt` (text) or `prompt_tokens` (a list of token ids)")
    if submit.model is not None and submit.model != limits.name:
        raise BadRequest(f"unknown model {submit.model!r}: this fleet serves {limits.name!r} (or leave `model` out)")
    if submit.prompt is not None:
        if not submit.prompt.strip():
            raise BadRequest("`prompt` is blank; send some text to complete")
        prompt_len = len(limits.encode(submit.prompt))
    else:
        assert submit.prompt_tokens is not None
        bad = next((t for t in submit.prompt_tokens if t >= limits.vocab_size), None)
        if bad is not None:
            raise BadRequest(f"`prompt_tokens` contains id {bad}, outside the model's vocabulary of {limits.vocab_size}")
        prompt_len = len(submit.prompt_tokens)
    if prompt_len + submit.max_new_tokens > limits.max_context:
        raise BadRequest(
            f"the prompt is {prompt_len} tokens and `max_new_tokens` is {submit.max_new_tokens}, "
            f"but the model's context is {limits.max_context} tokens: shorten the prompt or lower max_new_tokens "
            f"to at most {max(limits.max_context - prompt_len, 0)}"
        )
    timeout_s: Optional[float] = submit.timeout_s or default_timeout_s
    request = JobRequest(
        job_id=submit.job_id or new_job_id(),
        tenant=tenant,
        priority=priority,
        model=limits.name,
        max_new_tokens=submit.max_new_tokens,
        submitted_at=now,
        deadline=now + timeout_s,
        prompt=submit.prompt,
        prompt_tokens=submit.prompt_tokens,
        sampling=submit.sampling,
        prompt_len=prompt_len,  # the scheduler reserves by it, without a tokenizer
    )
    return request, prompt_len
