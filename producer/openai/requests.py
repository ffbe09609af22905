"""An OpenAI request body -> a kvfleet job, or a 400 that names the field to change.

Real clients send more fields than kvfleet serves. Each field is one of:
- served: decoded into `schemas.CompletionRequest` / `ChatCompletionRequest`;
- harmless at its no-op value: LangChain, LiteLLM and others send `n: 1`,
  `presence_penalty: 0`, `logprobs: false`, `tools: []` ... as defaults; those pass,
  any other value is refused (`NOOP_VALUES`);
- unknown: refused, naming it. Nothing is silently ignored, because a client that sets
  `logit_bias` or `response_format` expects an answer shaped by it.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Mapping, Optional, Union

import msgspec

from kvfleet import chat
from kvfleet.contracts import MAX_NEW_TOKENS_LIMIT, Priority, Sampling, SubmitRequest
from kvfleet.modelinfo import ModelInfo
from producer.errors import BadRequest, NotFound
from producer.openai.schemas import ChatCompletionRequest, CompletionRequest
from producer.validation import FieldNames

#: Fields accepted only at a value that changes nothing, and why the rest is refused.
NOOP_VALUES: dict[str, tuple[tuple[Any, ...], str]] = {
    "frequency_penalty": ((0, 0.0, None), "penalties are not implemented by kvfleet's sampler"),
    "presence_penalty": ((0, 0.0, None), "penalties are not implemented by kvfleet's sampler"),
    "logit_bias": ((None, {}), "logit bias is not implemented by kvfleet's sampler"),
    "logprobs": ((None, False, 0), "kvfleet does not return log-probabilities"),
    "top_logprobs": ((None, 0), "kvfleet does not return log-probabilities"),
    "best_of": ((None, 1), "kvfleet generates one sequence per request"),
    "echo": ((None, False), "kvfleet does not echo the prompt; it is in your request"),
    "suffix": ((None, ""), "kvfleet's models do not fill in the middle"),
    "response_format": ((None, {"type": "text"}), "kvfleet has no constrained (JSON) decoding"),
    "tools": ((None, []), "kvfleet's models have no tool calling"),
    "tool_choice": ((None, "none"), "kvfleet's models have no tool calling"),
    "parallel_tool_calls": ((None, False, True), ""),  # meaningless without tools: any value is a no-op
    "functions": ((None, []), "kvfleet's models have no function calling"),
    "function_call": ((None, "none"), "kvfleet's models have no function calling"),
    "store": ((None, False), "kvfleet keeps every job by id anyway (GET /v1/jobs/{id}); stored completions "
                             "are not served"),
    "metadata": ((None, {}), "stored-completion metadata is not served"),
    "modalities": ((None, ["text"]), "kvfleet's models are text-only"),
    "audio": ((None,), "kvfleet's models are text-only"),
    "prediction": ((None,), "predicted outputs are not served"),
    "reasoning_effort": ((None,), "kvfleet's models are not reasoning models"),
    "web_search_options": ((None,), "web search is not served"),
}

#: OpenAI's service tiers onto kvfleet's priority classes.
SERVICE_TIERS = {"priority": Priority.HIGH, "default": Priority.NORMAL, "auto": Priority.NORMAL,
                 "flex": Priority.LOW}
#: OpenAI's default when `max_tokens` is left out of a legacy completion.
COMPLETION_DEFAULT_MAX_TOKENS = 16
OPENAI_DEFAULT_TEMPERATURE = 1.0

_raw = msgspec.json.Decoder(dict[str, Any])


def decode(body: bytes, kind: type[Union[CompletionRequest, ChatCompletionRequest]],
           ) -> Union[CompletionRequest, ChatCompletionRequest]:
    """The request, or BadRequest naming the field."""
    try:
        raw = _raw.decode(body)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the body must be a JSON object: {exc}") from None
    served = set(kind.__struct_fields__)
    for name in list(raw):
        if name in served:
            continue
        if name not in NOOP_VALUES:
            raise BadRequest(f"unknown field `{name}`: kvfleet does not serve it; remove it (see docs/openai.md for "
                             "the fields served)", param=name, code="unsupported_parameter")
        allowed, why = NOOP_VALUES[name]
        if raw[name] not in allowed:
            raise BadRequest(f"`{name}` is not supported: {why}; remove it or send "
                             f"{msgspec.json.encode(allowed[-1]).decode()}", param=name, code="unsupported_parameter")
        del raw[name]
    try:
        request = msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid request: {exc}", param=_param(str(exc))) from None
    if request.n not in (None, 1):
        raise BadRequest(f"`n` is {request.n}: kvfleet generates one choice per request; send n=1 (or leave it "
                         "out) and send several requests, or use the Batch API", param="n",
                         code="unsupported_parameter")
    if request.stream_options is not None and not request.stream:
        raise BadRequest("`stream_options` is only allowed with `stream: true`", param="stream_options")
    return request


def check_model(request: Union[CompletionRequest, ChatCompletionRequest], model: ModelInfo) -> None:
    if request.model != model.name:
        raise NotFound(f"the model {request.model!r} does not exist on this fleet: it serves {model.name!r} "
                       "(GET /v1/models lists it)", param="model", code="model_not_found")


def priority_of(request: Union[CompletionRequest, ChatCompletionRequest], header: Optional[str]) -> Priority:
    """`X-Priority` header, then kvfleet's `priority`, then `service_tier`, then normal."""
    if header is not None:
        try:
            return Priority(header.strip().lower())
        except ValueError:
            raise BadRequest(f"X-Priority {header!r} is not one of high, normal, low", param="X-Priority") from None
    if request.priority is not None:
        return request.priority
    return SERVICE_TIERS[request.service_tier] if request.service_tier else Priority.NORMAL


