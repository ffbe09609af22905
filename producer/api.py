"""`kvfleet-api`: the HTTP front door. `create_app` only wires: it builds the shared
components once (`producer.context.ApiContext`), mounts the routes
(`producer/routes/`), and turns every `producer.errors.ApiError` into its answer.

`main` serves `KVFLEET_API_WORKERS` processes on the one port (uvicorn's workers, each
with its own app from `app_from_env`: its Kafka producer, Redis pools, load reading and
batch driver, whose leases let any number of them run); with more than one, /metrics
adds up all of them (producer/metrics.py).
"""

from __future__ import annotations

import gc
import logging
import os
from contextlib import asynccontextmanager
from typing import Optional

import anyio
import redis
import redis.asyncio as aredis
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvfleet import heap, logs
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
from producer import http_errors, metrics as shared_metrics, openapi
from producer import ratelimit
from producer.pressure import Pressure
from producer.publisher import Publisher
from producer.records import Records
from producer.batches import components as batching
from producer.routes import batches, completions, files, health, jobs, models, streams

log = logging.getLogger("kvfleet.api")


def build_context(settings: Settings, *, model: Optional[ModelInfo] = None,
                  tenancy: Optional[Tenancy] = None) -> ApiContext:
    keys = settings.redis.keys
    sync_redis = redis.Redis.from_url(settings.redis.url)
    async_redis = aredis.Redis.from_url(settings.redis.url)
    records = Records(async_redis, keys)
    tenancy = tenancy or Tenancy.from_settings(settings)
    capacity = FleetCapacity(sync_redis, keys, ceiling_tokens=settings.scheduler.capacity_ceiling_tokens or None)
    pressure = Pressure(settings.kafka, Ledger(sync_redis, keys), capacity)
    quotas = Quotas(sync_redis, keys) if tenancy.configured else None
    return ApiContext(
        settings=settings, sync_redis=sync_redis, async_redis=async_redis, store=JobStore(sync_redis, keys),
        records=records, publisher=Publisher(settings.kafka), model=model or load_model_info(settings.model.source),
        tenancy=tenancy, pressure=pressure, gate=Gate(settings.api, settings.policy, pressure, quotas))


def create_app(settings: Settings, *, limits: Optional[ModelInfo] = None, tenancy: Optional[Tenancy] = None,
               ) -> FastAPI:
    ctx = build_context(settings, model=limits, tenancy=tenancy)
    batch_parts = batching.build(ctx)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await anyio.to_thread.run_sync(ensure_topics, settings.kafka)
        # The producer and the topics' metadata now, so that no submission waits for them.
        await anyio.to_thread.run_sync(ctx.publisher.ready)
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
    shared_metrics.REFUSED.labels(str(exc.status)).inc()
    headers = {**exc.headers, **await ratelimit.headers(request.app.state.ctx, getattr(request.state, "tenant", None))}
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


#: What uvicorn imports in each API process: several processes need a name to import,
#: not an app object.
APP_FACTORY = "producer.api:app_from_env"


#: The collector's young-generation threshold in an API process: ten times Python's 700.
#: A request's objects die young, and collecting every 700 allocations cost about a
#: tenth of the submit path's CPU at 64 requests in flight (docs/benchmarks.md).
GC_YOUNG_THRESHOLD = 7_000


def app_from_env() -> FastAPI:
    """One API process's app, configured from the environment (uvicorn calls it in each)."""
    settings = Settings.from_env()
    logs.setup("api", settings.log_level)
    app = create_app(settings)
    # What startup built lives as long as the process: out of the collector's way, so
    # that a collection scans only the requests' objects, not the app's ~90,000.
    if settings.gc_freeze:
        heap.freeze_startup_heap("api")
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    return app


def process_count(settings: Settings) -> int:
    """`KVFLEET_API_WORKERS`, with 0 meaning one per CPU this process may run on."""
    if settings.api.workers:
        return settings.api.workers
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere, every CPU
    return len(affinity(0)) if affinity else os.cpu_count() or 1


def main() -> None:
    settings = Settings.from_env()
    logs.setup("api", settings.log_level)
    workers = process_count(settings)
    if workers > 1:
        shared_metrics.share()  # before uvicorn starts the processes, which inherit it
    log.info("api starting", extra={"processes": workers, "port": settings.api.port})
    # Several processes accept on the one socket uvicorn binds here; the kernel spreads
    # the connections. Each process builds its own app (Kafka producer, Redis pools).
    uvicorn.run(APP_FACTORY, factory=True, workers=workers, host=settings.api.host, port=settings.api.port,
                log_config=None, access_log=False)


if __name__ == "__main__":
    main()
