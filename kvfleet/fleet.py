"""Starts and stops a local fleet (API, scheduler, N workers) as background processes.

Each service runs from its console entry point with logs in `$KVFLEET_HOME/fleet/`
and a pid file beside them; `up()` is idempotent and waits until the API is ready and
every worker has published a heartbeat.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import redis

from kvfleet import registry
from kvfleet.infra import procs
from kvfleet.settings import Settings


def fleet_dir() -> Path:
    path = procs.home() / "fleet"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _command(entry: str) -> list[str]:
    # Prefer the console script next to this interpreter (the venv's), else `python -m`.
    script = Path(sys.executable).with_name(entry)
    if script.exists():
        return [str(script)]
    found = shutil.which(entry)
    if found:
        return [found]
    module = {"kvfleet-api": "producer.api", "kvfleet-scheduler": "scheduler.service",
              "kvfleet-worker": "workers.service"}[entry]
    return [sys.executable, "-m", module]


def _start(name: str, entry: str, env: dict[str, str]) -> int:
    pidfile = fleet_dir() / f"{name}.pid"
    pid = procs.read_pid(pidfile)
    if pid is not None:
        return pid
    with open(fleet_dir() / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(_command(entry), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    pidfile.write_text(str(proc.pid))
    return proc.pid


def up(settings: Settings, *, workers: int = 1, timeout: float = 180.0) -> None:
    env = dict(os.environ)
    _start("api", "kvfleet-api", env)
    _start("scheduler", "kvfleet-scheduler", env)
    for i in range(workers):
        # Each worker on one host needs its own metrics port.
        worker_env = {**env, "KVFLEET_WORKER_METRICS_PORT": str(settings.worker.metrics_port + i)}
        _start(f"worker-{i}", "kvfleet-worker", worker_env)
    url = f"{settings.api.base_url}/readyz"
    procs.wait_until(lambda: _ready(url), timeout, f"the API at {url}", log=fleet_dir() / "api.log")
    client = redis.Redis.from_url(settings.redis.url)
    procs.wait_until(lambda: len(registry.live(client, settings.redis.keys)) >= workers,
                     timeout, f"{workers} worker heartbeat(s)", log=fleet_dir() / "worker-0.log")
    print(f"fleet up: API {settings.api.base_url}, 1 scheduler, {workers} worker(s); logs in {fleet_dir()}",
          flush=True)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def down() -> None:
    for pidfile in sorted(fleet_dir().glob("*.pid")):
        procs.stop_pid(pidfile, pidfile.stem, timeout=60.0)


def status() -> dict[str, bool]:
    return {p.stem: procs.read_pid(p) is not None for p in sorted(fleet_dir().glob("*.pid"))}

