"""Chaos run: thousands of jobs through the real fleet while its parts are killed.

    python bench/chaos.py [--quick] [--jobs N] [--seed S] [--rounds R] [--out bench/results]

`--quick`: 500 jobs and 12 faults in about 3 minutes; the full run: 2,000 jobs, 24 faults.

A fleet of one API, one scheduler and two workers (the tiny built-in model) runs on its
own Kafka broker and its own state and cache Redis, started here in a temporary
directory on free ports, so that killing them never disturbs the local Kafka and Redis
the test suite shares. Client threads submit `--jobs` jobs (high/normal/low, a gold and
two silver tenants, prompts of 4-192 tokens, a third sharing one of four prefixes; 60%
ask for 4-48 new tokens, 40% for 128 up to the low class's ceiling, so that work is in
flight throughout) at Poisson moments over the submission window, 5 a second, each with
its own `job_id`, and retry as docs/operations.md says: the same `job_id` after a 503
(or any 5xx), a dropped connection or a timeout, and after 429's Retry-After.

Meanwhile a seeded schedule (`random.Random(seed)`) of faults, `--rounds` of each kind
in a random order at random moments of the window: SIGKILL and restart the scheduler, a
worker, the API, the Kafka broker, the state Redis (AOF, same data dir); SIGTERM a
worker (it drains) and start its replacement; each restart waits until its replacement
serves. Submissions are paced so that they never run ahead of a fault that is late (a
loaded machine restarts slowly; see Pacer), so every fault lands among jobs in flight. A
fleet process that exits on its own is restarted, as a supervisor would, and that is in
the timeline too.

Then it waits (up to `--drain-s`) for every job to be terminal and reads, from the
state Redis, each job's hash (`state`, `result`, `attempts`: how many times a worker
started it, written by the worker's own Lua call), and from the fleet's results topic
every copy of every result. Figures (targets: lost, failed, results_rewritten all 0):
  lost                   jobs not terminal at the drain deadline
  failed                 terminal but not done (by state and error code in failed_by)
  executions_beyond_one  sum over jobs of attempts - result.attempt (runs after the one
                         whose result was kept); null while JobResult has no `attempt`,
                         then jobs_with_attempts_over_one stands in for it
  results_rewritten      jobs with more than one distinct result on Kafka (identical
                         copies are at-least-once delivery: result_duplicates)

Prints a table and the fleet's log directory (every process's log, and jobs.json: each
job's record and what its client saw); writes <out>/chaos.json and <out>/chaos.png (jobs
accepted / terminal over time, faults as vertical lines, shaded until the replacement
serves).
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import math
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import redis  # noqa: E402

from kvfleet import constants, registry  # noqa: E402
from kvfleet.contracts import JobState  # noqa: E402
from kvfleet.infra import kafka as infra_kafka  # noqa: E402
from kvfleet.infra import procs  # noqa: E402
from kvfleet.infra import redis as infra_redis  # noqa: E402
from tests.fleet import Fleet, free_port  # noqa: E402  (the integration tests' process launcher)

HOST = "127.0.0.1"
TERMINAL = {s.value for s in JobState if s.terminal}
TENANTS = {"tenants": [
    {"name": "acme", "tier": "gold", "share": 0.3, "tokens_per_minute": 10**9, "api_keys": ["sk-chaos-acme"]},
    {"name": "globex", "tier": "silver", "tokens_per_minute": 10**9, "api_keys": ["sk-chaos-globex"]},
    {"name": "initech", "tier": "silver", "tokens_per_minute": 10**9, "api_keys": ["sk-chaos-initech"]},
]}
PRIORITIES = (("high", 0.2), ("normal", 0.5), ("low", 0.3))
FAULTS = ("kill-scheduler", "kill-worker", "kill-api", "kill-kafka", "kill-redis", "drain-worker")
WORKERS = 2
#: Drained workers exit within the fleet's drain grace (30 s) plus the hand-back.
DRAIN_EXIT_S = 60.0
SUPERVISOR_BACKOFF_S = 5.0


# --- the chaos run's own broker and Redis ------------------------------------------

class Daemon:
    """One server of the run's own infrastructure: started, SIGKILLed and restarted on
    the same port and data dir (what survives a crash is what it made durable)."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path, answers: Callable[[], bool]) -> None:
        self.name, self.argv, self.port, self.log, self.answers = name, argv, port, log, answers
        self.proc: Optional[subprocess.Popen] = None

    def spawn(self) -> int:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)  # Ctrl-C reaches us, and we stop it
        return self.proc.pid

    def wait_ready(self, timeout: float = 120.0) -> None:
        proc = self.proc
        assert proc is not None
        procs.wait_until(lambda: proc.poll() is not None or self.answers(), timeout, self.name, log=self.log)
        if proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {proc.returncode}; see {self.log}")

    def kill(self, sig: int = signal.SIGKILL) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(timeout=60)
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def own_redis(name: str, home: Path, args: tuple[str, ...]) -> Daemon:
    port, data = free_port(), home / f"redis-{name}"
    data.mkdir(parents=True)
    argv = [shutil.which("redis-server") or "/usr/bin/redis-server", "--port", str(port), "--bind", HOST,
            "--dir", str(data), "--logfile", str(data / "redis.log"), *args]

    def answers() -> bool:
        try:
            return bool(redis.Redis(host=HOST, port=port, socket_timeout=1).ping())
        except redis.RedisError:
            return False  # also while it loads its AOF
    return Daemon(f"redis-{name}", argv, port, data / "stdout.log", answers)


