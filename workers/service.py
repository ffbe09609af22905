"""`kvfleet-worker`: one process, one model, one engine, many Celery task threads.

Bootstrap, top to bottom: settings → model (loaded once) → engine (its step loop in a
background thread) with the Redis cold tier as its block hooks → stream publisher → job runner → heartbeat → metrics endpoint → Celery worker loop
(thread pool, high/normal/low queues in priority order; a message of several jobs runs
them side by side, workers/tasks.py). On SIGTERM the worker drains
(workers/drain.py): it takes no new task, withdraws its capacity at once, lets running
jobs finish for KVFLEET_WORKER_DRAIN_GRACE_S and hands the rest back to their queues.
A worker whose engine faults in every step does the same by itself and exits with
status 3 (workers/health.py). On SIGKILL their tasks stay unacknowledged and are redelivered after the visibility
timeout.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid
from typing import Mapping

import redis
import torch
from celery.signals import worker_ready, worker_shutting_down
from prometheus_client import start_http_server

from kvfleet import constants, heap, logs
from kvfleet.celery_app import make_celery
from kvfleet.contracts import WorkerHeartbeat
from kvfleet.jobstore import JobStore
from kvfleet.settings import Settings
from kvfleet.tenancy import Tenancy
from kvstore.blob import Quant
from kvstore.coldtier import ColdTier, connect
from kvstore.hooks import ColdTierHooks
from workers.drain import Drain
from workers.engine import Engine
from workers.gate import JobGate
from workers.health import EngineHealth
from workers.heartbeat import Heartbeat
from workers.model.loader import LoadedModel, load_model
from workers.prefix import PrefixSharing, PrefixSharingEngine
from workers.result_cache import ResultCache, outputs_fingerprint
from workers.runner import Generator, JobRunner
from workers.streaming import StreamPublisher
from workers.tasks import register

log = logging.getLogger("kvfleet.worker")


def cold_tier(settings: Settings, engine: Engine) -> ColdTier:
    if engine.v_scales is not None:  # Settings refuses the pair; an engine built another way is refused here
        raise ValueError("the cold tier cannot hold an int8-v pool's blocks (KVFLEET_KV_CACHE_DTYPE=int8-v): "
                         "set KVFLEET_COLD_TIER=0 or KVFLEET_KV_CACHE_DTYPE=model")
    c = settings.cold_tier
    return ColdTier(connect(settings.redis.cache_url), settings.redis.keys, engine.block_manager.fingerprint,
                    engine.kv_cache, kernels=engine.kernels, quant=Quant(c.quant), ttl_s=c.ttl_s,
                    grace_s=c.grace_s, spill_max_bytes=c.spill_max_bytes,
                    # Rebuild locks and their wake-ups live with the other locks, on the
                    # state instance: the cache instance may evict keys, locks included.
                    lock_client=redis.Redis.from_url(settings.redis.url))


def torch_threads(settings: Settings, env: Mapping[str, str] = os.environ) -> int:
    """The intra-op threads this worker gives torch (`KVFLEET_WORKER_TORCH_THREADS`)."""
    if settings.worker.torch_threads:
        return settings.worker.torch_threads
    omp = env.get("OMP_NUM_THREADS", "")
    return int(omp) if omp.isdigit() and int(omp) > 0 else 1


def build_engine(settings: Settings, model: LoadedModel) -> tuple[Engine, Generator, ColdTierHooks]:
    """The engine; what the job runner calls (the engine, or with the cold tier the engine
    behind its prefix step); and the block hooks whose tier (None without one) the
    worker closes at exit."""
    hooks = ColdTierHooks(prefetch_only=True)  # loads are prefetched in the task threads (workers/prefix.py)
    engine = Engine(model, settings.engine, hooks=hooks)
    if not settings.cold_tier.enabled:
        return engine, engine, hooks
    # The engine owns its pool only once built, so the tier is attached after.
    hooks.tier = cold_tier(settings, engine)
    hooks.give_back = engine.block_manager.give_back  # spills go straight from the pool
    return engine, PrefixSharingEngine(engine, PrefixSharing(
        engine, hooks.tier, min_blocks=settings.cold_tier.single_flight_min_blocks,
        prefill_tokens_per_s=settings.cold_tier.prefill_tokens_per_s)), hooks


def main() -> None:
    settings = Settings.from_env()
    logs.setup("worker", settings.log_level)
    worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    started_at = time.time()

    # Before the engine's step thread starts: a thread takes torch's count when it first
    # runs an op, and the step thread is where the model runs.
    torch.set_num_threads(torch_threads(settings))
    model = load_model(settings.model.source, device=settings.model.device, dtype=settings.model.dtype)
    engine, generator, hooks = build_engine(settings, model)
    concurrency = settings.worker_concurrency
    log.info("model loaded", extra={"model": model.name, "device": str(model.device), "dtype": str(model.dtype),
                                    "fingerprint": model.fingerprint,
                                    # As the thread the model runs on sees it.
                                    "torch_threads": engine.call_soon(torch.get_num_threads).result(),
                                    "kv_capacity_tokens": engine.stats().capacity_tokens})

    client = redis.Redis.from_url(settings.redis.url)
    store = JobStore(client, settings.redis.keys)
    stream = StreamPublisher(client, settings.redis.keys, model.tokenizer,
                             every_run=settings.worker.stream_all).start() if settings.worker.stream else None
    draining = threading.Event()  # set on SIGTERM (workers/drain.py)
    drain: Drain  # built below, once the heartbeat it withdraws exists

    def unhealthy() -> None:
        # Drain at once (withdraw the capacity, start nothing new, hand back what runs),
        # and ask Celery for its warm shutdown, as SIGTERM would; main exits non-zero.
        drain.begin()
        os.kill(os.getpid(), signal.SIGTERM)

    health = EngineHealth(engine.stats, settings.worker.unhealthy_after_faults, unhealthy)
    tenancy = Tenancy.from_settings(settings)
    results = None
    if settings.worker.result_cache_ttl_s > 0:
        results = ResultCache(redis.Redis.from_url(settings.redis.cache_url), settings.redis.keys,
                              outputs_fingerprint(model.fingerprint, settings.engine.kv_cache_dtype),
                              ttl_s=settings.worker.result_cache_ttl_s, lock_client=client)
    runner = JobRunner(store, client, generator, model.tokenizer, worker_id=worker_id, stream=stream,
                       draining=draining, cache_salt=tenancy.cache_salt,
                       max_job_faults=settings.worker.max_job_faults, on_fault=health.check,
                       results=results, result_cache_allowed=tenancy.result_cache)

    def snapshot() -> WorkerHeartbeat:
        # A message of more jobs than the engine's batch would only queue inside it.
        return WorkerHeartbeat(worker_id=worker_id, capacity_tokens=engine.stats().capacity_tokens, slots=concurrency,
                               jobs_per_message=settings.engine.max_num_seqs,
                               model=model.name, fingerprint=model.fingerprint, started_at=started_at)

    heartbeat = Heartbeat(client, settings.redis.keys, worker_id, snapshot)
    heartbeat.start()
    drain = Drain(settings.worker.drain_grace_s, withdraw=heartbeat.stop, running=runner.running_jobs,
                  cancel=generator.cancel, draining=draining)
    # Celery's warm shutdown (SIGTERM, or SIGINT) stops consuming and waits for the
    # running tasks; the drain bounds that wait and withdraws the capacity meanwhile.
    stop_requested = threading.Event()  # a signal asked Celery to stop (not a crash of its own)

    def shutting_down(**_) -> None:
        stop_requested.set()
        drain.begin()

    worker_shutting_down.connect(shutting_down, weak=False)
    if settings.gc_freeze:
        # Once Celery's consumer and pool exist too: they are startup objects as well.
        worker_ready.connect(lambda **_: heap.freeze_startup_heap("worker"), weak=False)
    if settings.worker.metrics_port:
        start_http_server(settings.worker.metrics_port)

    app = make_celery(settings)
    gate = JobGate(concurrency, settings.policy.high_slot_reserve, settings.redis.key_prefix)
    gate.install(app)
    register(app, runner, threads=settings.engine.max_num_seqs, gate=gate)
    queues = ",".join(constants.all_celery_queues(settings.redis.key_prefix))
    log.info("worker starting", extra={"worker_id": worker_id, "queues": queues,
                                       "concurrency": concurrency})
    try:
        app.worker_main([
            "worker", "--pool=threads", f"--concurrency={concurrency}",
            "-Q", queues, "-n", f"{worker_id}@%h", f"--loglevel={settings.log_level}",
            "--without-gossip", "--without-mingle",  # no chatter between workers we do not use
        ])
    finally:
        heartbeat.stop()
        engine.shutdown()
        if stream is not None:
            stream.close()  # writes what the last steps queued
        if hooks.tier is not None:
            hooks.tier.close()  # drains the spill queue
        log.info("worker stopped", extra={"worker_id": worker_id, "unhealthy": health.unhealthy.is_set()})
        if health.unhealthy.is_set():
            raise SystemExit(3)  # for the supervisor: restart this process, it is sick
        if not stop_requested.is_set():
            # Celery stopped by itself: kombu gives up with an "unrecoverable error" when
            # the broker (the state Redis) restarts under it, and exits 0. Nobody asked for
            # this stop, so the supervisor must restart the worker (bench/chaos.py found it).
            log.error("Celery stopped without being asked to; exiting non-zero for a restart")
            raise SystemExit(1)


if __name__ == "__main__":
    main()
