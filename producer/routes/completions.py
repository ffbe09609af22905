"""OpenAI's completions and chat completions, answered through the queue.

    POST /v1/completions        prompt (text or token ids)   -> text_completion
    POST /v1/chat/completions   messages, the model's template -> chat.completion

Each request becomes a kvfleet job (validated, admitted, produced to Kafka, run by a
worker), like `POST /v1/jobs`: the same tenants, keys, priorities, quotas and
idempotency (`job_id`, or an `Idempotency-Key` header). The answer waits for the job
(or streams it, `stream: true`); its `id` is the job id, so a client that lost the
connection finds the result at `GET /v1/jobs/{id}`.
"""

from __future__ import annotations

import time
from typing import Optional, Union

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from kvfleet.contracts import JobState, Priority
from kvfleet.tenancy import Tenant
from kvfleet.streams import follow, mark_followed
from producer import ratelimit
from producer.context import ApiContext, context
from producer.openai import relay, requests, responses
from producer.openai.schemas import (
    ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest,
)
from producer.openapi import body, error_response, response
from producer.submission import submit
from producer.validation import build_request_off_loop

router = APIRouter()

#: Seconds past a job's deadline an answer still waits: the scheduler or the worker
#: marks it expired at the deadline, and that takes a moment to reach us.
DEADLINE_GRACE_S = 10.0

_ERRORS = {
    400: error_response("Invalid input; `error.param` names the field and `error.message` the fix"),
    401: error_response("Missing or unknown API key"),
    403: error_response("The key's tenant differs from X-Tenant-ID, or the tenant is not configured"),
    404: error_response("No such model"),
    409: error_response("job_id taken by another tenant, or the job was cancelled"),
    413: error_response("Larger than the tenant's whole quota bucket"),
    422: error_response("Over the priority class's token ceiling"),
    429: error_response("Over quota, or the class's backlog is full; see Retry-After"),
    500: error_response("The job failed on its worker"),
    503: error_response("Kafka unavailable, the fleet overloaded (bronze), or the job passed its deadline"),
    504: error_response("The job is still running when the answer is due; GET /v1/jobs/{id} has it later"),
}
_STREAM = {"text/event-stream": {"schema": {"type": "string", "description": "server-sent events: chunks, "
                                                                             "then `data: [DONE]`"}}}


def _ok(type_: type, description: str) -> dict:
    entry = response(type_, description)
    entry.setdefault("content", {}).update(_STREAM)
    return entry


@router.post("/v1/completions", openapi_extra=body(CompletionRequest),
             responses={200: _ok(Completion, "The completion (or, with `stream`, its chunks)"), **_ERRORS})
async def completions(request: Request) -> Response:
    return await _answer(request, CompletionRequest)


@router.post("/v1/chat/completions", openapi_extra=body(ChatCompletionRequest),
             responses={200: _ok(ChatCompletion, "The chat completion (or, with `stream`, its chunks)"), **_ERRORS})
async def chat_completions(request: Request) -> Response:
    return await _answer(request, ChatCompletionRequest)


async def _answer(request: Request, kind: type[Union[CompletionRequest, ChatCompletionRequest]]) -> Response:
    ctx = context(request)
    tenant = ctx.tenant(request.headers)
    request.state.tenant = tenant  # for the rate-limit headers of an error answer too
    openai_request = requests.decode(await request.body(), kind)
    requests.check_model(openai_request, ctx.model)
    chat = isinstance(openai_request, ChatCompletionRequest)
    job_id = requests.job_id_of(openai_request, request.headers, tenant.name)
    priority = requests.priority_of(openai_request, request.headers.get("x-priority"))
    make = requests.chat_submit if chat else requests.completion_submit
    submission, names = make(openai_request, ctx.model, job_id,
                             default_max_tokens=lambda prompt: _default_max_tokens(ctx, tenant, priority, prompt))
    job = await build_request_off_loop(submission, ctx.model, tenant=tenant.name, priority=priority, now=time.time(),
                                       default_timeout_s=ctx.settings.api.default_timeout_s, names=names)
    if openai_request.stream:
        # Before the job is queued: its worker then streams it from the first token
        # (after, a fast fleet could begin the run first and stream it a poll later).
        await mark_followed(ctx.async_redis, ctx.settings.redis.keys, job.job_id)
    await submit(ctx, tenant, job, client_id=job_id is not None, output_field=names.max_new_tokens)
    headers = await ratelimit.headers(ctx, tenant)
    deadline = (job.deadline or time.time() + ctx.settings.api.default_timeout_s) + DEADLINE_GRACE_S
    fingerprint = await ctx.fingerprint()
    if openai_request.stream:
        chunks = relay.Chunks(job.job_id, int(job.submitted_at), ctx.model.name, fingerprint, chat=chat,
                              include_usage=bool(openai_request.stream_options
                                                 and openai_request.stream_options.include_usage))
        events = follow(ctx.async_redis, ctx.settings.redis.keys, job.job_id)
        return StreamingResponse(relay.relay(events, chunks, deadline=deadline), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    result = await _wait(ctx, job.job_id, deadline)
    if result is None or result.status is not JobState.DONE:
        raise responses.not_done(result) if result is not None else responses.JobNotDone(
            f"job {job.job_id} is gone", status=500, code="job_lost")
    if chat:
        answer: msgspec.Struct = responses.chat_completion(result, ctx.model.name, fingerprint,
                                                           _tier(openai_request))
    else:
        answer = responses.completion(result, ctx.model.name, fingerprint)
    return Response(msgspec.json.encode(answer), media_type="application/json", headers=headers)


async def _wait(ctx: ApiContext, job_id: str, deadline: float):
    """The job once terminal, or as it is at the deadline. Waiting holds no thread: it is
    a pub/sub wait on the event loop, however long the job queues."""
    while True:
        result = await ctx.wait_terminal(job_id, max(0.0, min(deadline - time.time(), 60.0)))
        if result is None or result.status.terminal or time.time() >= deadline:
            return result


def _default_max_tokens(ctx: ApiContext, tenant: Tenant, priority: Priority, prompt_tokens: int) -> int:
    """A chat request's output budget when it sets none: the setting, cut to what the
    context, the class's ceiling and (with quotas) the tenant's bucket leave."""
    limits = [ctx.settings.api.chat_max_tokens, ctx.model.max_context - prompt_tokens,
              ctx.settings.policy.ceiling(priority) - prompt_tokens]
    if ctx.gate.quotas is not None:
        limits.append(tenant.bucket_tokens - prompt_tokens)
    return min(limits)


def _tier(request: ChatCompletionRequest) -> Optional[str]:
    return request.service_tier
