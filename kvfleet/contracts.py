"""The wire contracts of kvfleet: every message that crosses a process boundary.

One module, one schema version. Every message travels as JSON of these Structs: on
Kafka (readable with any Kafka tool), in Celery tasks and in Redis. Nothing is ever
pickled.

Decoding is validation: `decode_request()` raises `msgspec.ValidationError` with a
path-qualified message ("Expected `int`, got `str` - at `$.max_new_tokens`") that the
HTTP API returns unchanged and the scheduler puts into the dead-letter headers.
"""

from __future__ import annotations

import enum
import time
import uuid
from typing import Annotated, Optional

import msgspec

#: Bumped on any incompatible change to a Struct below. Readers reject other versions.
SCHEMA_VERSION = 1


class Priority(str, enum.Enum):
    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"

    @property
    def rank(self) -> int:
        """0 is served first."""
        return _PRIORITY_RANK[self]


_PRIORITY_RANK = {Priority.HIGH: 0, Priority.NORMAL: 1, Priority.LOW: 2}


class JobState(str, enum.Enum):
    QUEUED = "queued"
    ADMITTED = "admitted"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"
    REJECTED = "rejected"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset(
    {JobState.DONE, JobState.FAILED, JobState.EXPIRED, JobState.REJECTED, JobState.CANCELLED}
)

#: States move one way only. A transition not listed here is refused by the job store,
#: which is what makes duplicate deliveries harmless: a second "done" finds "done".
ALLOWED_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset(
        {JobState.ADMITTED, JobState.REJECTED, JobState.EXPIRED, JobState.CANCELLED, JobState.FAILED}
    ),
    JobState.ADMITTED: frozenset(
        {JobState.RUNNING, JobState.EXPIRED, JobState.CANCELLED, JobState.FAILED}
    ),
    JobState.RUNNING: frozenset({JobState.DONE, JobState.FAILED, JobState.EXPIRED, JobState.CANCELLED}),
    JobState.DONE: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.EXPIRED: frozenset(),
    JobState.REJECTED: frozenset(),
    JobState.CANCELLED: frozenset(),
}

# Bounds checked by msgspec at decode time; the model's own limits (context length,
# vocabulary) are checked where the model is known (`validate_against_model`).
MAX_NEW_TOKENS_LIMIT = 4096
MAX_PROMPT_CHARS = 200_000
JobId = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
TenantId = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
#: A name Kafka accepts for a topic: its legal characters, at most 249 of them, and
#: neither "." nor "..".
KafkaTopic = Annotated[str, msgspec.Meta(pattern=r"^(?!\.{1,2}$)[A-Za-z0-9._-]{1,249}$")]


class Sampling(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-request sampling. temperature 0 means greedy (seed ignored)."""

    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=5.0)] = 0.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 0  # 0 = no top-k cut
    seed: Optional[Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]] = None
    stop: Annotated[list[Annotated[str, msgspec.Meta(min_length=1, max_length=256)]], msgspec.Meta(max_length=8)] = []
    #: Token ids that end generation besides the model's EOS (a chat template's
    #: end-of-turn token); the stopping token is not part of the text.
    stop_token_ids: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=8)] = []
    #: Answer from the exact-match result cache if the identical request ran before
    #: (greedy or seeded only, and only for a tenant with `result_cache`): the same
    #: output, without running the model.
    cache: bool = False
    #: Speculative decoding (prompt-lookup drafts the model verifies): the same output,
    #: sooner when it repeats the prompt. None: the worker's KVFLEET_ENGINE_SPECULATE.
    speculative: Optional[bool] = None


class SubmitRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a client sends to `POST /v1/jobs` (tenant and priority may also come from headers)."""

    prompt: Optional[Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PROMPT_CHARS)]] = None
    prompt_tokens: Optional[Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(min_length=1)]] = None
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_NEW_TOKENS_LIMIT)] = 64
    priority: Optional[Priority] = None
    tenant: Optional[TenantId] = None
    model: Optional[Annotated[str, msgspec.Meta(min_length=1, max_length=128)]] = None
    sampling: Sampling = Sampling()
    job_id: Optional[JobId] = None
    #: Seconds from submission after which the job is no longer worth running.
    timeout_s: Optional[Annotated[float, msgspec.Meta(gt=0, le=7 * 24 * 3600)]] = None


class JobRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A job as it travels on Kafka (JSON) and to the workers (Celery, JSON)."""

    job_id: JobId
    tenant: TenantId
    priority: Priority
    model: str
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_NEW_TOKENS_LIMIT)]
    submitted_at: float  # unix seconds
    deadline: Optional[float] = None  # unix seconds; None = no deadline
    #: A text prompt. The API sends none: it tokenizes a text prompt once, with the served
    #: model's tokenizer, and sends `prompt_tokens` instead, so neither the scheduler nor
    #: the worker tokenizes again. A job produced straight to Kafka may carry text; the
    #: scheduler then tokenizes it, once, before it reserves and sends it.
    prompt: Optional[str] = None
    #: The prompt as the served model's token ids: what the job's cost and its run use.
    prompt_tokens: Optional[list[int]] = None
    sampling: Sampling = Sampling()
    #: Read, never written: producers before tokenized prompts sent the text prompt's
    #: length here. It is ignored (the length is `len(prompt_tokens)` once tokenized),
    #: and kept so that their v1 messages still decode.
    prompt_len: Optional[Annotated[int, msgspec.Meta(ge=0)]] = None
    #: Kafka request/reply: the topic the job's terminal JobResult is produced to
    #: (kvfleet/results.py) instead of `<prefix>.results`. Set by a client producing
    #: straight to Kafka; the topic must exist before the job ends (kvfleet creates no
    #: topic a client names). The API sets none: HTTP clients poll or stream.
    reply_to: Optional[KafkaTopic] = None
    v: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.v != SCHEMA_VERSION:
            raise msgspec.ValidationError(f"unsupported schema version {self.v}; this build reads v{SCHEMA_VERSION}")
        if (self.prompt is None) == (self.prompt_tokens is None):
            raise msgspec.ValidationError("exactly one of `prompt` or `prompt_tokens` must be given")

    @property
    def cost(self) -> int:
        """KV tokens the job can hold at its peak (see `token_cost`); needs `prompt_tokens`."""
        if self.prompt_tokens is None:
            raise ValueError(f"job {self.job_id!r} has a text prompt: tokenize it before costing it")
        return token_cost(len(self.prompt_tokens), self.max_new_tokens)


def token_cost(prompt_tokens: int, max_new_tokens: int) -> int:
    """KV tokens a job can hold at its peak, its prompt and every token it may generate:
    what the ledger reserves, the ceilings bound and the quota charges."""
    return prompt_tokens + max_new_tokens


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the KV cache instead of prefilled


class Timings(msgspec.Struct, frozen=True):
    """Unix seconds; None until that moment happened."""

    queued_at: Optional[float] = None
    admitted_at: Optional[float] = None
    started_at: Optional[float] = None
    first_token_at: Optional[float] = None
    finished_at: Optional[float] = None


class JobError(msgspec.Struct, frozen=True):
    code: str  # machine-readable, e.g. "prompt_too_long", "worker_error", "deadline_passed"
    message: str  # for a person: what happened and what to change


class JobResult(msgspec.Struct, frozen=True):
    """What `GET /v1/jobs/{id}` returns, and what the job store keeps."""

    job_id: str
    status: JobState
    tenant: str
    priority: Priority
    text: Optional[str] = None
    tokens: Optional[list[int]] = None
    finish_reason: Optional[str] = None  # "length" | "stop" | "eos"
    usage: Usage = Usage()
    timings: Timings = Timings()
    error: Optional[JobError] = None
    #: The worker that started its last run (None until one did): which replica served it.
    worker: Optional[str] = None
    #: Runs started so far, this one included (0 until a worker started it). Above 1
    #: the job was run again: its worker died, drained, or its engine faulted.
    attempt: int = 0
    #: Served from the exact-match result cache (`sampling.cache`): the model did not run.
    from_cache: bool = False
    v: int = SCHEMA_VERSION


class Completion(msgspec.Struct, frozen=True):
    """What a worker's engine returns for one job; the worker turns it into a JobResult."""

    text: str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    started_at: float
    first_token_at: Optional[float]
    finished_at: float
    #: When the engine took the request in (before its first step): started_at minus
    #: this is the wait for a step boundary and a place in the batch.
    submitted_at: Optional[float] = None


# --- encoders / decoders: built once, reused (msgspec caches the type plan in them) ---

_json_encoder = msgspec.json.Encoder()
_request_decoder = msgspec.json.Decoder(JobRequest)
_submit_decoder = msgspec.json.Decoder(SubmitRequest)
_result_decoder = msgspec.json.Decoder(JobResult)


def encode(obj: msgspec.Struct) -> bytes:
    return _json_encoder.encode(obj)


def decode_request(data: bytes | str) -> JobRequest:
    return _request_decoder.decode(data)


def decode_submit(data: bytes | str) -> SubmitRequest:
    return _submit_decoder.decode(data)


def decode_result(data: bytes | str) -> JobResult:
    return _result_decoder.decode(data)


def to_builtins(obj: msgspec.Struct) -> dict:
    """For Celery's JSON serializer, which takes plain dicts."""
    return msgspec.to_builtins(obj)


def request_from_builtins(obj: dict) -> JobRequest:
    return msgspec.convert(obj, JobRequest)


def new_job_id() -> str:
    """A time-ordered id (UUIDv7 layout: 48-bit ms timestamp + random) so ids sort by age."""
    ms = int(time.time() * 1000)
    rand = uuid.uuid4().int & ((1 << 74) - 1)
    value = (ms << 80) | (0x7 << 76) | ((rand >> 62) << 64) | (0b10 << 62) | (rand & ((1 << 62) - 1))
    return str(uuid.UUID(int=value))


class WorkerHeartbeat(msgspec.Struct, frozen=True):
    """What each worker process publishes under `Keys.worker(id)` with a short TTL.

    The scheduler sums `capacity_tokens` and `slots` over live heartbeats to know the
    fleet's budget in KV tokens and in jobs; a worker that stops heartbeating drops out when its key expires. (Fields
    that older workers also sent are ignored when read.)
    """

    worker_id: str
    capacity_tokens: int  # KV tokens the worker's block pool holds
    #: Jobs it runs at once (its Celery task threads); 0 from older workers: unknown.
    slots: int = 0
    #: The most jobs one Celery message to it may carry (workers/tasks.py); 1 from older
    #: workers, which know only the one-job task, so a scheduler never packs for them.
    jobs_per_message: int = 1
    #: The served model's name (what clients put in `model`) and its weights'
    #: fingerprint: `GET /v1/models` lists these. Empty from older workers.
    model: str = ""
    fingerprint: str = ""
    started_at: float = 0.0  # unix seconds the worker started
    v: int = SCHEMA_VERSION
