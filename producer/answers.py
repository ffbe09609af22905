"""The shapes of the API's own answers (not contracts between services: only HTTP
clients read them), as Structs so that `producer.openapi` documents them exactly."""

from __future__ import annotations

from typing import Optional

import msgspec

from kvfleet.contracts import JobState


class Accepted(msgspec.Struct, frozen=True):
    """`POST /v1/jobs`: the job's id, its state, and where to poll it."""

    job_id: str
    status: JobState
    url: str


class ErrorDetail(msgspec.Struct, frozen=True):
    """OpenAI's error object: what went wrong, and what to change."""

    message: str  # for a person: what to change
    type: str  # e.g. "invalid_request_error", "rate_limit_error" (producer.errors.ERROR_TYPES)
    param: Optional[str]  # the request field to fix, when one is to blame
    code: Optional[str]  # machine-readable reason, e.g. "context_length_exceeded"


class Error(msgspec.Struct, frozen=True):
    """Every refusal, on every route (`producer.errors.ApiError.body()`). Not closed:
    a native answer may add fields beside `error`, e.g. the `job_id`."""

    error: ErrorDetail


class Health(msgspec.Struct, frozen=True):
    """`GET /healthz`: the process answers."""

    status: str


class Readiness(msgspec.Struct, frozen=True):
    """`GET /readyz`: whether Kafka and Redis answer, each and together."""

    ready: bool
    redis: bool
    kafka: bool
