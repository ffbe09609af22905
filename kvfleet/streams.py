"""A job's generated text as it is produced: one bounded Redis Stream per job.

The one module that owns the format. Workers write (`append`, from workers/streaming.py);
the API reads (`follow`, relayed as server-sent events by producer/routes/streams.py and
the OpenAI routes). The job hash (kvfleet/jobstore.py) stays the truth; the stream is a
low-latency view of it, so `follow` ends every stream from the hash, and a stream that
lost entries (Redis errors on the worker, streaming turned off) still ends correctly.

Only followed jobs are streamed: `follow` marks the job (`Keys.job_followed`), and a
worker writes a job's stream from the moment it sees the mark, at the run's start or
within its poll, starting with the text so far. A job nobody follows costs its worker no
stream at all; one followed only after it ended is told from the hash, as above.

Entries, in the order a worker writes them for one run ("attempt") of a job:
    start (attempt n) · delta · delta · … · end (attempt n)
A job that is rerun (its worker died) gets a second `start` with attempt n + 1: its text
starts again from nothing. Each entry is `{"v": STREAM_VERSION, "e": <StreamEvent JSON>}`;
the event's id is the entry's id, assigned by Redis (writers leave it "").

Positions (`StreamEvent.id`, SSE's `id:` and `Last-Event-ID`, `follow(after=)`):
- a real entry: its Redis id, "1700000000000-0";
- an event `follow` made up from the job hash when the stream lacked it (see
  `_closing`): "<base>:<n>", the n-th made-up event after the real entry `base` ("0-0"
  when there was none). Made up only once the job is terminal, from the entries up to
  `base` and the hash, both of which no longer change: so following again from such a
  position makes up the same events and passes on those after the n-th.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Sequence

import msgspec
import redis
import redis.asyncio as aredis

from kvfleet import constants
from kvfleet.constants import Keys
from kvfleet.contracts import JobError, JobResult, JobState, Usage
from kvfleet.jobstore import result_from_hash

log = logging.getLogger("kvfleet.streams")

#: Bumped on any incompatible change to the entry format; readers skip other versions.
STREAM_VERSION = 1
START, DELTA, END = "start", "delta", "end"
#: Entries read per XREAD: a whole job's stream in a few round trips.
READ_COUNT = 512
#: How long a follower waits for the job hash to turn terminal once it saw an `end`
#: entry, seconds per try: the worker writes `end` just before the result (ms apart).
END_POLL_S = 0.05

_REAL_ID = re.compile(r"^\d+-\d+$")
_MADE_UP_ID = re.compile(r"^(\d+-\d+):(\d+)$")


class StreamEvent(msgspec.Struct, frozen=True):
    id: str  # resumable position: pass back as `after` (the SSE id / Last-Event-ID)
    kind: str  # "start" (an attempt began), "delta" (new text), "end" (the job is terminal)
    attempt: int  # 1, 2, ...; a "start" with attempt > 1: the job is rerun from scratch
    text: str = ""  # delta: new text; the deltas of one attempt concatenate to its final text
    #: delta: the token ids generated since the previous delta (its text may lag them:
    #: text that later tokens could still change is held back).
    token_ids: list[int] = []
    status: Optional[JobState] = None  # end: the terminal state
    finish_reason: Optional[str] = None  # end
    usage: Optional[Usage] = None  # end
    error: Optional[JobError] = None  # end, when failed / expired / cancelled / rejected


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(StreamEvent)


# --- the writer's side ---------------------------------------------------------------

def append(pipe: "redis.client.Pipeline", keys: Keys, job_id: str, events: Sequence[StreamEvent], *,
           maxlen: int = constants.STREAM_MAXLEN, ttl_s: int = constants.RESULT_TTL_S) -> None:
    """Queue on `pipe` the XADDs of `events` (in order) to the job's stream and its expiry.

    `maxlen` bounds the stream (approximately: Redis trims whole nodes, which is cheap);
    the expiry, renewed with every write, is the job's result TTL, so the stream goes
    when the job's record does."""
    key = keys.job_stream(job_id)
    for event in events:
        pipe.xadd(key, {"v": STREAM_VERSION, "e": _encoder.encode(event)}, maxlen=maxlen, approximate=True)
    pipe.expire(key, ttl_s)


