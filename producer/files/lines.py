"""One line of a batch input file -> a kvfleet job, or a `LineError` naming the line.

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

`body` is exactly what `POST /v1/completions` or `/v1/chat/completions` takes, decoded
by the same policy (`producer.openai.requests`), so a line is refused for the same
reasons and with the same message the online endpoint gives. The same function checks
a line on upload and turns it into its job when the batch runs, so a file that passed
upload cannot fail differently later (short of the fleet's model changing meanwhile).
"""

from __future__ import annotations

from typing import Any, BinaryIO, Iterator, NamedTuple, Optional, Union

import msgspec

from kvfleet.ceiling import over_ceiling
from kvfleet.contracts import MAX_NEW_TOKENS_LIMIT, JobRequest, Priority
from kvfleet.modelinfo import ModelInfo
from kvfleet.settings import Settings
from kvfleet.tenancy import Tenant
from producer.errors import ApiError
from producer.openai import requests
from producer.openai.schemas import ChatCompletionRequest, CompletionRequest
from producer.validation import build_request

#: The endpoints a batch may run, and the request each one's `body` is.
ENDPOINTS: dict[str, type[Union[CompletionRequest, ChatCompletionRequest]]] = {
    "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
MAX_CUSTOM_ID_CHARS = 512


class LineError(Exception):
    def __init__(self, line: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(f"line {line}: {message}")
        self.line, self.message, self.param, self.code = line, message, param, code


class Line(NamedTuple):
    number: int  # 1-based, as an editor counts: blank lines count too
    end: int  # byte offset just past this line: where reading resumes
    raw: bytes


class BatchLine(NamedTuple):
    custom_id: str
    url: str
    body: dict[str, Any]


def read_lines(f: BinaryIO, *, offset: int = 0, number: int = 0) -> Iterator[Line]:
    """The non-blank lines from byte `offset` (the line before it being `number`), one
    at a time: a file of any size is never held in memory."""
    f.seek(offset)
    for raw in f:
        offset += len(raw)
        number += 1
        if raw.strip():
            yield Line(number, offset, raw)


_decode_object = msgspec.json.Decoder(dict[str, Any]).decode


def parse(line: Line) -> BatchLine:
    """The line's envelope, checked: a JSON object with a custom_id, POST and a served url."""
    try:
        obj = _decode_object(line.raw)
    except msgspec.DecodeError as exc:
        raise LineError(line.number, f"not a JSON object ({exc}); each line must be one JSON object such as "
                                     '{"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", '
                                     '"body": {...}}') from None
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError(line.number, "`custom_id` is missing: give every line a unique string custom_id, "
                                     "by which you find its result in the output", param="custom_id")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise LineError(line.number, f"`custom_id` is {len(custom_id)} characters; keep it to "
                                     f"{MAX_CUSTOM_ID_CHARS}", param="custom_id")
    if obj.get("method") != "POST":
        raise LineError(line.number, f"`method` is {obj.get('method')!r}; it must be \"POST\"", param="method")
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise LineError(line.number, f"`url` {url!r} is not served in a batch; use one of "
                                     f"{', '.join(ENDPOINTS)}", param="url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError(line.number, "`body` must be a JSON object: the request you would send to "
                                     f"{url}", param="body")
    unknown = set(obj) - {"custom_id", "method", "url", "body"}
    if unknown:
        raise LineError(line.number, f"unknown field(s) {', '.join(sorted(unknown))}; a line holds custom_id, "
                                     "method, url and body", param=sorted(unknown)[0])
    return BatchLine(custom_id, url, body)


def batch_priority(tenant: Tenant) -> Priority:
    """Batches run at low priority; a gold tenant's at normal (it pays for its reserve)."""
    return Priority.NORMAL if tenant.tier.value == "gold" else Priority.LOW


def build_job(line: BatchLine, number: int, *, model: ModelInfo, settings: Settings, tenant: Tenant,
              job_id: str, now: float, deadline: float, quotas: bool) -> JobRequest:
    """The line's job, at the batch's class, with the batch's deadline; LineError if it
    can never run (bad body, over the context or the class's ceiling)."""
    kind = ENDPOINTS[line.url]
    priority = batch_priority(tenant)
    try:
        request = requests.decode(msgspec.json.encode(line.body), kind)
        if request.stream:
            raise LineError(number, "`stream` is not allowed in a batch: the whole answer goes to the output "
                                    "file; remove it", param="body.stream")
        requests.check_model(request, model)
        make = requests.chat_submit if kind is ChatCompletionRequest else requests.completion_submit
        submission, names = make(request, model, job_id, default_max_tokens=lambda prompt: _default_max_tokens(
            settings, model, tenant, priority, prompt, quotas))
        job = build_request(submission, model, tenant=tenant.name, priority=priority, now=now,
                            default_timeout_s=max(1.0, deadline - now), names=names)
    except ApiError as exc:
        raise LineError(number, exc.message, param=f"body.{exc.param}" if exc.param else "body",
                        code=exc.code) from None
    too_big = over_ceiling(priority, len(job.prompt_tokens or ()), job.max_new_tokens, settings.policy,
                           output_field=names.max_new_tokens)
    if too_big is not None:
        raise LineError(number, f"{too_big} (batches run at {priority.value} priority)",
                        param=f"body.{names.max_new_tokens}", code="over_ceiling")
    # The batch's window is every line's deadline, whatever `timeout_s` the body set.
    return msgspec.structs.replace(job, deadline=deadline)


def _default_max_tokens(settings: Settings, model: ModelInfo, tenant: Tenant, priority: Priority,
                        prompt_tokens: int, quotas: bool) -> int:
    """As the online chat endpoint does (producer/routes/completions.py)."""
    limits = [settings.api.chat_max_tokens, model.max_context - prompt_tokens,
              settings.policy.ceiling(priority) - prompt_tokens, MAX_NEW_TOKENS_LIMIT]
    if quotas:
        limits.append(tenant.bucket_tokens - prompt_tokens)
    return min(limits)
