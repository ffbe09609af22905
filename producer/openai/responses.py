"""A finished job -> OpenAI's answer; a job that did not finish -> the error to answer.

The answer's `id` is the job id, so `GET /v1/jobs/{id}` finds the same job, and
`created` is when the job was submitted.
"""

from __future__ import annotations

from typing import Optional

from kvfleet.contracts import JobResult, JobState
from producer.errors import ApiError
from producer.openai.schemas import (
    ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatMessage, ChoiceDelta, Completion,
    CompletionChoice, CompletionUsage, PromptTokensDetails,
)

#: kvfleet's finish reasons -> OpenAI's: EOS and a chat template's end-of-turn token are
#: both the model stopping on its own ("stop"), as are stop strings.
FINISH_REASONS = {"stop": "stop", "eos": "stop", "length": "length"}


def finish_reason(reason: Optional[str]) -> Optional[str]:
    return FINISH_REASONS.get(reason or "", "stop" if reason else None)


def usage(result: JobResult) -> CompletionUsage:
    u = result.usage
    return CompletionUsage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                           total_tokens=u.prompt_tokens + u.completion_tokens,
                           prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_tokens))


def created(result: JobResult) -> int:
    return int(result.timings.queued_at or 0)


def completion(result: JobResult, model: str, fingerprint: Optional[str]) -> Completion:
    return Completion(id=result.job_id, created=created(result), model=model, system_fingerprint=fingerprint,
                      choices=[CompletionChoice(index=0, text=result.text or "",
                                                finish_reason=finish_reason(result.finish_reason))],
                      usage=usage(result))


def chat_completion(result: JobResult, model: str, fingerprint: Optional[str], service_tier: Optional[str],
                    ) -> ChatCompletion:
    return ChatCompletion(id=result.job_id, created=created(result), model=model, system_fingerprint=fingerprint,
                          service_tier=service_tier,
                          choices=[ChatChoice(index=0, message=ChatMessage(content=result.text or ""),
                                              finish_reason=finish_reason(result.finish_reason))],
                          usage=usage(result))


def completion_chunk(job_id: str, created_at: int, model: str, fingerprint: Optional[str], *, text: str = "",
                     reason: Optional[str] = None, usage_: Optional[CompletionUsage] = None,
                     final_usage: bool = False) -> Completion:
    choices = [] if final_usage else [CompletionChoice(index=0, text=text, finish_reason=finish_reason(reason))]
    return Completion(id=job_id, created=created_at, model=model, system_fingerprint=fingerprint, choices=choices,
                      usage=usage_)


def chat_chunk(job_id: str, created_at: int, model: str, fingerprint: Optional[str], *,
               delta: ChoiceDelta = ChoiceDelta(), reason: Optional[str] = None,
               usage_: Optional[CompletionUsage] = None, final_usage: bool = False) -> ChatCompletionChunk:
    choices = [] if final_usage else [ChatChunkChoice(index=0, delta=delta, finish_reason=finish_reason(reason))]
    return ChatCompletionChunk(id=job_id, created=created_at, model=model, system_fingerprint=fingerprint,
                               choices=choices, usage=usage_)


class JobNotDone(ApiError):
    """The job ended without a completion, or is still going when the answer is due."""


def not_done(result: JobResult) -> JobNotDone:
    """The error that answers a job that is not `done`. Its id is in the message and the
    body (`job_id`), so a client can still follow it with GET /v1/jobs/{id}."""
    job_id, error = result.job_id, result.error
    reason = f"{error.message} ({error.code})" if error else result.status.value
    if result.status is JobState.CANCELLED:
        return JobNotDone(f"job {job_id} was cancelled: {reason}", status=409, code="cancelled", job_id=job_id)
    if result.status is JobState.EXPIRED:
        return JobNotDone(f"job {job_id} passed its deadline before it finished: {reason}; retry, with a larger "
                          "`timeout_s` or a higher `service_tier`", status=503, code="deadline_passed",
                          retry_after_s=1, job_id=job_id)
    if result.status is JobState.REJECTED:
        code = error.code if error else "rejected"
        return JobNotDone(f"job {job_id} was not run: {reason}", status=503 if code == "overloaded" else 400,
                          code=code, job_id=job_id)
    if result.status is JobState.FAILED:
        code = error.code if error else "failed"
        # The engine refusing the input is the client's to fix; anything else is ours.
        return JobNotDone(f"job {job_id} failed: {reason}", status=400 if code == "invalid_request" else 500,
                          code=code, job_id=job_id)
    return JobNotDone(f"job {job_id} is still {result.status.value} after the longest wait this API gives; "
                      f"its result will be at GET /v1/jobs/{job_id}", status=504, code="still_running",
                      job_id=job_id)
