"""The API's errors: one root, each class carrying its HTTP status.

Every refusal the API gives is an `ApiError` raised wherever the reason is found
(authentication, validation, admission, the queue); one handler (`producer/api.py`)
turns it into its answer with its status and headers, and counts it. A route never
builds an error response by hand. Every route answers in OpenAI's error shape, so one
client-side parser reads them all:

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}, ...extra}

`param` (the request field to fix) and `code` (a machine-readable reason) are recorded
where the reason is found; `type` follows from the status (`ERROR_TYPES`).
"""

from __future__ import annotations

import math
from typing import Any, Optional

#: Retry-After bounds, seconds: at least 1 (it is an integer), at most a minute (the
#: estimate is rough, and a client told to wait longer may as well poll again).
MIN_RETRY_S, MAX_RETRY_S = 1, 60


#: OpenAI's error `type` for each status (what its clients and docs use); others are
#: "server_error".
ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 409: "invalid_request_error",
               413: "invalid_request_error", 422: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 429: "rate_limit_error"}


class ApiError(Exception):
    """A request the API refuses; `message` says what to change."""

    status = 500

    def __init__(self, message: str, *, status: Optional[int] = None, retry_after_s: Optional[float] = None,
                 param: Optional[str] = None, code: Optional[str] = None, **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        self.retry_after_s = retry_after_s
        self.param = param  # the request field to fix, when one is to blame
        self.code = code  # machine-readable reason, e.g. "context_length_exceeded"
        self.extra = extra  # more fields of the native answer's body, e.g. the job_id

    @property
    def type(self) -> str:
        return ERROR_TYPES.get(self.status, "server_error")

    def body(self) -> dict[str, Any]:
        """The answer's JSON body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code},
                **self.extra}

    @property
    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(min(MAX_RETRY_S, max(MIN_RETRY_S, math.ceil(self.retry_after_s))))}


class BadRequest(ApiError):
    """The client's input cannot be run."""

    status = 422


class Unauthorized(ApiError):
    """No API key, or an unknown one."""

    status = 401


class Forbidden(ApiError):
    """The key or tenant may not do this."""

    status = 403


class NotFound(ApiError):
    """No such job for this tenant (another tenant's job answers exactly the same)."""

    status = 404


class Conflict(ApiError):
    """The request clashes with the job's state or owner."""

    status = 409


class Refused(ApiError):
    """Admission said no: over a ceiling (422), the quota bucket (413), quota or
    backlog (429, with Retry-After), or overload for bronze (503)."""


class QueueUnavailable(ApiError):
    """Kafka did not take the job; nothing will run."""

    status = 503


class StoreUnavailable(ApiError):
    """The state Redis failed before the job reached Kafka; nothing will run."""

    status = 503