def decode_entry(entry_id: str, fields: dict) -> Optional[StreamEvent]:
    """The event of one stream entry; None (logged) for an entry this build cannot read."""
    f = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
    try:
        version = int(f.get("v", b"0"))
        if version != STREAM_VERSION:
            raise ValueError(f"stream entry version {version}; this build reads v{STREAM_VERSION}")
        event = _decoder.decode(f["e"])
        if event.kind not in (START, DELTA, END):
            raise ValueError(f"unknown event kind {event.kind!r}")
    except (KeyError, ValueError, msgspec.DecodeError) as exc:  # msgspec's ValidationError is a DecodeError
        log.warning("skipping a malformed stream entry", extra={"entry_id": entry_id, "error": str(exc)})
        return None
    return msgspec.structs.replace(event, id=entry_id)


# --- the reader's side ---------------------------------------------------------------

def check_position(after: Optional[str]) -> None:
    """Raises ValueError unless `after` is None or a position `follow` gave out."""
    if after is not None and not (_REAL_ID.match(after) or _MADE_UP_ID.match(after)):
        raise ValueError(f"{after!r} is not a stream position (an event id, e.g. '1700000000000-0')")


@dataclass
class _Job:
    result: JobResult
    attempts: int  # runs started (the hash's `attempts`)


@dataclass
class _Progress:
    """What a follower has passed on: the attempt it follows and that attempt's text."""

    attempt: int = 0
    text: str = ""  # this attempt's deltas, concatenated
    tokens: int = 0  # token ids in this attempt's deltas
    last_id: str = "0-0"  # the last real entry read
    end: Optional[StreamEvent] = None  # this attempt's `end` entry, held until the hash is terminal

    def take(self, event: StreamEvent) -> bool:
        """Record an entry; True when it is to be passed on."""
        self.last_id = event.id
        if event.attempt < self.attempt:
            # A stalled worker that lost its lease still writing for its old attempt: the
            # job was rerun since, and its text is the rerun's, so this is noise.
            return False
        if event.attempt > self.attempt:
            # A new attempt (its start, or its first entry if writing the start failed):
            # the text starts again.
            self.attempt, self.text, self.tokens, self.end = event.attempt, "", 0, None
            if event.kind == START:
                return True
        if event.kind == DELTA:
            self.text += event.text
            self.tokens += len(event.token_ids)
            return True
        if event.kind == END:
            # Not passed on yet: the worker writes it *before* the result, and the result
            # may still be refused (its lease was lost): the hash, once terminal, decides.
            self.end = event
        return False  # an `end` held, or a second `start` of the same attempt


async def mark_followed(client: aredis.Redis, keys: Keys, job_id: str) -> None:
    """Ask the job's worker to write its stream: workers write followed jobs' streams
    only (workers/streaming.py). Seen when the run begins, or within the worker's poll if
    it runs already; `follow` calls it, and a streaming request before its job is queued."""
    await client.set(keys.job_followed(job_id), 1, ex=constants.RESULT_TTL_S)


async def follow(client: aredis.Redis, keys: Keys, job_id: str, *, after: Optional[str] = None,
                 poll_s: float = 1.0) -> AsyncIterator[StreamEvent]:
    """Every event of the job's stream after position `after` (None: from the beginning),
    then exactly one `end`, once the job is terminal; nothing for a job that does not
    exist (callers check ownership first). Blocks on XREAD for at most `poll_s` at a
    time, then looks at the job hash, so a job whose stream lacks entries (or has none)
    still ends within `poll_s` of its result.

    Raises ValueError for an `after` that is no position (see `check_position`)."""
    check_position(after)
    key = keys.job_stream(job_id)
    job = await _read_job(client, keys, job_id)
    if job is None:
        return
    if not job.result.status.terminal:
        await mark_followed(client, keys, job_id)
    progress = _Progress()
    made_up = _MADE_UP_ID.match(after) if after else None
    if after is not None:
        # Rebuild what the client was told up to `after` (the attempt, its text so far)
        # without telling it again: the end needs it to send only what is missing.
        await _replay(client, key, progress, made_up.group(1) if made_up else after)
    if made_up is not None and job.result.status.terminal:
        # The client stopped inside the closing events: they are made up again the same
        # way (same entries up to base, same terminal hash); pass on the rest.
        for event in _closing(job, progress)[int(made_up.group(2)):]:
            yield event
        return
    checked = time.monotonic()
    while True:
        wait_s = END_POLL_S if progress.end is not None else poll_s
        entries = await _read(client, key, progress.last_id, block_ms=max(int(wait_s * 1000), 1))
        for event in entries:
            if progress.take(event):
                yield event
        # The hash is read when the stream went quiet, when an `end` came, and at least
        # every poll_s (a stalled old attempt writing on must not hide the result).
        if entries and progress.end is None and time.monotonic() - checked < poll_s:
            continue
        checked = time.monotonic()
        job = await _read_job(client, keys, job_id)
        if job is None:
            return  # expired (or deleted) under us: there is nothing left to tell
        if not job.result.status.terminal:
            continue
        # Terminal. The worker wrote the job's last entries before the result, so they
        # are in the stream now: read them all before closing, or the close would make up
        # text that real entries still to be read also carry.
        while entries := await _read(client, key, progress.last_id, block_ms=None):
            for event in entries:
                if progress.take(event):
                    yield event
        closing = _closing(job, progress)
        ids = [event.id for event in closing]
        if after in ids:  # resumed at the real `end` itself: the client has it all
            closing = closing[ids.index(after) + 1:]
        for event in closing:
            yield event
        return


