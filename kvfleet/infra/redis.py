"""Two local Redis servers (Debian's `redis-server`), each with its persistence stated.

- state  (port 16379): job states, results, the token ledger, heartbeats, quotas and the
  Celery broker. AOF on with fsync every second (lose at most ~1 s on a crash), and
  `noeviction`: dropping a queued task or a job state silently would lose work.
- cache  (port 16380): the KV cold tier. No persistence (it is a cache: a restart only
  costs recomputation) and `maxmemory` with `allkeys-lru`, so it never grows unbounded.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import redis

from kvfleet import constants
from kvfleet.infra import procs

HOST = "127.0.0.1"


@dataclass(frozen=True)
class RedisInstance:
    name: str
    port: int
    args: tuple[str, ...]

    @property
    def dir(self) -> Path:
        path = procs.home() / f"redis-{self.name}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def pidfile(self) -> Path:
        return self.dir / "redis.pid"

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"


STATE = RedisInstance(
    "state", constants.STATE_REDIS_PORT,
    ("--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--maxmemory-policy", "noeviction"),
)
CACHE = RedisInstance(
    "cache", constants.CACHE_REDIS_PORT,
    ("--appendonly", "no", "--save", "", "--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru"),
)
INSTANCES = (STATE, CACHE)


def _binary() -> str:
    path = shutil.which("redis-server") or ("/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None)
    if path is None:
        raise RuntimeError("redis-server is not installed: apt-get install -y redis-server (scripts/setup.sh does this)")
    return path


def running(inst: RedisInstance) -> bool:
    return procs.read_pid(inst.pidfile) is not None and procs.port_open(HOST, inst.port)


def _ready(inst: RedisInstance) -> bool:
    """It answers commands: a Redis that has opened its port may still be loading its
    append-only file, and answers LOADING until it is done (a test's first command failed
    with BusyLoadingError)."""
    try:
        with redis.Redis(host=HOST, port=inst.port, socket_timeout=1.0) as client:
            return bool(client.ping())
    except redis.RedisError:  # not listening yet (ConnectionError), or BusyLoadingError
        return False


def start(inst: RedisInstance, timeout: float = 20.0) -> str:
    if running(inst):
        return inst.url
    if procs.port_open(HOST, inst.port):
        raise RuntimeError(f"port {inst.port} is taken by another process; free it for kvfleet's {inst.name} Redis")
    log = inst.dir / "redis.log"
    subprocess.run(
        [_binary(), "--port", str(inst.port), "--bind", HOST, "--dir", str(inst.dir),
         "--daemonize", "yes", "--pidfile", str(inst.pidfile), "--logfile", str(log), *inst.args],
        check=True,
    )
    procs.wait_until(lambda: _ready(inst), timeout, f"redis {inst.name} on :{inst.port}", log=log)
    print(f"redis {inst.name} up at {inst.url}", flush=True)
    return inst.url


def stop(inst: RedisInstance) -> bool:
    return procs.stop_pid(inst.pidfile, f"redis {inst.name}")
