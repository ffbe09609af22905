"""OpenAI's request and answer shapes for the routes kvfleet serves, as msgspec Structs.

Requests are decoded into these after `producer.openai.requests` has dealt with the
fields kvfleet refuses or ignores, so a type error names its field
("Expected `float`, got `str` - at `$.temperature`"). Answers are encoded from them, so
the OpenAPI document (built from the same Structs) describes exactly what is sent.
Field names, defaults and ranges follow the OpenAI API reference; kvfleet's own extras
(`priority`, `top_k`, `job_id`, `timeout_s`) are extra body fields, as vLLM does it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

import msgspec

from kvfleet.contracts import MAX_NEW_TOKENS_LIMIT, MAX_PROMPT_CHARS, JobId, Priority

MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_NEW_TOKENS_LIMIT)]
StopText = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
#: OpenAI's service tiers, mapped onto kvfleet's priority classes (producer/openai/requests.py).
ServiceTier = Literal["auto", "default", "flex", "priority"]


class StreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    include_usage: bool = False  # one more chunk before [DONE]: empty choices, the usage


class _Common(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    max_tokens: Optional[MaxTokens] = None
    #: OpenAI's default is 1 (sampling); 0 is greedy.
    temperature: Optional[Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]] = None
    top_p: Optional[Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]] = None
    stop: Union[StopText, Annotated[list[StopText], msgspec.Meta(max_length=8)], None] = None
    seed: Optional[Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]] = None
    n: Optional[Annotated[int, msgspec.Meta(ge=1, le=128)]] = None  # only 1 is served (a clear 400 otherwise)
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    user: Optional[Annotated[str, msgspec.Meta(max_length=256)]] = None  # logged with the job, nothing else
    service_tier: Optional[ServiceTier] = None
    # kvfleet's extras
    priority: Optional[Priority] = None
    top_k: Optional[Annotated[int, msgspec.Meta(ge=-1, le=100_000)]] = None  # -1 or 0: no cut (vLLM uses -1)
    job_id: Optional[JobId] = None  # idempotency: the same id from the same tenant is one job
    timeout_s: Optional[Annotated[float, msgspec.Meta(gt=0, le=7 * 24 * 3600)]] = None


PromptText = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PROMPT_CHARS)]


class CompletionRequest(_Common, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`POST /v1/completions`. A list of prompts is a batch: one prompt per request here
    (the Batch API takes many)."""

    #: A string, a list of token ids, or a list of one of those (msgspec cannot type a
    #: union of two list shapes: producer/openai/requests.py checks the list's items).
    prompt: Union[PromptText, Annotated[list[Any], msgspec.Meta(
        min_length=1, description="a string, a list of token ids, or a list of one string or one list of ids")]]


class ChatCompletionRequest(_Common, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`POST /v1/chat/completions`; `messages` are checked by `kvfleet.chat.normalize_messages`."""

    messages: Annotated[list[dict[str, Any]], msgspec.Meta(min_length=1)]
    max_completion_tokens: Optional[MaxTokens] = None  # the newer name of max_tokens; wins when both are sent


# --- answers ---------------------------------------------------------------------------

class PromptTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int = 0  # prompt tokens served from the KV cache instead of prefilled


class CompletionUsage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class CompletionChoice(msgspec.Struct, frozen=True):
    index: int
    text: str
    finish_reason: Optional[Literal["stop", "length"]]
    logprobs: None = None


class Completion(msgspec.Struct, frozen=True):
    id: str  # the job id: GET /v1/jobs/{id} finds the same job
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: Optional[str] = None
    usage: Optional[CompletionUsage] = None
    object: Literal["text_completion"] = "text_completion"


class ChatMessage(msgspec.Struct, frozen=True):
    content: Optional[str]
    role: Literal["assistant"] = "assistant"
    refusal: None = None


class ChatChoice(msgspec.Struct, frozen=True):
    index: int
    message: ChatMessage
    finish_reason: Optional[Literal["stop", "length"]]
    logprobs: None = None


class ChatCompletion(msgspec.Struct, frozen=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    system_fingerprint: Optional[str] = None
    service_tier: Optional[str] = None
    object: Literal["chat.completion"] = "chat.completion"


class ChoiceDelta(msgspec.Struct, frozen=True, omit_defaults=True):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChatChunkChoice(msgspec.Struct, frozen=True):
    index: int
    delta: ChoiceDelta
    finish_reason: Optional[Literal["stop", "length"]] = None
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct, frozen=True):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    system_fingerprint: Optional[str] = None
    usage: Optional[CompletionUsage] = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class Model(msgspec.Struct, frozen=True):
    id: str
    created: int
    owned_by: str = "kvfleet"
    object: Literal["model"] = "model"
    #: kvfleet's extras: the context length and the live workers serving the model.
    max_model_len: Optional[int] = None
    workers: int = 0


class ModelList(msgspec.Struct, frozen=True):
    data: list[Model]
    object: Literal["list"] = "list"
