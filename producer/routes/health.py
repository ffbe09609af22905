"""Health, readiness and metrics.

    GET /healthz   the process is up
    GET /readyz    Kafka and Redis answer (503 otherwise)
    GET /metrics   Prometheus
"""

from __future__ import annotations

import asyncio

import anyio
import redis
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from producer.context import context

router = APIRouter()


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    ctx = context(request)
    checks = {"redis": False, "kafka": False}
    try:
        checks["redis"] = bool(await asyncio.wait_for(ctx.async_redis.ping(), 2.0))
    except (redis.RedisError, OSError, asyncio.TimeoutError):
        pass
    checks["kafka"] = await anyio.to_thread.run_sync(ctx.publisher.ready)
    ok = all(checks.values())
    return JSONResponse({"ready": ok, **checks}, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
