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
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from producer import metrics as shared_metrics, openapi
from producer.answers import Health, Readiness
from producer.context import context

router = APIRouter()


class PrometheusText(Response):
    """Prometheus' text exposition format, v0.0.4: what `generate_latest` writes and
    every scraper reads (the library's CONTENT_TYPE_LATEST names a newer version)."""

    media_type = CONTENT_TYPE_PLAIN_0_0_4


@router.get("/healthz", responses={200: openapi.response(Health, "The process is up")})
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz", responses={200: openapi.response(Readiness, "Kafka and Redis answer"),
                                   503: openapi.response(Readiness, "Kafka or Redis does not answer")})
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


@router.get("/metrics", response_class=PrometheusText,
            responses={200: openapi.response(None, "Prometheus metrics", media_type=PrometheusText.media_type,
                                             schema={"type": "string"})})
async def metrics() -> Response:
    return PrometheusText(shared_metrics.exposition())
