"""Publishes each running job's new text to its Redis Stream (kvfleet/streams.py).

One thread per worker process. The engine's step thread only appends each new token to
its run's list (the callback `begin` returns is that list's `append`: O(1), never
blocks, never touches Redis, wakes nobody); every FLUSH_S, while some run is streamed, this thread takes each
streamed run's new tokens from its list, turns them into text (workers/detokenizer.py)
and writes one delta per job, for every job in one pipelined round trip. A slow or failing Redis
delays the stream, never the engine: errors are logged and the batch is dropped (the
job's result, which `follow` ends every stream with, still carries all of its text).

The runner, on the Celery task's thread, tells it when a run starts (`begin`) and ends
(`end`); `end` returns once the end is written (or failed, or timed out), so the runner
writes the result only after the stream's last text: a reader that sees the result
terminal finds the stream complete.

Only followed runs are written ("loud"; kvfleet/streams.py `follow` marks a job). Most
jobs nobody follows (batch work, clients that poll), and writing their text cost long
jobs about a tenth of the fleet's throughput (docs/benchmarks.md). A quiet run's tokens
are only appended to its list, which this thread never reads. Tokens used to be handed
to this thread through a queue, one put per token, and the thread woke for each batch of
them, taking the GIL from the step thread (py-spy showed the step thread waiting for it,
issue 16); what that cost could not be told apart from the fleet bench's noise on a
2-core machine (docs/benchmarks.md), but a hand-off per token is work the engine never
needed. Every FOLLOW_POLL_S this thread asks, in one round trip, whether any of its
quiet runs is followed now, and such a run turns loud: its `start`, then all its text
so far (its whole list) in one delta, then deltas as usual. A quiet run's `end` returns at once
(nothing to write; the follower of an unstreamed job is told from the hash). Whether a
run is loud is decided under a lock shared with `end`, so a run never turns loud after
its end was skipped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import redis

from kvfleet import streams
from kvfleet.constants import Keys
from kvfleet.contracts import JobError, JobState, Usage
from kvfleet.streams import StreamEvent
from kvfleet.tokenizer import Tokenizer
from workers.detokenizer import Detokenizer

log = logging.getLogger("kvfleet.worker")

#: How often streamed runs' new tokens are written, seconds: at one token per engine
#: step, a flush per step would be a round trip per token; 20 ms is below what a
#: reader notices and batches several steps of a small model. A streamed run's end is
#: written without this wait: the end holds up the job's result.
FLUSH_S = 0.02
#: The longest `end` waits for its write, seconds: a Redis that does not answer delays
#: a job's result by at most this (the result, not the stream, is the truth).
END_TIMEOUT_S = 5.0
#: How often quiet runs are checked for a follower, seconds: a client that starts
#: following a running job waits at most this for its first text. (One that follows
#: from the submission is seen when the run begins, by `JobStore.begin`.)
FOLLOW_POLL_S = 0.05


@dataclass(frozen=True)
class _Begin:
    job_id: str
    attempt: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    loud: bool  # followed when it began: write its stream from its start
    sink: list[int]  # the run's tokens, appended by the step thread


@dataclass(frozen=True)
class _End:
    job_id: str
    status: JobState
    text: Optional[str]  # the final text (done), whose rest is sent before the end
    finish_reason: Optional[str]
    usage: Optional[Usage]
    error: Optional[JobError]
    written: threading.Event
    loud: bool  # its stream was written: write its rest and its end


_Item = Union[_Begin, _End]


@dataclass
class _Run:
    """One job's run as this thread tracks it."""

    attempt: int
    detokenizer: Detokenizer
    loud: bool  # its stream is written (followed); a quiet run's sink is never read
    sink: list[int]  # every token of the run so far (the step thread appends)
    seen: int = 0  # how many of the sink's tokens were read
    tokens: list[int] = field(default_factory=list)  # read since the last delta
    text: str = ""  # safe to send, not sent yet

    def read(self) -> None:
        """Detokenize what came since the last read: one decode per job per flush. A
        slice of a list the step thread appends to is a consistent prefix of it (the
        GIL makes both atomic), so no token is read twice or skipped."""
        new = self.sink[self.seen:]
        if new:
            self.seen += len(new)
            self.tokens += new
            self.text += self.detokenizer.push(new)


