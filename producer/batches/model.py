"""A batch's shapes: OpenAI's object, its states, and what kvfleet keeps of it.

States move one way (`MOVES`), as OpenAI's do:

    validating -> in_progress -> finalizing -> completed | expired
         |             |
         +-> failed    +-> cancelling -> cancelled        (also from validating)
"""

from __future__ import annotations

import enum
import re
import secrets
from typing import Any, Literal, Optional

import msgspec


class BatchStatus(str, enum.Enum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        return self in (BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED)


#: Each state and the states it may be reached from.
MOVES: dict[BatchStatus, tuple[BatchStatus, ...]] = {
    BatchStatus.IN_PROGRESS: (BatchStatus.VALIDATING,),
    BatchStatus.FAILED: (BatchStatus.VALIDATING,),
    BatchStatus.FINALIZING: (BatchStatus.IN_PROGRESS,),
    BatchStatus.COMPLETED: (BatchStatus.FINALIZING,),
    BatchStatus.EXPIRED: (BatchStatus.FINALIZING,),
    BatchStatus.CANCELLING: (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS),
    BatchStatus.CANCELLED: (BatchStatus.CANCELLING,),
}


def new_batch_id() -> str:
    # Short enough that "<batch id>-<line>" is a valid job id (64 characters at most).
    return f"batch_{secrets.token_hex(12)}"


def line_job_id(batch_id: str, line: int) -> str:
    """The job of input line `line`: deterministic, so a driver that resumes a batch and
    submits a line again finds the job it already made instead of running it twice."""
    return f"{batch_id}-{line}"


_WINDOW = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def window_seconds(window: str) -> Optional[float]:
    """"24h" -> 86400.0 ("90m", "2d", "30s" too); None when it is no duration."""
    match = _WINDOW.match(window)
    return float(match.group(1)) * _UNIT_S[match.group(2)] if match else None


class BatchError(msgspec.Struct, frozen=True, omit_defaults=True):
    code: str
    message: str
    param: Optional[str] = None
    line: Optional[int] = None


class BatchErrors(msgspec.Struct, frozen=True):
    data: list[BatchError]
    object: Literal["list"] = "list"


class RequestCounts(msgspec.Struct, frozen=True):
    total: int = 0
    completed: int = 0
    failed: int = 0


class CreateBatch(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/batches`."""

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: Optional[dict[str, str]] = None


class BatchSpec(msgspec.Struct, frozen=True):
    """What a batch is, fixed at creation."""

    id: str
    tenant: str
    input_file_id: str
    endpoint: str
    completion_window: str
    created_at: int
    expires_at: int
    total: int  # requests (non-blank lines) in the input file
    last_line: int  # the line number of the last request: where submitting ends
    model: str
    metadata: Optional[dict[str, str]] = None


class Batch(msgspec.Struct, frozen=True):
    """OpenAI's batch object."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    request_counts: RequestCounts
    model: Optional[str] = None
    errors: Optional[BatchErrors] = None
    output_file_id: Optional[str] = None
    error_file_id: Optional[str] = None
    in_progress_at: Optional[int] = None
    expires_at: Optional[int] = None
    finalizing_at: Optional[int] = None
    completed_at: Optional[int] = None
    failed_at: Optional[int] = None
    expired_at: Optional[int] = None
    cancelling_at: Optional[int] = None
    cancelled_at: Optional[int] = None
    metadata: Optional[dict[str, Any]] = None
    object: Literal["batch"] = "batch"


class BatchList(msgspec.Struct, frozen=True):
    data: list[Batch]
    has_more: bool
    first_id: Optional[str] = None
    last_id: Optional[str] = None
    object: Literal["list"] = "list"
