"""A real fleet for integration tests: API, scheduler and workers as OS processes.

Each `Fleet` gets its own key prefix, topic prefix and Celery queues (all derived from
one test prefix) on the shared local Kafka and Redis, so fleets of different tests never
see each other's jobs. Processes are the real entry points (`python -m producer.api`,
…), killed at teardown; their logs go to files that a failing test prints.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional, TypeVar

import httpx
import msgspec
import redis

from kvfleet import registry
from kvfleet.constants import Keys
from kvfleet.contracts import JobState, WorkerHeartbeat
from kvfleet.jobstore import JobStore

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")
MODULES = {"api": "producer.api", "scheduler": "scheduler.service", "worker": "workers.service"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], T], what: str, timeout: float = 30.0, *, poll_s: float = 0.05,
             details: Callable[[], str] = lambda: "") -> T:
    """Poll `predicate` until it returns something true; that value. On timeout the
    error says what was awaited, with `details()` (e.g. the fleet's logs)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s\n{details()}")


class Fleet:
    def __init__(self, *, prefix: str, kafka: str, redis_url: str, cache_redis_url: str, log_dir: Path,
                 model: str = "builtin:tiny", extra_env: Optional[dict[str, str]] = None) -> None:
        self.prefix = prefix
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.keys = Keys(prefix)
        self.redis = redis.Redis.from_url(redis_url)
        self.log_dir = log_dir
        self.env = {
            # Not the test process's OMP_NUM_THREADS (conftest.py): a worker here gives torch
            # the threads a deployed one does (KVFLEET_WORKER_TORCH_THREADS).
            **{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "KVFLEET_KAFKA_BOOTSTRAP": kafka,
            "KVFLEET_REDIS_URL": redis_url,
            "KVFLEET_CACHE_REDIS_URL": cache_redis_url,
            "KVFLEET_KEY_PREFIX": prefix,
            "KVFLEET_TOPIC_PREFIX": f"{prefix}.requests",
            "KVFLEET_SCHEDULER_GROUP": f"{prefix}-scheduler",
            "KVFLEET_KAFKA_PARTITIONS": "2",
            "KVFLEET_MODEL": model,
            "KVFLEET_API_PORT": str(self.port),
            "KVFLEET_SCHEDULER_METRICS_PORT": "0",
            "KVFLEET_WORKER_METRICS_PORT": "0",
            "KVFLEET_LOG_LEVEL": "INFO",
            **(extra_env or {}),
        }
        self.procs: dict[str, subprocess.Popen] = {}
        self.killed: set[str] = set()
        self._count = 0

    def start(self, role: str, *, name: Optional[str] = None, env: Optional[dict[str, str]] = None) -> str:
        self._count += 1
        name = name or f"{role}-{self._count}"
        log = open(self.log_dir / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", MODULES[role]], env={**self.env, **(env or {})},
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
        )
        return name

    def wait_ready(self, workers: int = 1, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.assert_alive()
            if self._api_ready() and self.live_workers() >= workers:
                return
            time.sleep(0.3)
        raise TimeoutError(f"fleet not ready in {timeout}s\n{self.logs()}")

    def _api_ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def submit(self, priority: str = "normal", *, prompt_len: int = 8, max_new_tokens: int = 8,
               tenant: str = "acme", **body) -> str:
        """A job of `prompt_len` + `max_new_tokens` tokens (the prompt is token ids, so the
        cost is exact); its id."""
        response = httpx.post(f"{self.url}/v1/jobs", headers={"X-Tenant-ID": tenant, "X-Priority": priority},
                              json={"prompt_tokens": [7] * prompt_len, "max_new_tokens": max_new_tokens, **body})
        assert response.status_code == 202, response.text
        return response.json()["job_id"]

    def field(self, job_id: str, name: str) -> Optional[str]:
        raw = self.redis.hget(self.keys.job(job_id), name)
        return raw.decode() if raw is not None else None

    def state(self, job_id: str) -> Optional[str]:
        return self.field(job_id, "state")

    def wait_for(self, predicate: Callable[[], T], what: str, timeout: float = 30.0) -> T:
        """Poll `predicate` until it returns something true; that value."""
        return wait_for(predicate, what, timeout, details=self.logs)

    def fake_capacity(self, tokens: int, *, name: str = "fake", ttl_s: float = 600.0) -> None:
        """Publish a worker heartbeat without a worker: the scheduler sees `tokens` of
        budget, and admitted jobs wait in the Celery queue until a test releases them."""
        beat = WorkerHeartbeat(worker_id=name, capacity_tokens=tokens)
        registry.publish(self.redis, self.keys, beat, ttl_ms=int(ttl_s * 1000))

    def finish(self, job_id: str) -> None:
        """Play the worker for an admitted job: start it and finish it `done`, which
        releases its tokens (the production path, `JobStore.start` and `finish`)."""
        store = JobStore(self.redis, self.keys)
        now = time.time()
        assert store.start(job_id, now=now, worker="test").ok, f"{job_id} could not start"
        current = store.get(job_id)
        done = msgspec.structs.replace(current, status=JobState.DONE,
                                       timings=msgspec.structs.replace(current.timings, finished_at=now))
        assert store.finish(done).ok, f"{job_id} could not finish"

    def reserved(self, job_id: str) -> Optional[int]:
        """Tokens the ledger holds for the job; None when it holds none."""
        raw = self.redis.hget(self.keys.ledger, job_id)
        return int(raw) if raw is not None else None

    def metrics(self, port: int) -> dict[str, float]:
        """A service's Prometheus samples: {'name{label="v",...}': value}."""
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def live_workers(self) -> int:
        return len(registry.live(self.redis, self.keys))

    def assert_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None and n not in self.killed}
        if dead:
            raise RuntimeError(f"fleet processes exited: {dead}\n{self.logs()}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.killed.add(name)
        self.procs[name].send_signal(sig)
        self.procs[name].wait(timeout=30)

    def logs(self, lines: int = 40) -> str:
        out = []
        for path in sorted(self.log_dir.glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name} ---\n" + "\n".join(tail))
        return "\n".join(out)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.redis.close()


@contextmanager
def running_fleet(infra: dict[str, str], redis_url: str, cache_redis_url: str, log_dir: Path, *,
                  workers: int = 1, model: str = "builtin:tiny",
                  extra_env: Optional[dict[str, str]] = None) -> Iterator[Fleet]:
    """An API, a scheduler and `workers` workers under a fresh prefix, ready; stopped on
    exit. For module-scoped fixtures (tests/conftest.py's `make_fleet` is per test)."""
    fleet = Fleet(prefix=f"t{uuid.uuid4().hex[:10]}", kafka=infra["kafka"], redis_url=redis_url,
                  cache_redis_url=cache_redis_url, log_dir=log_dir, model=model, extra_env=extra_env)
    try:
        fleet.start("api")
        fleet.start("scheduler")
        for _ in range(workers):
            fleet.start("worker")
        fleet.wait_ready(workers=workers)
        yield fleet
    finally:
        fleet.stop()
