"""A job's text as server-sent events, while it is generated.

    GET /v1/jobs/{id}/stream     text/event-stream

Each event of the job's stream (kvfleet/streams.py `follow`) becomes one SSE message:

    id: <position>          what to send back as Last-Event-ID (or ?after=) to resume
    event: start|delta|end
    data: <the StreamEvent as JSON>

then `data: [DONE]` after the one `end`. A `start` with attempt > 1 means the job is
rerun from scratch (its worker died): the text starts again. Silence is broken by an
SSE comment every KEEPALIVE_S so proxies keep the connection open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, Optional

import anyio
import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from prometheus_client import Gauge

from kvfleet.streams import StreamEvent, check_position, follow
from producer.context import context
from producer.errors import BadRequest
from producer.routes.jobs import _owned

#: Seconds of silence before a keep-alive comment: below the 30-60 s idle timeouts of
#: common proxies and load balancers.
KEEPALIVE_S = 15.0
# livesum: with several API processes, /metrics answers the sum over the live ones.
OPEN = Gauge("kvfleet_api_streams_open", "Event streams being relayed right now", multiprocess_mode="livesum")

_DONE, _FAILED = object(), object()  # what the relay's queue ends with

log = logging.getLogger("kvfleet.api")
router = APIRouter()


@router.get(
    "/v1/jobs/{job_id}/stream",
    responses={200: {"description": "Server-sent events: start, delta, end, then `data: [DONE]`",
                     "content": {"text/event-stream": {}}},
               404: {"description": "No such job for this tenant"},
               422: {"description": "Last-Event-ID / `after` is not a position of this stream"}},
)
async def stream_job(job_id: str, request: Request, after: Optional[str] = None) -> StreamingResponse:
    ctx = context(request)
    tenant = ctx.tenant(request.headers).name
    # Ownership first, exactly like GET /v1/jobs/{id}: another tenant's job is a 404.
    _owned(await ctx.read(job_id), job_id, tenant)
    position = request.headers.get("last-event-id") or after
    try:
        check_position(position)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    events = follow(ctx.async_redis, ctx.settings.redis.keys, job_id, after=position)
    return StreamingResponse(_sse(events), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _sse(events: AsyncIterator[StreamEvent]) -> AsyncIterator[bytes]:
    """The SSE body. `follow` runs in its own task feeding a queue, so silence can be
    timed without cancelling it mid-read. When the client goes away Starlette cancels
    this generator (under uvicorn, whose ASGI 2.3 lets it listen for the disconnect; a
    server on ASGI 2.4 makes the next write fail instead, a keep-alive at the latest),
    and `finally` cancels the task: no XREAD loop outlives its client."""
    # Bounded: a client that reads slowly slows the relay's reads, not the worker (the
    # stream waits in Redis), and the relay's memory stays small.
    queue: asyncio.Queue[object] = asyncio.Queue(maxsize=64)

    async def pump() -> None:
        try:
            async for event in events:
                await queue.put(event)
            await queue.put(_DONE)
        except Exception:  # noqa: BLE001 - Redis gone: the client sees the stream stop without [DONE]
            log.warning("stream relay failed", exc_info=True)
            await queue.put(_FAILED)

    OPEN.inc()
    task = asyncio.create_task(pump())
    try:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
            except asyncio.TimeoutError:
                yield b": keep-alive\n\n"
                continue
            if item is _DONE:
                yield b"data: [DONE]\n\n"
                break
            if item is _FAILED:
                break
            assert isinstance(item, StreamEvent)
            yield b"id: %s\nevent: %s\ndata: %s\n\n" % (item.id.encode(), item.kind.encode(),
                                                           msgspec.json.encode(item))
    finally:
        OPEN.dec()
        task.cancel()
        # Shielded: a cancelled scope (the client left) cancels every await in it again,
        # and the relay must still be seen to its end here.
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await events.aclose()