def own_kafka(home: Path) -> Daemon:
    """A one-node KRaft broker with the jars the local broker uses, its own log dir."""
    port, controller, data = free_port(), free_port(), home / "kafka"
    data.mkdir(parents=True)
    props = data / "server.properties"
    # The local broker's settings (kvfleet/infra/kafka.py), on other ports and another dir.
    props.write_text("\n".join([
        "process.roles=broker,controller", "node.id=1", f"controller.quorum.voters=1@{HOST}:{controller}",
        f"listeners=PLAINTEXT://{HOST}:{port},CONTROLLER://{HOST}:{controller}",
        f"advertised.listeners=PLAINTEXT://{HOST}:{port}", "controller.listener.names=CONTROLLER",
        "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name=PLAINTEXT", f"log.dirs={data / 'logs'}",
        "offsets.topic.replication.factor=1", "transaction.state.log.replication.factor=1",
        "transaction.state.log.min.isr=1", "share.coordinator.state.topic.replication.factor=1",
        "share.coordinator.state.topic.min.isr=1", "group.initial.rebalance.delay.ms=0",
        "auto.create.topics.enable=false", "log.retention.hours=168", ""]))
    log4j = resources.files("kvfleet.infra") / "log4j2.properties"
    java = ["java", infra_kafka.HEAP, "-cp", f"{infra_kafka.ensure_jars()}/*", f"-Dlog4j2.configurationFile={log4j}"]
    cluster_id = "-"
    while cluster_id.startswith("-"):  # StorageTool would read a leading '-' as an option
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
    subprocess.run([*java, "kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(props)],
                   check=True, stdout=subprocess.DEVNULL)
    bootstrap = f"{HOST}:{port}"

    return Daemon("kafka", [*java, "kafka.Kafka", str(props)], port, data / "broker.log",
                  lambda: infra_kafka.answers(bootstrap))


# --- clients ------------------------------------------------------------------------

@dataclass
class Job:
    job_id: str
    tenant: str
    priority: str
    prompt_tokens: list[int]
    max_new_tokens: int
    at: float  # planned submission, seconds after the start
    accepted_at: Optional[float] = None
    answers: collections.Counter = field(default_factory=collections.Counter)  # status or error -> times


def plan_jobs(rng: random.Random, n: int, window_s: float, seed: int) -> list[Job]:
    """`n` jobs at Poisson moments over `window_s`; a third share one of four prefixes."""
    prefixes = [[rng.randrange(256) for _ in range(64)] for _ in range(4)]
    jobs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(n / window_s)
        prompt = [rng.randrange(256) for _ in range(rng.randint(4, 128))]
        if rng.random() < 1 / 3:
            prompt = rng.choice(prefixes) + prompt
        priority = rng.choices([p for p, _ in PRIORITIES], [w for _, w in PRIORITIES])[0]
        tenant = rng.choice(TENANTS["tenants"])["name"]
        # Mostly short answers, and long ones (the tiny model writes about a thousand
        # tokens a second) that keep the workers busy between arrivals; within the low
        # class's ceiling (1,024 tokens with prompt) and the model's context.
        new_tokens = rng.randint(4, 48) if rng.random() < 0.6 else rng.randint(128, 1000 - len(prompt))
        jobs.append(Job(f"chaos-{seed}-{i:05d}", tenant, priority, prompt, new_tokens, t))
    return jobs


def submit_until_accepted(client: httpx.Client, url: str, job: Job, t0: float, stop: threading.Event) -> None:
    """POST the job until the API takes it (202) or says it has it (200), retrying as the
    docs say: the same job_id after 5xx, a dropped connection or a timeout; 429 after
    its Retry-After. Gives up only when the run stops."""
    key = next(t["api_keys"][0] for t in TENANTS["tenants"] if t["name"] == job.tenant)
    body = {"job_id": job.job_id, "prompt_tokens": job.prompt_tokens, "max_new_tokens": job.max_new_tokens}
    headers = {"Authorization": f"Bearer {key}", "X-Priority": job.priority}
    backoff = 0.2
    while not stop.is_set():
        try:
            response = client.post(f"{url}/v1/jobs", json=body, headers=headers)
            job.answers[str(response.status_code)] += 1
            if response.status_code in (200, 202):
                job.accepted_at = time.time() - t0
                return
            if response.status_code == 429:  # Retry-After is integer seconds (docs/operations.md)
                retry_after = response.headers.get("retry-after", "1")
                stop.wait(min(float(retry_after) if retry_after.isdigit() else 1.0, 5.0))
                continue
            if response.status_code < 500:
                return  # refused for good: the job never ends, and counts as lost
        except httpx.HTTPError as exc:
            job.answers[type(exc).__name__] += 1
        stop.wait(backoff)
        backoff = min(backoff * 2, 2.0)


class Pacer:
    """The plan's clock, in seconds since the start, shared by the clients and the faults.

    It runs with the wall clock, except that it stops at the planned moment of a fault
    that has not started, and, while a fault is being applied (a restart waits until the
    replacement serves), halfway to the next fault's moment. So when restarts take
    longer than planned (a loaded machine), the submissions wait for the faults instead
    of ending before them, and the last half of each gap is submitted after the fault
    before it is over: every fault lands among jobs in flight. `lag_s` is how far the
    clock fell behind the wall clock."""

    def __init__(self, t0: float, moments: list[float]) -> None:
        self.t0, self.moments = t0, moments
        self.started, self.applying = 0, False  # faults started; whether the last is in progress
        self.clock, self.ticked = 0.0, t0
        self.lock = threading.Lock()

    def _limit(self) -> float:
        if self.started >= len(self.moments):
            return math.inf
        upcoming = self.moments[self.started]
        return (self.moments[self.started - 1] + upcoming) / 2 if self.applying else upcoming

    def now(self) -> float:
        with self.lock:
            t = time.time()
            self.clock = max(self.clock, min(self.clock + t - self.ticked, self._limit()))
            self.ticked = t
            return self.clock

    @property
    def lag_s(self) -> float:
        return time.time() - self.t0 - self.now()

    def wait_until(self, moment: float, stop: threading.Event) -> bool:
        """False if `stop` came first."""
        while (ahead := moment - self.now()) > 0:
            if stop.wait(min(ahead, 0.2)):
                return False
        return not stop.is_set()

    def fault_started(self) -> None:
        self.now()
        with self.lock:
            self.started += 1
            self.applying = True

    def fault_over(self) -> None:
        self.now()
        with self.lock:
            self.applying = False


def run_clients(jobs: list[Job], url: str, t0: float, pacer: Pacer, stop: threading.Event,
                threads: int) -> list[threading.Thread]:
    queue = collections.deque(jobs)
    lock = threading.Lock()

    def client_loop() -> None:
        # Longer than the API's wait for Kafka (max_block_ms, 10 s), so its 503 is seen.
        with httpx.Client(timeout=15.0) as client:
            while not stop.is_set():
                with lock:
                    if not queue:
                        return
                    job = queue.popleft()
                if not pacer.wait_until(job.at, stop):
                    return
                submit_until_accepted(client, url, job, t0, stop)

    pool = [threading.Thread(target=client_loop, name=f"client-{i}", daemon=True) for i in range(threads)]
    for thread in pool:
        thread.start()
    return pool


# --- faults -------------------------------------------------------------------------

class Chaos:
    """Applies the fault schedule to the fleet and its own infrastructure, restarts fleet
    processes that exit on their own, and records every event in `timeline`.

    Two threads use it: the faults (`run_faults`) and the supervisor (`supervise`). Every
    process is started under `lock`, and never once `close` was called, so that the
    clean-up, which closes first, stops everything that was ever started."""

    def __init__(self, fleet: Fleet, daemons: dict[str, Daemon], rng: random.Random, t0: float) -> None:
        self.fleet, self.daemons, self.rng, self.t0 = fleet, daemons, rng, t0
        self.timeline: list[dict] = []
        self.lock = threading.Lock()
        self.closed = False

    def close(self) -> None:
        with self.lock:
            self.closed = True

    def record(self, event: str, target: str, name: str, pid: Optional[int], **extra) -> None:
        entry = {"t": round(time.time() - self.t0, 2), "event": event, "target": target, "name": name, "pid": pid,
                 **extra}
        self.timeline.append(entry)
        print(f"  t={entry['t']:7.1f}s {event:8} {name} (pid {pid}) {extra or ''}", flush=True)

    def live(self, role: str) -> list[str]:
        return sorted(n for n, p in self.fleet.procs.items()
                      if n.startswith(role + "-") and p.poll() is None and n not in self.fleet.killed)

    def start(self, role: str) -> Optional[str]:
        with self.lock:
            if self.closed:
                return None
            name = self.fleet.start(role)
            self.record("restart", role, name, self.fleet.procs[name].pid)
        return name

    def hit(self, role: str, sig: int) -> Optional[tuple[str, subprocess.Popen]]:
        """Signal one of the role's live processes, chosen by the seed; it is marked
        killed first, so the supervisor does not restart it."""
        with self.lock:
            live = self.live(role)
            if not live:
                self.record("skipped", role, role, None, why="none running")
                return None
            name = self.rng.choice(live)
            proc = self.fleet.procs[name]
            self.fleet.killed.add(name)
            proc.send_signal(sig)
            self.record("sigkill" if sig == signal.SIGKILL else "sigterm", role, name, proc.pid)
        return name, proc

    def apply(self, kind: str) -> None:
        verb, target = kind.split("-", 1)
        if target in ("kafka", "redis"):
            self.restart_daemon(self.daemons["kafka" if target == "kafka" else "redis-state"])
            return
        hit = self.hit(target, signal.SIGTERM if verb == "drain" else signal.SIGKILL)
        if hit is None:
            return
        name, proc = hit
        if verb == "drain":
            try:
                proc.wait(timeout=DRAIN_EXIT_S)
                # rc 0: it drained; -15: SIGTERM came before its handler was installed.
                self.record("drained" if proc.returncode == 0 else "exited", target, name, proc.pid,
                            rc=proc.returncode)
            except subprocess.TimeoutExpired:
                proc.kill()
                self.record("sigkill", target, name, proc.pid, why="did not drain in time")
        else:
            proc.wait(timeout=30)
            time.sleep(self.rng.uniform(0.5, 3.0))
        name = self.start(target)
        if name is not None:
            self.wait_ready(target, name)

    def restart_daemon(self, daemon: Daemon) -> None:
        pid = daemon.kill()
        self.record("sigkill", daemon.name, daemon.name, pid)
        time.sleep(self.rng.uniform(0.5, 3.0))
        with self.lock:
            if self.closed:
                return
            pid = daemon.spawn()
            self.record("restart", daemon.name, daemon.name, pid)
        daemon.wait_ready()
        self.record("ready", daemon.name, daemon.name, pid)

    def wait_ready(self, role: str, name: str, timeout: float = 90.0) -> None:
        """Until the restarted process serves. A scheduler has nothing to probe."""
        if role == "scheduler":
            return
        pid = self.fleet.procs[name].pid
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.serves(role, pid):
                self.record("ready", role, name, pid)
                return
            time.sleep(0.3)
        self.record("not-ready", role, name, pid, timeout_s=timeout)

    def serves(self, role: str, pid: int) -> bool:
        """The API answers /readyz; the worker heartbeats (a worker id is host-pid-random)."""
        try:
            if role == "api":
                return httpx.get(f"{self.fleet.url}/readyz", timeout=2).status_code == 200
            beating = registry.live(self.fleet.redis, self.fleet.keys)
            return str(pid) in {b.worker_id.rsplit("-", 2)[-2] for b in beating}
        except (redis.RedisError, httpx.HTTPError):
            return False

    def supervise(self, stop: threading.Event) -> None:
        """Restart fleet processes that exit without being killed, as a supervisor would
        (no more than one restart per SUPERVISOR_BACKOFF_S, so a crash loop is visible
        in the timeline without flooding the machine)."""
        last_restart: dict[str, float] = {}
        while not stop.wait(0.5):
            with self.lock:
                if self.closed:
                    return
                for name, proc in list(self.fleet.procs.items()):
                    if proc.poll() is None or name in self.fleet.killed:
                        continue
                    role = name.rsplit("-", 1)[0]
                    if time.monotonic() - last_restart.get(role, -math.inf) < SUPERVISOR_BACKOFF_S:
                        continue
                    last_restart[role] = time.monotonic()
                    self.fleet.killed.add(name)
                    self.record("exited", role, name, proc.pid, rc=proc.returncode)
                    new = self.fleet.start(role)
                    self.record("restart", role, new, self.fleet.procs[new].pid)


def plan_faults(rng: random.Random, rounds: int, start_s: float, end_s: float) -> list[tuple[float, str]]:
    kinds = [k for k in FAULTS for _ in range(rounds)]
    rng.shuffle(kinds)
    return list(zip(sorted(rng.uniform(start_s, end_s) for _ in kinds), kinds))


def run_faults(chaos: Chaos, schedule: list[tuple[float, str]], pacer: Pacer, stop: threading.Event) -> None:
    """One fault at a time, each at its moment on the pacer's clock (or as soon as the
    one before it is over)."""
    for at, kind in schedule:
        if not pacer.wait_until(at, stop):
            return
        pacer.fault_started()
        try:
            chaos.apply(kind)
        except Exception as exc:  # noqa: BLE001 - e.g. a broker that does not come back: say so, stop
            chaos.record("error", kind, kind, None, error=f"{type(exc).__name__}: {exc}"[:500])
            return
        finally:
            pacer.fault_over()


# --- reading the outcome ------------------------------------------------------------

def states(fleet: Fleet, job_ids: list[str]) -> list[str]:
    with fleet.redis.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hget(fleet.keys.job(job_id), "state")
        return [(s or b"").decode() for s in pipe.execute()]


def wait_terminal(fleet: Fleet, job_ids: list[str], deadline: float) -> None:
    """Until every job is terminal or the deadline (monotonic) passes."""
    while time.monotonic() < deadline:
        try:
            if all(s in TERMINAL for s in states(fleet, job_ids)):
                return
        except redis.RedisError:
            pass
        time.sleep(1.0)


def records(fleet: Fleet, job_ids: list[str]) -> dict[str, dict[str, str]]:
    with fleet.redis.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hgetall(fleet.keys.job(job_id))
        return {j: {k.decode(): v.decode() for k, v in h.items()} for j, h in zip(job_ids, pipe.execute())}


def results_on_kafka(bootstrap: str, topic: str, timeout: float = 120.0) -> dict[str, list[bytes]]:
    """Every message on the results topic, from its start to its end offsets: job id ->
    the values (each a JobResult's JSON as the job store wrote it)."""
    from kafka import KafkaConsumer, TopicPartition
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, client_id="chaos-results")
    out: dict[str, list[bytes]] = collections.defaultdict(list)
    try:
        deadline = time.monotonic() + timeout
        while not consumer.partitions_for_topic(topic):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no metadata for {topic}")
            time.sleep(0.2)
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: not read to its end in {timeout:.0f} s")
            for batch in consumer.poll(timeout_ms=500).values():
                for record in batch:
                    out[record.key.decode()].append(record.value)
    finally:
        consumer.close()
    return out


