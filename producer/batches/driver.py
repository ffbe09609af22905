"""The batch driver: a task in every API process that runs the fleet's batches.

    while running:
        every batch in the active set that no driver holds: take its lease, run it
        now and then: delete files past their retention

A batch is run by whichever API replica takes its lease first (`SET NX PX`, renewed by
a thread, kvstore/lock.py); the others skip it. When that replica dies its lease
expires (BATCH_LEASE_S) and another one, or the same one restarted, takes the batch
over where its progress says (producer/batches/run.py says why that is safe). A
replica that shuts down cleanly releases its leases, so a restart resumes at once.
"""

from __future__ import annotations

import asyncio
import logging
import time

import anyio

from kvfleet import constants
from kvstore.lock import Lease
from producer.batches.run import BatchRun, LeaseLost
from producer.batches.store import BatchStore
from producer.context import ApiContext
from producer.files.index import FileIndex
from producer.files.store import FileStore

log = logging.getLogger("kvfleet.batch")

#: Seconds between looks for batches without a driver.
POLL_S = 1.0
#: Seconds between retention sweeps of expired files.
SWEEP_S = 60.0


class BatchDriver:
    def __init__(self, ctx: ApiContext, batches: BatchStore, files: FileStore, index: FileIndex) -> None:
        self.ctx, self.batches, self.files, self.index = ctx, batches, files, index
        self._running: dict[str, tuple[asyncio.Task, Lease]] = {}
        self._task: asyncio.Task | None = None
        self._swept_at = 0.0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="batch-driver")

    async def stop(self) -> None:
        tasks = [self._task] + [task for task, _ in self._running.values()]
        for task in tasks:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in tasks if t is not None), return_exceptions=True)

    async def _loop(self) -> None:
        log.info("batch driver started")
        while True:
            try:
                await self._take_batches()
                if time.monotonic() - self._swept_at > SWEEP_S:
                    self._swept_at = time.monotonic()
                    await anyio.to_thread.run_sync(self._sweep)
            except Exception:  # a Redis hiccup: look again next time, never stop driving
                log.exception("batch driver step failed")
            await asyncio.sleep(POLL_S)

    async def _take_batches(self) -> None:
        for batch_id in await anyio.to_thread.run_sync(self.batches.active):
            if batch_id in self._running:
                continue
            lease = Lease(self.ctx.sync_redis, self.ctx.settings.redis.keys.lock(f"batch:{batch_id}"),
                          int(constants.BATCH_LEASE_S * 1000))
            if not await anyio.to_thread.run_sync(lease.acquire):
                continue  # another replica drives it
            lease.keep_alive()
            task = asyncio.get_running_loop().create_task(self._drive(batch_id, lease), name=f"batch-{batch_id}")
            self._running[batch_id] = (task, lease)

    async def _drive(self, batch_id: str, lease: Lease) -> None:
        try:
            await BatchRun(self.ctx, self.batches, self.files, self.index, batch_id, lease.renew).run()
        except LeaseLost:
            log.warning("batch lease lost; another driver has it", extra={"batch_id": batch_id})
        except asyncio.CancelledError:
            log.info("batch driver stopping", extra={"batch_id": batch_id})
            raise
        except Exception:
            log.exception("batch run failed; retried at the next poll", extra={"batch_id": batch_id})
        finally:
            self._running.pop(batch_id, None)
            # Released in a thread that outlives a cancelled task: the next driver
            # resumes at once instead of after the lease's TTL.
            await asyncio.shield(anyio.to_thread.run_sync(lease.release))

    def _sweep(self) -> None:
        """Delete files past their retention: bytes first, then the record that names them."""
        for file_id in self.index.expired(time.time()):
            record = self.index.raw(file_id)
            self.files.delete(file_id)
            if record is not None:
                self.index.remove(record)
            else:
                self.ctx.sync_redis.zrem(self.ctx.settings.redis.keys.files_expiry, file_id)