def job_id_of(request: Union[CompletionRequest, ChatCompletionRequest], headers: Mapping[str, str],
              tenant: str) -> Optional[str]:
    """The client's idempotency key: `job_id`, else the `Idempotency-Key` header (hashed
    with the tenant into a valid job id, so any string works and tenants never collide)."""
    if request.job_id is not None:
        return request.job_id
    key = headers.get("idempotency-key")
    if not key:
        return None
    return "idem-" + hashlib.sha256(f"{tenant}\0{key}".encode()).hexdigest()[:40]


def sampling_of(request: Union[CompletionRequest, ChatCompletionRequest], *,
                stop_token_ids: tuple[int, ...] = ()) -> Sampling:
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    return Sampling(
        temperature=OPENAI_DEFAULT_TEMPERATURE if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=max(0, request.top_k or 0),
        seed=request.seed, stop=stop, stop_token_ids=list(stop_token_ids),
    )


def completion_submit(request: CompletionRequest, model: ModelInfo, job_id: Optional[str], *,
                      default_max_tokens: Callable[[int], int]) -> tuple[SubmitRequest, FieldNames]:
    """Without `max_tokens`, OpenAI's default of 16 (`default_max_tokens` is for chat)."""
    text, tokens = _prompt(request.prompt)
    submit = SubmitRequest(
        prompt=text, prompt_tokens=tokens,
        max_new_tokens=request.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS,
        sampling=sampling_of(request), job_id=job_id, timeout_s=request.timeout_s)
    return submit, FieldNames(prompt="prompt", prompt_tokens="prompt", max_new_tokens="max_tokens")


def chat_submit(request: ChatCompletionRequest, model: ModelInfo, job_id: Optional[str], *,
                default_max_tokens: Callable[[int], int]) -> tuple[SubmitRequest, FieldNames]:
    """`default_max_tokens(prompt_tokens)`: the output budget when the client sets none."""
    try:
        tokens = model.encode_chat(chat.normalize_messages(request.messages))
    except chat.ChatError as exc:
        raise BadRequest(str(exc), param=exc.param or "messages") from None
    output_field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = request.max_completion_tokens or request.max_tokens
    if max_tokens is None:
        # At least 1: when nothing fits, validation says by how much to shorten the prompt.
        max_tokens = max(1, min(default_max_tokens(len(tokens)), MAX_NEW_TOKENS_LIMIT))
    submit = SubmitRequest(
        prompt_tokens=tokens, max_new_tokens=max_tokens,
        sampling=sampling_of(request, stop_token_ids=model.stop_token_ids), job_id=job_id,
        timeout_s=request.timeout_s)
    return submit, FieldNames(prompt="messages", prompt_tokens="messages", max_new_tokens=output_field)


def _prompt(prompt: Union[str, list[Any]]) -> tuple[Optional[str], Optional[list[int]]]:
    """(text, None) or (None, token ids), from any of the prompt shapes OpenAI takes."""
    if isinstance(prompt, list) and not _is_token_ids(prompt):
        if len(prompt) > 1:
            raise BadRequest(f"`prompt` holds {len(prompt)} prompts: send one per request, or use the Batch API "
                             "(POST /v1/batches) for many", param="prompt", code="unsupported_parameter")
        prompt = prompt[0]
        if not (isinstance(prompt, str) and prompt) and not (isinstance(prompt, list) and prompt
                                                                and _is_token_ids(prompt)):
            raise BadRequest("`prompt` must be a string, a list of token ids, or a list of one of those",
                             param="prompt")
    if isinstance(prompt, str):
        return prompt, None
    return None, prompt


def _is_token_ids(items: list[Any]) -> bool:
    # bool is an int in Python, not in JSON: `[true]` is not a token list.
    return all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items)


def _param(message: str) -> Optional[str]:
    """`$.stop[2]` in a msgspec message -> "stop[2]"."""
    _, at, path = message.rpartition(" - at `$")
    if not at:
        return None
    path = path.rstrip("`").lstrip(".")
    return path or None
