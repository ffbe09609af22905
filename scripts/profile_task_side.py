"""CPU a worker's task side spends per job, outside its engine: a development tool.

One process builds a worker as `workers.service` does (builtin:tiny engine, the cold tier
and its prefix step, the stream publisher, the job runner, the Celery tasks) on the
local Redis (`kvfleet infra up`), then hands several-job messages straight to the
`run_jobs` task function from `--messages-at-once` threads, as Celery's pool threads
would, with no Celery consumer, Kafka or scheduler around it. It prints the process's
CPU per job, the engine step thread's share of it, the rest, and each thread's
(torch's native pool threads among them): the runner, the prefix
step, the Redis round trips, the stream, the logs (issue 16, docs/benchmarks.md "Waiting
for a core"). Settings come from the environment, so one knob at a time can be
compared in alternate runs:

    python scripts/profile_task_side.py
    KVFLEET_PREFIX_SINGLE_FLIGHT_MIN_BLOCKS=1000 python scripts/profile_task_side.py   # no flight
    KVFLEET_COLD_TIER=0 python scripts/profile_task_side.py                             # no prefix step
    KVFLEET_LOG_LEVEL=WARNING python scripts/profile_task_side.py                       # no job lines

The logs go to a temporary file (the path is printed).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis  # noqa: E402
import torch  # noqa: E402
from celery import Celery  # noqa: E402

from kvfleet import constants, logs  # noqa: E402
from kvfleet.contracts import JobRequest, Priority, Sampling, to_builtins  # noqa: E402
from kvfleet.jobstore import JobStore  # noqa: E402
from kvfleet.settings import Settings  # noqa: E402
from kvfleet.tenancy import Tenancy  # noqa: E402
from workers.model.loader import load_model  # noqa: E402
from workers.runner import JobRunner  # noqa: E402
from workers.service import build_engine, torch_threads  # noqa: E402
from workers.streaming import StreamPublisher  # noqa: E402
from workers.tasks import register  # noqa: E402


def thread_cpu_s(native_id: int) -> float:
    with open(f"/proc/self/task/{native_id}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def threads_cpu_s() -> dict[str, float]:
    """CPU seconds of each live thread of this process, by its Python name with the
    digits taken out (a pool's threads add up under one name)."""
    names = {t.native_id: re.sub(r"[-_]?\d+", "", t.name) or t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for task in os.listdir("/proc/self/task"):
        try:
            cpu = thread_cpu_s(int(task))
        except FileNotFoundError:  # ended
            continue
        name = names.get(int(task), "native (torch, OpenMP)")
        out[name] = out.get(name, 0.0) + cpu
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--jobs-per-message", type=int, default=13, help="about what a busy scheduler packs")
    parser.add_argument("--messages-at-once", type=int, default=12)
    args = parser.parse_args()

    os.environ.setdefault("KVFLEET_KEY_PREFIX", f"prof{uuid.uuid4().hex[:6]}")
    settings = Settings.from_env()
    log_file = Path(tempfile.mkdtemp(prefix="kvfleet-profile-")) / "worker.log"
    sys.stderr = open(log_file, "w")
    logs.setup("worker", settings.log_level)

    torch.set_num_threads(torch_threads(settings))  # as the worker does
    model = load_model("builtin:tiny")
    engine, generator, hooks = build_engine(settings, model)  # as the worker builds them
    client = redis.Redis.from_url(settings.redis.url)
    store = JobStore(client, settings.redis.keys)
    stream = StreamPublisher(client, settings.redis.keys, model.tokenizer).start() if settings.worker.stream else None
    runner = JobRunner(store, client, generator, model.tokenizer, worker_id="profile", stream=stream,
                       cache_salt=Tenancy.from_settings(settings).cache_salt)
    app = Celery("profile", set_as_current=False)
    register(app, runner, threads=settings.engine.max_num_seqs)
    run_jobs = app.tasks[constants.CELERY_JOBS_TASK_NAME]

    rng = random.Random(1)

    def message(n: int) -> list[dict]:
        # bench/fleet_jobs.py's short jobs: 16..128 prompt tokens, one out, each prompt unique.
        jobs = [JobRequest(job_id=uuid.uuid4().hex, tenant="bench", priority=Priority.NORMAL, model=model.name,
                           max_new_tokens=1, submitted_at=time.time(), sampling=Sampling(temperature=0.0),
                           prompt_tokens=[rng.randrange(1, 256) for _ in range(rng.randint(16, 128))])
                for _ in range(n)]
        store.create_many(jobs)
        return [to_builtins(job) for job in jobs]

    for _ in range(5):  # warm-up: the step-cost fit, the scripts loaded
        run_jobs(message(args.jobs_per_message))
    messages = [message(args.jobs_per_message) for _ in range(args.jobs // args.jobs_per_message)]
    step_thread = engine._loop._thread.native_id
    threads0 = threads_cpu_s()
    cpu0, engine0, wall0 = time.process_time(), thread_cpu_s(step_thread), time.perf_counter()
    pool = ThreadPoolExecutor(args.messages_at_once, thread_name_prefix="message")
    list(pool.map(run_jobs, messages))
    cpu, engine_cpu, wall = (time.process_time() - cpu0, thread_cpu_s(step_thread) - engine0,
                             time.perf_counter() - wall0)
    n = len(messages) * args.jobs_per_message
    print(f"{n} jobs in {wall:.2f} s ({n / wall:.0f} jobs/s); CPU per job: {cpu / n * 1e3:.3f} ms, "
          f"of it the engine's step thread {engine_cpu / n * 1e3:.3f} ms, the rest {(cpu - engine_cpu) / n * 1e3:.3f} ms")
    threads = threads_cpu_s()
    spent = sorted(((cpu_s - threads0.get(name, 0.0), name) for name, cpu_s in threads.items()), reverse=True)
    print("by thread, ms per job: " + ", ".join(f"{name} {s / n * 1e3:.3f}" for s, name in spent if s / n > 1e-6))
    print(f"logs: {log_file}", file=sys.__stdout__)
    pool.shutdown()
    engine.shutdown()
    if stream is not None:
        stream.close()
    if hooks.tier is not None:
        hooks.tier.close()


if __name__ == "__main__":
    main()