def in_flight(recs: dict[str, dict[str, str]], t0: float, end_s: float) -> dict:
    """How busy the fleet was: the fraction of [0, end_s] with at least one job between
    queued (on Kafka) and finished, the mean number of such jobs, and run times."""
    spans, runs = [], []
    for rec in recs.values():
        timings = json.loads(rec["result"])["timings"] if rec.get("result") else {}
        if timings.get("queued_at") and timings.get("finished_at"):
            spans.append((timings["queued_at"] - t0, timings["finished_at"] - t0))
        if timings.get("started_at") and timings.get("finished_at"):
            runs.append(timings["finished_at"] - timings["started_at"])
    runs.sort()
    covered, reach = 0.0, 0.0
    for start, end in sorted(spans):
        start, end = max(start, reach), min(end, end_s)
        covered += max(0.0, end - start)
        reach = max(reach, end)
    return {"in_flight_coverage": round(covered / max(end_s, 1e-9), 3),
            "mean_in_flight": round(sum(min(e, end_s) - s for s, e in spans) / max(end_s, 1e-9), 2),
            "run_s_p50": round(runs[len(runs) // 2], 3) if runs else None,
            "run_s_p90": round(runs[len(runs) * 9 // 10], 3) if runs else None}


def summarize(jobs: list[Job], recs: dict[str, dict[str, str]], copies: dict[str, list[bytes]]) -> dict:
    by_state = collections.Counter(recs[j.job_id].get("state", "missing") for j in jobs)
    failed_by: collections.Counter = collections.Counter()
    problems, beyond_ids, beyond, attempt_known, over_one, beyond_upper = [], [], 0, True, 0, 0
    for job in jobs:
        rec = recs[job.job_id]
        state, attempts = rec.get("state", "missing"), int(rec.get("attempts") or 0)
        result = json.loads(rec["result"]) if rec.get("result") else {}
        if state != "done" and state in TERMINAL:
            failed_by[f"{state}:{(result.get('error') or {}).get('code', '-')}"] += 1
        if state != "done":
            problems.append({"job_id": job.job_id, "state": state, "attempts": attempts,
                             "admitted_by": rec.get("admitted_by"), "worker": rec.get("worker"),
                             "error": result.get("error"), "client_answers": dict(job.answers),
                             "accepted_at": job.accepted_at, "planned_at": round(job.at, 2)})
        over_one += attempts > 1
        beyond_upper += max(0, attempts - 1)
        if "attempt" in result:
            extra = max(0, attempts - int(result["attempt"]))
            beyond += extra
            if extra:
                beyond_ids.append(job.job_id)
        elif state == "done":
            attempt_known = False
    distinct = {j: set(v) for j, v in copies.items()}
    terminal_ids = [j.job_id for j in jobs if recs[j.job_id].get("state") in TERMINAL]
    rewritten = sorted(j for j, v in distinct.items() if len(v) > 1)
    return {
        "jobs": len(jobs),
        "done": by_state["done"],
        "failed": sum(failed_by.values()),
        "lost": sum(1 for j in jobs if recs[j.job_id].get("state") not in TERMINAL),
        "executions_beyond_one": beyond if attempt_known else None,
        "jobs_with_attempts_over_one": over_one,
        "attempts_beyond_one_upper_bound": beyond_upper,
        "results_rewritten": len(rewritten),
        "result_duplicates": sum(len(copies[j]) - len(v) for j, v in distinct.items()),
        "results_missing_on_kafka": sum(1 for j in terminal_ids if j not in copies),
        "kafka_differs_from_store": sum(1 for j in terminal_ids if j in distinct
                                        and distinct[j] != {recs[j].get("result", "").encode()}),
        "states": dict(by_state),
        "failed_by": dict(failed_by),
        "finish_reasons": dict(collections.Counter(json.loads(r["result"]).get("finish_reason") or "-"
                                                   for r in recs.values() if r.get("result"))),
        "never_accepted": sum(1 for j in jobs if j.accepted_at is None),
        "client_answers": dict(sum((j.answers for j in jobs), collections.Counter())),
        # Job ids to look up in jobs.json and the logs (50 of each at most).
        "problems": problems[:50],
        "executed_beyond_one_ids": beyond_ids[:50],
        "rewritten_ids": rewritten[:50],
    }


# --- the run ------------------------------------------------------------------------

@dataclass
class Outcome:
    t0: float  # unix seconds of the first planned submission
    submitted_s: float  # every job accepted (or given up) and every fault applied
    ended_s: float  # every job terminal, or the drain deadline
    timeline: list[dict]
    records: dict[str, dict[str, str]]  # job id -> its hash in the state Redis
    copies: dict[str, list[bytes]]  # job id -> its results on Kafka
    outbox_left: int
    pace_lag_s: float  # how long the submissions waited for faults that ran late (Pacer)


def run(jobs: list[Job], schedule: list[tuple[float, str]], rng: random.Random, *, drain_s: float,
        clients: int, tmp: Path) -> Outcome:
    """Start the run's infrastructure and fleet, submit, apply the faults, wait, read the
    outcome; stop everything, also on Ctrl-C, SIGTERM or an error."""
    home, log_dir = tmp / "home", tmp / "logs"
    home.mkdir()
    log_dir.mkdir()
    daemons: dict[str, Daemon] = {}
    fleet: Optional[Fleet] = None
    chaos: Optional[Chaos] = None
    stop = threading.Event()
    clean = False
    try:
        daemons["kafka"] = own_kafka(home)
        daemons["redis-state"] = own_redis("state", home, infra_redis.STATE.args)
        daemons["redis-cache"] = own_redis("cache", home, infra_redis.CACHE.args)
        for daemon in daemons.values():
            daemon.spawn()
        for daemon in daemons.values():
            daemon.wait_ready()
        bootstrap = f"{HOST}:{daemons['kafka'].port}"
        fleet = Fleet(prefix="chaos", kafka=bootstrap, redis_url=f"redis://{HOST}:{daemons['redis-state'].port}/0",
                      cache_redis_url=f"redis://{HOST}:{daemons['redis-cache'].port}/0", log_dir=log_dir,
                      extra_env={"KVFLEET_TENANTS": json.dumps(TENANTS), "KVFLEET_HOME": str(home)})
        for role in ("api", "scheduler", *["worker"] * WORKERS):
            fleet.start(role)
        fleet.wait_ready(workers=WORKERS, timeout=180)
        t0 = time.time()
        chaos = Chaos(fleet, daemons, rng, t0)
        pacer = Pacer(t0, [at for at, _ in schedule])
        threads = run_clients(jobs, fleet.url, t0, pacer, stop, clients)
        faults = threading.Thread(target=run_faults, args=(chaos, schedule, pacer, stop), name="faults",
                                  daemon=True)
        supervisor = threading.Thread(target=chaos.supervise, args=(stop,), name="supervisor", daemon=True)
        faults.start()
        supervisor.start()
        faults.join()  # each fault's waits are bounded
        # Clients retry until their job is taken; past this, what is not taken counts as lost.
        give_up = time.monotonic() + drain_s
        while any(t.is_alive() for t in threads) and time.monotonic() < give_up:
            time.sleep(0.5)
        submitted_s = time.time() - t0
        print(f"  t={submitted_s:7.1f}s submissions and faults over; waiting up to {drain_s:.0f} s for every job",
              flush=True)
        wait_terminal(fleet, [j.job_id for j in jobs], time.monotonic() + drain_s)
        ended_s = time.time() - t0
        stop.set()
        chaos.close()
        # The results relay empties the outbox moments after the jobs end.
        outbox_deadline = time.monotonic() + 60
        while fleet.redis.xlen(fleet.keys.results_outbox) and time.monotonic() < outbox_deadline:
            time.sleep(0.5)
        outcome = Outcome(t0, submitted_s, ended_s, chaos.timeline, records(fleet, [j.job_id for j in jobs]),
                          results_on_kafka(bootstrap, constants.results_topic(fleet.env["KVFLEET_TOPIC_PREFIX"])),
                          fleet.redis.xlen(fleet.keys.results_outbox), round(pacer.lag_s, 1))
        clean = True
        return outcome
    finally:
        stop.set()
        if chaos is not None:
            chaos.close()  # from here on no thread starts a process
        if fleet is not None and clean:
            fleet.stop()
        elif fleet is not None:  # interrupted or failed: no drain, nothing to keep
            for proc in fleet.procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        for daemon in daemons.values():
            if clean:
                daemon.stop()
            elif daemon.proc is not None and daemon.proc.poll() is None:
                daemon.kill()
        print(f"fleet logs: {log_dir}", flush=True)


def git_head() -> Optional[str]:
    """The commit the fleet ran, with "+dirty" for uncommitted changes; None outside git."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="about 500 jobs in about 3 minutes")
    parser.add_argument("--jobs", type=int, default=None, help="jobs to submit (default 2,000; 500 with --quick)")
    parser.add_argument("--window-s", type=float, default=None,
                        help="submission window, seconds (default: 5 jobs a second)")
    parser.add_argument("--rounds", type=int, default=None, help="faults of each kind (default 4; 2 with --quick)")
    parser.add_argument("--drain-s", type=float, default=None,
                        help="how long every job has to end after the submissions and faults are over "
                             "(default 300; 150 with --quick)")
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--clients", type=int, default=8, help="client threads")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    n = args.jobs or (500 if args.quick else 2_000)
    window = args.window_s or n / 5.0
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 4)
    drain_s = args.drain_s or (150.0 if args.quick else 300.0)
    rng = random.Random(args.seed)
    jobs = plan_jobs(rng, n, window, args.seed)
    # Within the window, so that jobs are submitted after each fault too (see Pacer).
    schedule = plan_faults(rng, rounds, 0.1 * window, 0.95 * window)
    tmp = Path(tempfile.mkdtemp(prefix="kvfleet-chaos-"))
    print(f"chaos run: {n} jobs over {window:.0f} s, {len(schedule)} faults, seed {args.seed}; "
          f"logs in {tmp / 'logs'}", flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM cleans up like Ctrl-C
    load_before = os.getloadavg()
    outcome = run(jobs, schedule, rng, drain_s=drain_s, clients=args.clients, tmp=tmp)
    # Every job's record and client side, beside the logs, for a post-mortem.
    (tmp / "jobs.json").write_text(json.dumps({j.job_id: {**outcome.records[j.job_id], "client": {
        "planned_at": j.at, "accepted_at": j.accepted_at, "answers": j.answers}} for j in jobs}, indent=1))

    recs, t0 = outcome.records, outcome.t0
    report = summarize(jobs, recs, outcome.copies)
    report.update({
        "seed": args.seed, "quick": args.quick, "workers": WORKERS, "submission_window_s": window,
        "duration_s": round(outcome.ended_s, 1), "submissions_and_faults_over_at_s": round(outcome.submitted_s, 1),
        "jobs_per_s": round(report["done"] / max(outcome.ended_s, 1e-9), 2),
        **in_flight(recs, t0, outcome.ended_s),
        "faults": dict(collections.Counter(k for _, k in schedule)),
        "events": dict(collections.Counter(e["event"] for e in outcome.timeline)),
        "results_outbox_left": outcome.outbox_left,
        "pace_lag_s": outcome.pace_lag_s,
        "load_avg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "timeline": outcome.timeline,
        "commit": git_head(),
        "command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *sys.argv[1:]]),
        "logs": str(tmp / "logs"),
        "job_records": str(tmp / "jobs.json"),
    })
    if report["executions_beyond_one"] is None:
        report["notes"] = ["JobResult has no `attempt` field yet: executions_beyond_one is null; "
                           "jobs_with_attempts_over_one counts jobs a worker started more than once (a takeover "
                           "after a killed or drained run counts too, so it is an upper bound)."]
    print_table(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chaos.json").write_text(json.dumps(report, indent=2) + "\n")
    finished = sorted(t - t0 for r in recs.values() if r.get("state") in TERMINAL and r.get("result")
                      and (t := json.loads(r["result"])["timings"].get("finished_at")))
    plot([j.accepted_at for j in jobs if j.accepted_at is not None], finished, outcome.timeline, report,
         args.out / "chaos.png")


def print_table(report: dict) -> None:
    print(f"\n{'figure':30} {'value':>10} {'target':>8}")
    for name, target in (("jobs", ""), ("done", ""), ("failed", "0"), ("lost", "0"),
                         ("executions_beyond_one", ""), ("jobs_with_attempts_over_one", ""),
                         ("results_rewritten", "0"), ("result_duplicates", ""), ("results_missing_on_kafka", "0"),
                         ("never_accepted", "0"), ("duration_s", ""), ("jobs_per_s", ""),
                         ("in_flight_coverage", ""), ("mean_in_flight", ""), ("run_s_p50", ""),
                         ("run_s_p90", "")):
        value = report[name]
        print(f"{name:30} {'n/a' if value is None else value:>10} {target:>8}")
    print(f"faults: {report['faults']}; events: {report['events']}")
    if report["failed_by"]:
        print(f"failed by state:code: {report['failed_by']}")
    for problem in report["problems"][:10]:
        print(f"  {problem}")


def plot(accepted: list[float], finished: list[float], timeline: list[dict], report: dict, path: Path) -> None:
    """Jobs accepted and terminal over time; each fault a vertical line in its target's
    colour, shaded until its replacement was started."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    for times, label in ((sorted(accepted), "accepted by the API"), (finished, "terminal (finished_at)")):
        ax.step(times, range(1, len(times) + 1), where="post", label=label)
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"][2:]
    colors = dict(zip(("scheduler", "worker", "api", "kafka", "redis-state"), palette))
    styles = {"sigkill": "-", "sigterm": "--", "exited": ":"}
    seen = set()
    for i, event in enumerate(timeline):
        if event["event"] not in styles:
            continue
        color, label = colors.get(event["target"], "grey"), f"{event['event']} {event['target']}"
        ax.axvline(event["t"], color=color, linestyle=styles[event["event"]], alpha=0.8,
                   label=None if label in seen else label)
        seen.add(label)
        # Shaded until the replacement serves (or, without a "ready", was started).
        after = [e for e in timeline[i + 1:] if e["target"] == event["target"]]
        back = next((e["t"] for e in after if e["event"] == "ready"), None) or next(
            (e["t"] for e in after if e["event"] == "restart"), None)
        if back is not None:
            ax.axvspan(event["t"], back, color=color, alpha=0.12)
    ax.set_xlabel("seconds since the first submission")
    ax.set_ylabel("jobs")
    ax.set_title(f"chaos: {report['jobs']} jobs, {report['done']} done, {report['failed']} failed, "
                 f"{report['lost']} lost, {report['results_rewritten']} results rewritten (seed {report['seed']})")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
