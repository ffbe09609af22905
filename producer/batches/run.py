"""One batch, from validating to its output files, driven by whoever holds its lease.

    run():  validating -> in_progress
            submit the input a window at a time, track the jobs, persist progress
            -> finalizing (all lines ended, or the window expired) or cancelling (client)
            write the output and error files -> completed | expired | cancelled

What makes a restart (of any service) safe:
- Each line's job id is `<batch id>-<line>` and is submitted with `client_id=True`: a
  line submitted again finds its job (the submit path answers the existing job before
  any check, so the quota is not charged twice) and never runs twice.
- The cursor (byte offset, line) is persisted after a whole window is submitted; a
  new driver resumes at it and submits the window in flight again (found, not rerun).
- Counts are recomputed from the jobs' states on a takeover, so they never drift.
- The output is regenerated whole from the jobs' states if finalizing is interrupted.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Union

import anyio
import msgspec

from kvfleet.constants import RESULT_TTL_S
from kvfleet.contracts import JobRequest, JobState
from kvfleet.tenancy import Tenant
from producer.batches.model import BatchStatus, line_job_id
from producer.batches.output import write_outputs
from producer.batches.store import BatchState, BatchStore, LineFailure
from producer.context import ApiContext
from producer.errors import ApiError
from producer.files import lines as batch_lines
from producer.files.index import FileIndex
from producer.files.store import FileMissing, FileStore
from producer.submission import submit

log = logging.getLogger("kvfleet.batch")

#: Seconds between looks at the batch's jobs while they run.
TICK_S = 0.5
#: Seconds between looks for room while the batch has `max_in_flight` jobs out.
ROOM_POLL_S = 0.1
#: Longest single wait before a refused submission is tried again, seconds: short, so
#: a cancel or the window's end is noticed soon even under a long Retry-After.
MAX_RETRY_WAIT_S = 5.0


class LeaseLost(Exception):
    """Another driver holds the batch now; this one stops touching it."""


class _Stop(Exception):
    """The batch left in_progress (cancelled, expired) while a window was submitted."""


class BatchRun:
    def __init__(self, ctx: ApiContext, batches: BatchStore, files: FileStore, index: FileIndex, batch_id: str,
                 still_ours: Callable[[], bool]) -> None:
        """`still_ours()`: whether this driver still holds the batch's lease (a Redis call)."""
        self.ctx, self.batches, self.files, self.index = ctx, batches, files, index
        self.batch_id = batch_id
        self.still_ours = still_ours
        self.pending: list[int] = []  # lines whose jobs are submitted and not ended
        self.completed = 0
        self.failed = 0

    async def run(self) -> None:
        state = await self._load()
        if state is None:
            await anyio.to_thread.run_sync(self.batches.forget, self.batch_id)
            return
        if state.status is BatchStatus.VALIDATING:
            await self._start(state)
        state = await self._load()
        if state is not None and state.status is BatchStatus.IN_PROGRESS:
            await self._drive(state)
        state = await self._load()
        if state is not None and state.status in (BatchStatus.FINALIZING, BatchStatus.CANCELLING):
            await self._finish(state)

    async def _load(self) -> Optional[BatchState]:
        return await anyio.to_thread.run_sync(self.batches.load, self.batch_id)

    async def _check(self) -> None:
        if not await anyio.to_thread.run_sync(self.still_ours):
            raise LeaseLost(self.batch_id)

    # --- validating -> in_progress ------------------------------------------------------

    async def _start(self, state: BatchState) -> None:
        """Every line was checked on upload; what is left is that the file is still there."""
        try:
            (await anyio.to_thread.run_sync(self.files.open, state.spec.input_file_id)).close()
        except FileMissing:
            errors = msgspec.json.encode({"object": "list", "data": [{
                "code": "file_not_found", "message": f"the input file {state.spec.input_file_id} is gone "
                                                     "(deleted or expired); upload it again"}]}).decode()
            await anyio.to_thread.run_sync(lambda: self.batches.move(
                self.batch_id, BatchStatus.FAILED, now=time.time(), errors=errors))
            return
        await anyio.to_thread.run_sync(lambda: self.batches.move(
            self.batch_id, BatchStatus.IN_PROGRESS, now=time.time(), completed=0, failed=0))
        log.info("batch started", extra={"batch_id": self.batch_id, "lines": state.spec.total})

    # --- in_progress --------------------------------------------------------------------

    async def _drive(self, state: BatchState) -> None:
        spec = state.spec
        tenant = self.ctx.tenancy.get(spec.tenant)
        offset, line = state.cursor
        await anyio.to_thread.run_sync(self._recount, spec.input_file_id, offset)
        while True:
            await self._check()
            state = await self._load()
            if state is None or state.status is not BatchStatus.IN_PROGRESS:
                return  # cancelled: _finish takes it from here
            if time.time() >= spec.expires_at:
                await self._end(BatchStatus.EXPIRED)
                return
            if line < spec.last_line and tenant is not None:
                window, next_offset, next_line = await anyio.to_thread.run_sync(
                    self._read_window, spec.input_file_id, offset, line, tenant, spec.expires_at)
                try:
                    await self._submit_window(window, tenant, spec.expires_at)
                except _Stop:
                    return
                offset, line = next_offset, next_line
                await anyio.to_thread.run_sync(lambda: self.batches.progress(
                    self.batch_id, cursor_offset=offset, cursor_line=line, completed=self.completed,
                    failed=self.failed))
                continue
            await anyio.to_thread.run_sync(self._refresh, spec.expires_at)
            if line >= spec.last_line and not self.pending:
                await self._end(BatchStatus.COMPLETED)
                return
            await anyio.sleep(TICK_S)

    def _recount(self, file_id: str, upto: int) -> None:
        """Counts and pending lines from the jobs' states, for the lines before the
        cursor (a takeover; on a fresh start there are none)."""
        failures = self.batches.line_failures(self.batch_id)
        numbers: list[int] = []
        with self.files.open(file_id) as f:
            for item in batch_lines.read_lines(f):
                if item.end > upto:
                    break
                numbers.append(item.number)
        self.failed = sum(1 for n in numbers if n in failures)
        self.pending = [n for n in numbers if n not in failures]
        self._refresh(None)

    def _read_window(self, file_id: str, offset: int, line: int, tenant: Tenant, deadline: float,
                     ) -> tuple[list[tuple[int, Union[JobRequest, LineFailure]]], int, int]:
        """The next `order_window` lines as jobs (or failures), sorted by prompt so lines
        sharing a prefix run together (one prefill of a shared system prompt, then KV
        blocks reused); and where the window ends."""
        out: list[tuple[int, Union[JobRequest, LineFailure]]] = []
        now = time.time()
        with self.files.open(file_id) as f:
            for item in batch_lines.read_lines(f, offset=offset, number=line):
                try:
                    parsed = batch_lines.parse(item)
                    job = batch_lines.build_job(parsed, item.number, model=self.ctx.model,
                                                settings=self.ctx.settings, tenant=tenant,
                                                job_id=line_job_id(self.batch_id, item.number), now=now,
                                                deadline=deadline, quotas=self.ctx.gate.quotas is not None)
                    out.append((item.number, job))
                except batch_lines.LineError as exc:
                    # Upload checked every line, so this is the model or the settings
                    # having changed since: the line fails, the batch goes on.
                    out.append((item.number, LineFailure(400, {"error": {
                        "message": exc.message, "type": "invalid_request_error", "param": exc.param,
                        "code": exc.code}})))
                offset, line = item.end, item.number
                if len(out) >= self.ctx.settings.batch.order_window:
                    break
        out.sort(key=lambda entry: entry[1].prompt_tokens if isinstance(entry[1], JobRequest) else [])
        return out, offset, line

    async def _submit_window(self, window, tenant: Tenant, deadline: float) -> None:
        for number, job in window:
            await self._wait_for_room(deadline)
            failure = job if isinstance(job, LineFailure) else await self._submit(job, tenant, deadline)
            if failure is None:
                self.pending.append(number)
            else:
                await anyio.to_thread.run_sync(self.batches.fail_line, self.batch_id, number, failure)
                self.failed += 1

    async def _wait_for_room(self, deadline: float) -> None:
        """Hold the next line until fewer than `max_in_flight` of the batch's jobs are
        queued or running: the bound holds line by line, not just per window."""
        while len(self.pending) >= self.ctx.settings.batch.max_in_flight:
            await anyio.sleep(ROOM_POLL_S)
            await anyio.to_thread.run_sync(self._refresh, deadline)
            await self._check()
            state = await self._load()
            if state is None or state.status is not BatchStatus.IN_PROGRESS or time.time() >= deadline:
                raise _Stop()

    async def _submit(self, job: JobRequest, tenant: Tenant, deadline: float) -> Optional[LineFailure]:
        """Queue the line's job, waiting out refusals that pass (quota, backlog, Kafka);
        a LineFailure for a refusal that never will."""
        while True:
            try:
                await submit(self.ctx, tenant, job, client_id=True, output_field="max_tokens")
                return None
            except ApiError as exc:
                if exc.status not in (429, 503):
                    return LineFailure(exc.status, exc.body())
                wait = min(MAX_RETRY_WAIT_S, exc.retry_after_s or 1.0)
            await anyio.sleep(wait)
            await self._check()
            state = await self._load()
            if state is None or state.status is not BatchStatus.IN_PROGRESS or time.time() >= deadline:
                raise _Stop()

    def _refresh(self, deadline: Optional[float]) -> None:
        """Drop the lines whose jobs ended from `pending`, counting them; keep their
        results until the batch's output is written (a result outlives its job by
        RESULT_TTL_S, which a long window could outlast)."""
        if not self.pending:
            self._save_counts()
            return
        ids = [line_job_id(self.batch_id, n) for n in self.pending]
        states = self.ctx.store.states(ids)
        still: list[int] = []
        ended: list[str] = []
        for number, job_id, job_state in zip(self.pending, ids, states):
            if job_state is None:
                self.failed += 1  # its record is gone: the output says so (job_lost)
            elif not job_state.terminal:
                still.append(number)
            else:
                ended.append(job_id)
                if job_state is JobState.DONE:
                    self.completed += 1
                else:
                    self.failed += 1
        self.pending = still
        if ended and deadline is not None:
            keep = int(max(0.0, deadline - time.time())) + RESULT_TTL_S
            with self.ctx.sync_redis.pipeline(transaction=False) as pipe:
                for job_id in ended:
                    pipe.expire(self.ctx.settings.redis.keys.job(job_id), keep)
                pipe.execute()
        self._save_counts()

    def _save_counts(self) -> None:
        self.batches.progress(self.batch_id, completed=self.completed, failed=self.failed)

    async def _end(self, ending: BatchStatus) -> None:
        await anyio.to_thread.run_sync(lambda: self.batches.move(
            self.batch_id, BatchStatus.FINALIZING, now=time.time(), ending=ending.value))

    # --- finalizing | cancelling -> completed | expired | cancelled -----------------------

    async def _finish(self, state: BatchState) -> None:
        await self._check()
        if state.status is BatchStatus.CANCELLING:
            final, reason = BatchStatus.CANCELLED, "batch_cancelled"
        else:
            final = state.ending or BatchStatus.COMPLETED
            # A completed batch has every line's job ended; one without a job lost it.
            reason = "batch_expired" if final is BatchStatus.EXPIRED else "job_lost"
        fingerprint = await self.ctx.fingerprint()
        written = await anyio.to_thread.run_sync(lambda: write_outputs(
            self.ctx, self.batches, self.files, self.index, state, fingerprint=fingerprint, reason=reason))
        await self._check()
        fields = {"completed": written.completed, "failed": written.failed}
        if written.output_file_id:
            fields["output_file_id"] = written.output_file_id
        if written.error_file_id:
            fields["error_file_id"] = written.error_file_id
        moved = await anyio.to_thread.run_sync(lambda: self.batches.move(
            self.batch_id, final, now=time.time(), **fields))
        await anyio.to_thread.run_sync(self.batches.expire_failures, self.batch_id)
        log.info("batch ended", extra={"batch_id": self.batch_id, "status": final.value, "moved": moved is not None,
                                       "completed": written.completed, "failed": written.failed})