class StreamPublisher:
    def __init__(self, client: redis.Redis, keys: Keys, tokenizer: Tokenizer, *, flush_s: float = FLUSH_S,
                 follow_poll_s: float = FOLLOW_POLL_S, every_run: bool = False) -> None:
        """`every_run`: write every run's stream, followed or not (for readers of the
        Redis streams that do not go through `follow`)."""
        self.client = client
        self.keys = keys
        self.tokenizer = tokenizer
        self.flush_s = flush_s
        self.follow_poll_s = follow_poll_s
        self.every_run = every_run
        self._queue: "queue.SimpleQueue[Optional[_Item]]" = queue.SimpleQueue()  # unbounded: put never blocks
        self._runs: dict[str, _Run] = {}  # only this thread touches it
        # Shared with the runners' threads: which runs are loud, and which quiet runs
        # have ended (never to turn loud). Touched only under the lock.
        self._lock = threading.Lock()
        self._loud: set[str] = set()
        self._quiet_ended: set[str] = set()
        self._next_poll = 0.0  # monotonic time of the next check for followers
        self._ended = threading.Event()  # a streamed run's end was queued: flush without waiting out flush_s
        self._thread = threading.Thread(target=self._loop, name="stream-publisher", daemon=True)

    def start(self) -> "StreamPublisher":
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued, then stop."""
        self._queue.put(None)
        self._ended.set()
        self._thread.join(timeout)

    # --- the runner's thread ------------------------------------------------------------

    def begin(self, job_id: str, attempt: int, *, followed: bool = True, stop: Sequence[str] = (),
              stop_token_ids: Sequence[int] = ()) -> Callable[[int], None]:
        """A run of the job starts; `attempt` is the job hash's count. Followed (or with
        `every_run`): its `start` event now; else quiet until a follower shows up.
        Returns the engine's per-token callback for the run (called on the step thread):
        the append of the run's token list, and nothing else."""
        loud = followed or self.every_run
        if loud:
            with self._lock:
                self._loud.add(job_id)
        sink: list[int] = []
        self._queue.put(_Begin(job_id, attempt, tuple(stop), tuple(stop_token_ids), loud, sink))
        return sink.append

    def end(self, job_id: str, status: JobState, *, text: Optional[str] = None, finish_reason: Optional[str] = None,
            usage: Optional[Usage] = None, error: Optional[JobError] = None, wait: bool = True) -> bool:
        """The run ended: send the rest of `text` (the job's final text) and the `end`
        event. With `wait`, returns once the write was tried (True; a failure is logged)
        or after END_TIMEOUT_S (False). A quiet run returns True at once: it has no
        stream to end."""
        with self._lock:
            loud = job_id in self._loud
            self._loud.discard(job_id)
            if not loud:
                self._quiet_ended.add(job_id)
        written = threading.Event()
        self._queue.put(_End(job_id, status, text, finish_reason, usage, error, written, loud))
        if not loud:
            return True
        self._ended.set()
        return written.wait(END_TIMEOUT_S) if wait else False

    # --- this thread --------------------------------------------------------------------

    def _loop(self) -> None:
        stopping = False
        while not stopping:
            items = self._drain(self._next_items())
            if items and not self._ended.is_set():
                # Only starts and quiet ends, which nobody waits for: let a few more
                # gather (a wake-up each would take the GIL from the step thread as
                # often), unless a streamed run's end arrives: its runner waits for it.
                self._ended.wait(self.flush_s)
            self._ended.clear()
            items = self._drain(items)
            stopping = None in items
            try:
                self._flush([item for item in items if item is not None])
            except Exception:  # noqa: BLE001 - a bug here must not end streaming for the process
                log.exception("stream publisher: flush failed")
        log.info("stream publisher stopped")

    def _next_items(self) -> list[Optional[_Item]]:
        """The next item, waiting for it: with streamed runs, no longer than flush_s (their
        new tokens are written then); with quiet ones only, no longer than the next check
        for followers (then no item: the flush does both)."""
        if any(run.loud for run in self._runs.values()):
            timeout = self.flush_s
        elif self._runs:
            timeout = max(self._next_poll - time.monotonic(), 0.001)
        else:
            return [self._queue.get()]
        try:
            return [self._queue.get(timeout=timeout)]
        except queue.Empty:
            return []

    def _drain(self, items: list[Optional[_Item]]) -> list[Optional[_Item]]:
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items

    def _flush(self, items: list[_Item]) -> None:
        out: list[tuple[str, StreamEvent]] = []  # in order per job: start, deltas, end
        ended: list[threading.Event] = []
        try:
            for item in items:
                if isinstance(item, _Begin):
                    self._runs[item.job_id] = _Run(item.attempt, Detokenizer(
                        self.tokenizer, stop=item.stop, stop_token_ids=item.stop_token_ids), item.loud, item.sink)
                    if item.loud:
                        out.append((item.job_id, StreamEvent(id="", kind=streams.START, attempt=item.attempt)))
                else:
                    ended.append(item.written)
                    out += self._end(item)
            out += self._check_followers()
            for job_id, run in self._runs.items():
                if not run.loud:
                    continue
                run.read()
                delta = self._delta(run)
                if delta is not None:
                    out.append((job_id, delta))
            if out:
                self._write(out)
        finally:
            for written in ended:
                written.set()

    def _check_followers(self) -> list[tuple[str, StreamEvent]]:
        """Every FOLLOW_POLL_S, turn the quiet runs a client now follows loud: the
        `start` of each (its text so far follows as its next delta)."""
        quiet = [job_id for job_id, run in self._runs.items() if not run.loud]
        now = time.monotonic()
        if not quiet or now < self._next_poll:
            return []
        self._next_poll = now + self.follow_poll_s
        try:
            marks = self.client.mget([self.keys.job_followed(job_id) for job_id in quiet])
        except redis.RedisError as exc:
            log.warning("stream publisher: follower check failed", extra={"error": str(exc)})
            return []
        out = []
        for job_id, mark in zip(quiet, marks):
            if mark is None:
                continue
            with self._lock:
                if job_id in self._quiet_ended:
                    continue  # its runner skipped the end already: it stays unstreamed
                self._loud.add(job_id)
            run = self._runs[job_id]
            run.loud = True
            out.append((job_id, StreamEvent(id="", kind=streams.START, attempt=run.attempt)))
        return out

    def _end(self, item: _End) -> list[tuple[str, StreamEvent]]:
        run = self._runs.pop(item.job_id, None)
        if not item.loud:
            with self._lock:
                self._quiet_ended.discard(item.job_id)
            return []  # never streamed: a follower is told from the hash
        if run is None:
            return []  # no `begin` for it: nothing was streamed, `follow` ends it from the hash
        run.read()
        if item.text is not None:
            run.text += run.detokenizer.finish(item.text)
        out = []
        delta = self._delta(run, final=True)
        if delta is not None:
            out.append((item.job_id, delta))
        out.append((item.job_id, StreamEvent(
            id="", kind=streams.END, attempt=run.attempt, status=item.status, finish_reason=item.finish_reason,
            usage=item.usage, error=item.error)))
        return out

    @staticmethod
    def _delta(run: _Run, *, final: bool = False) -> Optional[StreamEvent]:
        # Tokens whose text is held back wait for the delta that carries it; the last
        # one carries whatever is left.
        if not run.text and not (final and run.tokens):
            return None
        delta = StreamEvent(id="", kind=streams.DELTA, attempt=run.attempt, text=run.text, token_ids=run.tokens)
        run.text, run.tokens = "", []
        return delta

    def _write(self, out: list[tuple[str, StreamEvent]]) -> None:
        try:
            with self.client.pipeline(transaction=False) as pipe:
                by_job: dict[str, list[StreamEvent]] = {}
                for job_id, event in out:
                    by_job.setdefault(job_id, []).append(event)
                for job_id, events in by_job.items():
                    streams.append(pipe, self.keys, job_id, events)
                pipe.execute()
        except redis.RedisError as exc:
            # Dropped, not retried: a retry would reorder this batch after the next one.
            log.warning("stream publisher: Redis write failed", extra={"events": len(out), "error": str(exc)})
