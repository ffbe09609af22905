"""The step loop: one thread that owns the scheduler, the block manager, the sequences and
the model, and steps them while there is work.

    until the inbox says stop (sleeping in it while idle):
        admit new requests, fail cancelled ones, run calls     _admit
        schedule → run the model → postprocess (stop strings)  _step
        on_token callbacks, token times                        _after_step
        resolve what finished; publish the stats snapshot

A step that raises (the model, a block hook) fails the requests in flight and the loop
goes on; however the loop ends, every request still unresolved fails with EngineStopped.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from kvfleet import failpoints
from kvfleet.contracts import Completion
from kvfleet.tokenizer import Tokenizer
from workers.engine import metrics
from workers.engine.errors import EngineStopped, RequestCancelled, StepFailed
from workers.engine.inbox import Inbox, Work
from workers.engine.model_runner import ModelRunner
from workers.engine.scheduler import ScheduledBatch, Scheduler
from workers.engine.sequence import Sequence
from workers.engine.stats import EngineStats
from workers.engine.stops import StopWatch, cut_at_stop

log = logging.getLogger(__name__)


class CpuWait:
    """How long the calling thread has waited, ready to run, for a CPU core (the second
    field of Linux's /proc/thread-self/schedstat, in ns): a step's wall time beyond its
    CPU time is this (the machine's cores were busy) or a wait for the GIL (the worker's
    other threads held it). One pread of a file kept open: a few µs a step. 0 where the
    kernel does not report it."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def seconds(self) -> float:
        if self._fd is None:
            return 0.0
        try:
            return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            self.close()
            return 0.0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class StepLoop:
    def __init__(self, inbox: Inbox, scheduler: Scheduler, runner: ModelRunner, tokenizer: Tokenizer) -> None:
        self.inbox = inbox
        self.scheduler = scheduler
        self.block_manager = scheduler.block_manager
        self.runner = runner
        self.tokenizer = tokenizer
        self._watches: dict[str, StopWatch] = {}  # request id -> its stop strings, for requests that have some
        self._steps = self._tokens_computed = self._generated = self._last_batch = self._max_batch = 0
        self._published_queries = self._published_hits = 0
        self._step_faults = self._consecutive_faults = 0
        #: Replaced, never changed, after every step: any thread may read it.
        self.stats: EngineStats = self._snapshot()
        self._thread = threading.Thread(target=self._run, name="kvfleet-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        self._cpu_wait = CpuWait()  # opened here: it reads the thread that opens it
        try:
            while True:
                idle = self.scheduler.is_idle
                if idle:
                    self._publish_stats()  # cancellations may have freed blocks since the last step
                work = self.inbox.take(idle=idle)
                if work is None:
                    break
                self._admit(work)
                try:
                    self._step()
                    self._consecutive_faults = 0
                except Exception as e:  # the model or a hook failed: fail what is in flight, keep serving
                    self._step_faults += 1
                    self._consecutive_faults += 1
                    metrics.STEP_FAULTS.inc()
                    self._publish_stats()  # before the failures: a caller that sees one sees the count
                    self._fail_in_flight(e)
        finally:  # however the loop ends, no caller is left waiting
            self._cpu_wait.close()
            log.info("engine loop stopped")
            pending, calls = self.inbox.close()
            self._fail(pending, EngineStopped("the engine shut down before the request finished"))
            for _, future in calls:
                future.set_exception(EngineStopped("the engine shut down before the call ran"))

    def _admit(self, work: Work) -> None:
        for seq in work.new:
            self.scheduler.add(seq)
            if seq.stop:
                self._watches[seq.request_id] = StopWatch(seq.stop, self.tokenizer, start=seq.num_prompt_tokens)
        self._fail(work.cancelled, RequestCancelled("cancelled"))
        for fn, future in work.calls:
            try:
                future.set_result(fn())
            except Exception as e:  # the caller's error, delivered to the caller
                future.set_exception(e)

    def _step(self) -> None:
        guarded, preempted = self.scheduler.guarded_steps, self.scheduler.num_priority_preemptions
        batch = self.scheduler.schedule()
        metrics.PRIORITY_GUARDED_STEPS.inc(self.scheduler.guarded_steps - guarded)
        metrics.PRIORITY_PREEMPTIONS.inc(self.scheduler.num_priority_preemptions - preempted)
        if batch.seqs:  # empty only when the one running sequence preempted itself
            started, cpu_started, wait_started = time.perf_counter(), time.thread_time(), self._cpu_wait.seconds()
            failpoints.hit("engine.step")  # a fault injected by tests and chaos runs (kvfleet/failpoints.py)
            sampled = self.runner.run(batch)  # returns host tokens: the device is done
            elapsed = time.perf_counter() - started
            metrics.STEP_CPU_SECONDS.inc(time.thread_time() - cpu_started)
            metrics.STEP_CPU_WAIT_SECONDS.inc(max(0.0, self._cpu_wait.seconds() - wait_started))
            self.scheduler.step_cost.observe(batch.num_tokens, elapsed)
            metrics.STEP_SECONDS.observe(elapsed)
            drafted, accepted = self.scheduler.spec_draft_tokens, self.scheduler.spec_accepted_tokens
            finished = self.scheduler.postprocess(batch, sampled, self._hits_stop_string)
            metrics.SPEC_DRAFT_TOKENS.inc(self.scheduler.spec_draft_tokens - drafted)
            metrics.SPEC_ACCEPTED_TOKENS.inc(self.scheduler.spec_accepted_tokens - accepted)
            self._after_step(batch, sampled, finished)
        self._publish_stats()

    def _hits_stop_string(self, seq: Sequence) -> bool:
        """Called by postprocess after each token it appends to a sequence."""
        watch = self._watches.get(seq.request_id)
        return watch is not None and watch.update(seq.token_ids)

    def _after_step(self, batch: ScheduledBatch, sampled: list[list[int]], finished: list[Sequence]) -> None:
        now = time.time()
        new_tokens = 0
        for seq, tokens in zip(batch.seqs, sampled):
            if not tokens:
                continue
            new_tokens += len(tokens)  # more than one when drafts were accepted
            if seq.on_token is not None:
                for token in tokens:
                    self._tell(seq, token)
            if seq.first_token_at is None:
                seq.first_token_at = now
                metrics.TIME_TO_FIRST_TOKEN.observe(now - seq.submitted_at)
        for seq in finished:
            seq.finished_at = now
            if seq.num_completion_tokens > 1:
                metrics.TIME_PER_OUTPUT_TOKEN.observe((now - seq.first_token_at) / (seq.num_completion_tokens - 1))
            self._resolve(seq, completion=self._completion(seq))
        self._steps += 1
        self._tokens_computed += batch.num_tokens
        self._generated += new_tokens
        self._last_batch = len(batch.seqs)
        metrics.BATCH_SIZE.observe(self._last_batch)
        self._max_batch = max(self._max_batch, self._last_batch)
        metrics.GENERATED_TOKENS.inc(new_tokens)

    def _tell(self, seq: Sequence, token: int) -> None:
        # The callback is the caller's code on our thread: its failure must cost its
        # request a streamed token at most, never the step (and the batch) it came from.
        try:
            seq.on_token(token)
        except Exception:  # noqa: BLE001
            log.exception("on_token callback failed", extra={"request_id": seq.request_id})

    def _completion(self, seq: Sequence) -> Completion:
        # The whole completion decoded once, at the end: the stop string (wherever it ended
        # up, also when EOS or length ended the request first) and what follows it are
        # cut from the text; the tokens stay.
        text = self.tokenizer.decode(seq.text_token_ids)
        cut = cut_at_stop(text, seq.stop) if seq.stop else None
        text, reason = (text, seq.finish_reason) if cut is None else (cut, "stop")
        return Completion(text=text, tokens=seq.completion_token_ids, finish_reason=reason,
                          prompt_tokens=seq.num_prompt_tokens, cached_tokens=seq.num_cached_tokens,
                          started_at=seq.started_at, first_token_at=seq.first_token_at,
                          finished_at=seq.finished_at, submitted_at=seq.submitted_at)

    def _fail_in_flight(self, cause: Exception) -> None:
        """Every request the scheduler has taken, wherever the failed step left it."""
        seqs = self.inbox.taken()
        log.error("engine step failed; failing %d requests", len(seqs), exc_info=cause)
        error = StepFailed(f"engine step failed: {cause!r}")
        error.__cause__ = cause
        self._fail(seqs, error)

    def _fail(self, seqs: list[Sequence], error: Exception) -> None:
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "aborted")
            self._resolve(seq, error=error)

    def _resolve(self, seq: Sequence, *, completion: Completion | None = None, error: Exception | None = None) -> None:
        self._watches.pop(seq.request_id, None)
        self.inbox.resolve(seq, completion=completion, error=error)

    def _publish_stats(self) -> None:
        s = self.stats = self._snapshot()
        metrics.RUNNING_SEQUENCES.set(s.running)
        metrics.WAITING_SEQUENCES.set(s.waiting)
        metrics.KV_BLOCKS_USED.set(s.blocks_used)
        metrics.KV_BLOCKS_FREE.set(s.blocks_free)
        metrics.PREFIX_CACHE_QUERIES.inc(s.prefix_cache_queries - self._published_queries)
        metrics.PREFIX_CACHE_HITS.inc(s.prefix_cache_hits - self._published_hits)
        self._published_queries, self._published_hits = s.prefix_cache_queries, s.prefix_cache_hits

    def _snapshot(self) -> EngineStats:
        bm, sch = self.block_manager, self.scheduler
        return EngineStats(
            running=len(sch.running), waiting=len(sch.waiting),
            blocks_total=bm.num_blocks, blocks_used=bm.num_blocks - bm.num_free_blocks,
            blocks_free=bm.num_free_blocks, block_size=bm.block_size,
            capacity_tokens=bm.num_blocks * bm.block_size,
            tokens_in_use=sum(s.num_tokens for s in sch.running),
            prefix_cache_queries=bm.cache_queries, prefix_cache_hits=bm.cache_hits,
            outside_cache_hits=bm.outside_hits,
            prompt_tokens_computed=sch.prompt_tokens_computed, prompt_tokens_cached=sch.prompt_tokens_cached,
            tokens_computed=self._tokens_computed, generated_tokens=self._generated,
            preemptions=sch.num_preemptions, steps=self._steps,
            last_batch_size=self._last_batch, max_batch_size=self._max_batch,
            step_faults=self._step_faults, consecutive_step_faults=self._consecutive_faults,
            spec_draft_tokens=sch.spec_draft_tokens, spec_accepted_tokens=sch.spec_accepted_tokens,
        )
