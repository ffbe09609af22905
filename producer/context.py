"""What every route needs, built once by `create_app` and kept on `app.state.ctx`."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional

import anyio
import msgspec
import redis
import redis.asyncio as aredis
from fastapi import Request

from kvfleet import registry
from kvfleet.contracts import JobResult, JobState, WorkerHeartbeat, decode_result
from kvfleet.jobstore import JobStore, result_from_hash
from kvfleet.modelinfo import ModelInfo
from kvfleet.settings import Settings
from kvfleet.tenancy import Tenancy, Tenant
from producer.admission import Gate
from producer.auth import resolve_tenant
from producer.pressure import Pressure
from producer.publisher import Publisher
from producer.records import Records


log = logging.getLogger(__name__)

#: How long a read of the workers' heartbeats is reused, seconds.
FLEET_CACHE_S = 1.0


@dataclass
class ApiContext:
    settings: Settings
    sync_redis: redis.Redis  # for the blocking components, run on worker threads
    async_redis: aredis.Redis  # for reads on the event loop
    store: JobStore
    records: Records  # the submit path's Redis writes, on the event loop
    publisher: Publisher
    model: ModelInfo
    tenancy: Tenancy
    pressure: Pressure
    gate: Gate

    #: The live workers' heartbeats and when they were read (`fleet()` caches them).
    _fleet: tuple[float, list[WorkerHeartbeat]] = field(default=(0.0, []), init=False, repr=False)

    async def fleet(self) -> list[WorkerHeartbeat]:
        """The live workers' heartbeats, read at most once a second: `/v1/models` and
        every OpenAI answer's `system_fingerprint` come from them."""
        read_at, beats = self._fleet
        if time.monotonic() - read_at > FLEET_CACHE_S:
            beats = await anyio.to_thread.run_sync(registry.live, self.sync_redis, self.settings.redis.keys)
            self._fleet = (time.monotonic(), beats)
        return beats

    async def fingerprint(self) -> Optional[str]:
        """OpenAI's `system_fingerprint`: the served weights' fingerprint, as the workers
        that serve this model report it (None while none is alive)."""
        prints = sorted({b.fingerprint for b in await self.fleet() if b.model == self.model.name and b.fingerprint})
        return f"fp_{prints[0][:12]}" if prints else None

    def tenant(self, headers: Mapping[str, str], body_tenant: Optional[str] = None) -> Tenant:
        """The caller's tenant (raises Unauthorized / Forbidden)."""
        return resolve_tenant(self.tenancy, {k.lower(): v for k, v in headers.items()}, body_tenant,
                              default_tenant=self.settings.api.default_tenant)

    async def read(self, job_id: str) -> Optional[JobResult]:
        return result_from_hash(job_id, await self.async_redis.hgetall(self.settings.redis.keys.job(job_id)))

    async def wait_terminal(self, job_id: str, timeout: float) -> Optional[JobResult]:
        """The job once terminal, or as it is after `timeout` seconds (woken by the
        job's pub/sub channel, which every state change publishes to)."""
        pubsub = self.async_redis.pubsub()
        try:
            await pubsub.subscribe(self.settings.redis.keys.job_events(job_id))
            deadline = time.monotonic() + timeout
            while True:
                # Read after subscribing: a change between our first read and the
                # subscription would otherwise be missed until the timeout.
                result = await self.read(job_id)
                remaining = deadline - time.monotonic()
                if result is None or result.status.terminal or remaining <= 0:
                    return result
                # A message names the job's new state (kvfleet/jobstore.py), so one that
                # does not end it (admitted, running) needs no read, nor does the
                # subscription's confirmation; the one that ends it carries the result
                # itself, so it needs none either. Each wait is capped at 1 s, so a lost
                # notification costs at most a second.
                while remaining > 0:
                    message = await pubsub.get_message(timeout=min(remaining, 1.0))
                    if message is None:
                        break
                    if message["type"] == "message":
                        ended = _result_in(message["data"], job_id)
                        if ended is not None:
                            return ended
                        if _may_end_the_job(message["data"]):
                            break
                    remaining = deadline - time.monotonic()
        finally:
            # After the answer, not before it: letting the connection go is nothing the
            # client waits for (~0.2 ms of an idle job's round trip). Closing it ends its
            # subscription on the server, so no UNSUBSCRIBE goes first.
            task = asyncio.get_running_loop().create_task(_close(pubsub))
            _closing.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(_closing.discard)


#: Long polls' pub/sub connections being let go, after their answers.
_closing: set[asyncio.Task] = set()


async def _close(pubsub: aredis.client.PubSub) -> None:
    try:
        await pubsub.aclose()
    except (redis.RedisError, OSError) as exc:  # a connection already broken: nothing to let go
        log.debug("closing a long poll's pub/sub failed", extra={"error": str(exc)})


def _result_in(data: object, job_id: str) -> Optional[JobResult]:
    """The terminal result a job channel's message carries (what `finish` publishes),
    or None for anything else: a state's name, or bytes that do not decode and validate
    as this job's terminal result (then the caller reads the job, to be safe)."""
    if not isinstance(data, bytes) or not data.startswith(b"{"):
        return None
    try:
        result = decode_result(data)
    except msgspec.MsgspecError:
        return None
    return result if result.job_id == job_id and result.status.terminal else None


def _may_end_the_job(data: object) -> bool:
    """Whether a job channel's message may have ended the job: a terminal state's name,
    or anything that is no state's name (read the job, to be safe)."""
    try:
        return JobState(data.decode() if isinstance(data, bytes) else data).terminal
    except (ValueError, AttributeError):
        return True


def context(request: Request) -> ApiContext:
    return request.app.state.ctx
