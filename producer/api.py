"""`kvfleet-api`: the HTTP front door. `create_app` only wires: it builds the shared
components once (`producer.context.ApiContext`), mounts the routes
(`producer/routes/`), and turns every `producer.errors.ApiError` into its answer.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Optional

import anyio
import redis
import redis.asyncio as aredis
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import Counter

from kvfleet import logs
from kvfleet.capacity import FleetCapacity
from kvfleet.jobstore import JobStore
from kvfleet.kafka import ensure_topics
from kvfleet.ledger import Ledger
from kvfleet.modelinfo import ModelInfo, load_model_info
from kvfleet.quota import Quotas
from kvfleet.settings import Settings
from kvfleet.tenancy import Tenancy
from producer.admission import Gate
from producer.context import ApiContext
from producer.errors import ApiError
from producer import http_errors, openapi
from producer import ratelimit
from producer.pressure import Pressure
from producer.publisher import Publisher
from producer.batches import components as batching
from producer.routes import batches, completions, files, health, jobs, models, streams

log = logging.getLogger("kvfleet.api")

REFUSED = Counter("kvfleet_api_jobs_refused", "Requests refused, by HTTP status", ["status"])


def build_context(settings: Settings, *, model: Optional[ModelInfo] = None,
                  tenancy: Optional[Tenancy] = None) -> ApiContext:
    keys = settings.redis.keys
    sync_redis = redis.Redis.from_url(settings.redis.url)
    store = JobStore(sync_redis, keys)
    tenancy = tenancy or Tenancy.from_settings(settings)
    capacity = FleetCapacity(sync_redis, keys, ceiling_tokens=settings.scheduler.capacity_ceiling_tokens or None)
    pressure = Pressure(settings.kafka, Ledger(sync_redis, keys), capacity)
    quotas = Quotas(sync_redis, keys) if tenancy.configured else None
    return ApiContext(
        settings=settings, sync_redis=sync_redis, async_redis=aredis.Redis.from_url(settings.redis.url),
        store=store, publisher=Publisher(settings.kafka), model=model or load_model_info(settings.model.source),
        tenancy=tenancy, pressure=pressure, gate=Gate(settings.api, settings.policy, pressure, quotas))


def create_app(settings: Settings, *, limits: Optional[ModelInfo] = None, tenancy: Optional[Tenancy] = None,
               ) -> FastAPI:
    ctx = build_context(settings, model=limits, tenancy=tenancy)
    batch_parts = batching.build(ctx)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await anyio.to_thread.run_sync(ensure_topics, settings.kafka)
        ctx.pressure.start()
        batch_parts.driver.start()
        log.info("api ready", extra={"model": ctx.model.name, "max_context": ctx.model.max_context})
        yield
        await batch_parts.driver.stop()
        await anyio.to_thread.run_sync(ctx.pressure.stop)
        await anyio.to_thread.run_sync(ctx.publisher.close)
        await ctx.async_redis.aclose()
        ctx.sync_redis.close()

    app = FastAPI(title="kvfleet", version="1", lifespan=lifespan,
                  description="Asynchronous LLM inference: submit a job, then poll its result by id.")
    app.state.ctx = ctx
    app.state.batching = batch_parts
    app.include_router(jobs.router)
    app.include_router(streams.router)
    app.include_router(completions.router)
    app.include_router(models.router)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(health.router)
    app.add_exception_handler(ApiError, _refuse)
    http_errors.install(app, _refuse)  # the framework's own refusals, in the same shape
    openapi.install(app)
    return app


#: Routes that answer OpenAI's clients: invalid input is a 400 there (their
#: BadRequestError), where the native API has always answered 422.
OPENAI_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


async def _refuse(request: Request, exc: ApiError) -> JSONResponse:
    if exc.status == 422 and request.url.path in OPENAI_PATHS:
        exc.status = 400
    REFUSED.labels(str(exc.status)).inc()
    headers = {**exc.headers, **await ratelimit.headers(request.app.state.ctx, getattr(request.state, "tenant", None))}
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def main() -> None:
    settings = Settings.from_env()
    logs.setup("api", settings.log_level)
    uvicorn.run(create_app(settings), host=settings.api.host, port=settings.api.port,
                log_config=None, access_log=False)


if __name__ == "__main__":
    main()