def _closing(job: _Job, progress: _Progress) -> list[StreamEvent]:
    """The events that end a terminal job's stream: made up from the hash where the
    stream lacks them (ids "<last real id>:<n>"), then the one `end`."""
    result, base = job.result, progress.last_id
    out: list[StreamEvent] = []

    def made_up(**fields: Any) -> StreamEvent:
        return StreamEvent(id=f"{base}:{len(out) + 1}", **fields)

    attempt, said, tokens = progress.attempt, progress.text, progress.tokens
    if job.attempts > attempt:
        # The stream never showed the attempt that produced the result (its start was
        # lost, or the worker does not stream): start it here, from nothing.
        attempt, said, tokens = job.attempts, "", 0
        out.append(made_up(kind=START, attempt=attempt))
    if result.text is not None:
        if result.text.startswith(said):
            rest = result.text[len(said):]
            if rest:  # the worker's last delta was lost (or never written)
                out.append(made_up(kind=DELTA, attempt=attempt, text=rest, token_ids=(result.tokens or [])[tokens:]))
        else:  # cannot happen with a worker of this build; text sent cannot be taken back
            log.warning("streamed text is not a prefix of the job's result", extra={"job_id": result.job_id})
    end = progress.end if progress.end is not None and progress.end.attempt == attempt else None
    # The hash's fields, always: the truth, whatever the worker wrote before it.
    out.append(StreamEvent(id=end.id if end is not None else f"{base}:{len(out) + 1}", kind=END, attempt=attempt,
                           status=result.status, finish_reason=result.finish_reason,
                           usage=result.usage if result.status is JobState.DONE else None, error=result.error))
    return out


async def _read(client: aredis.Redis, key: str, last_id: str, *, block_ms: Optional[int]) -> list[StreamEvent]:
    """The next entries after `last_id` (waiting up to `block_ms` for one; None: no wait),
    decoded; malformed ones come back as placeholders that only move the position."""
    response = await client.xread({key: last_id}, count=READ_COUNT, block=block_ms)
    events = []
    for _, entries in response or []:
        for raw_id, fields in entries:
            entry_id = raw_id.decode() if isinstance(raw_id, bytes) else raw_id
            event = decode_entry(entry_id, fields)
            # A skipped entry still moves the position on, or it would be read forever.
            events.append(event if event is not None else StreamEvent(id=entry_id, kind="", attempt=-1))
    return events


async def _replay(client: aredis.Redis, key: str, progress: _Progress, upto: str) -> None:
    """Take every entry up to and including `upto` into `progress`, passing none on."""
    start = "-"
    while True:
        entries = await client.xrange(key, min=start, max=upto, count=READ_COUNT)
        for raw_id, fields in entries:
            entry_id = raw_id.decode() if isinstance(raw_id, bytes) else raw_id
            event = decode_entry(entry_id, fields)
            progress.take(event if event is not None else StreamEvent(id=entry_id, kind="", attempt=-1))
        if len(entries) < READ_COUNT:
            break
        start = "(" + progress.last_id  # exclusive: the next page
    progress.last_id = upto  # a position past the end of the stream (trimmed, expired) still resumes after it


async def _read_job(client: aredis.Redis, keys: Keys, job_id: str) -> Optional[_Job]:
    fields = await client.hgetall(keys.job(job_id))
    result = result_from_hash(job_id, fields)
    if result is None:
        return None
    attempts = fields.get(b"attempts", fields.get("attempts", b"0"))
    return _Job(result, int(attempts))
