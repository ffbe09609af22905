"""The job path of bench/fleet.py: jobs through the whole fleet against the same jobs on
one engine, and the overhead one job pays on an idle fleet.

Engine alone (the baseline): this process loads the model, builds an `Engine` with the
workers' default EngineConfig, and submits all the jobs at once (`Engine.submit`), the
most a single engine can do with them; torch runs with one thread and with one per core,
and the faster run is the baseline.

Through the fleet: the jobs are produced straight to Kafka (the normal topic, kafka-python,
acks=all), the scheduler admits them, the workers run them, and the run ends when every
job's terminal result has reached the results topic (the path a Kafka client waits on,
after the job store wrote it). Throughput counts from the first produce to the last
result. Both sides run greedy, so they generate the same tokens.

Overhead: one 1-token job at a time through the HTTP API on the idle fleet (POST
/v1/jobs, then GET ?wait= until it ends), its client round trip minus the engine's own
time for it (the stored `started_at` .. `finished_at`, which the engine reports).

Every hop (`HOPS`), under load and idle: each job's moments from its stored timings
(queued, admitted), the scheduler's "admitted" log line (sent: the Celery send
returned), the worker's "done" line (delivered to a task thread, picked by its thread,
begun, in the engine, first step, finished, stored) and its arrival here (on the
results topic, or the client's long poll); the median of each span, from the fleet's
log files.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator, Sequence

import httpx
import msgspec
import redis

from kvfleet.contracts import JobRequest, JobResult, JobState, Priority, Sampling, decode_result, encode
from kvfleet.kafka import make_producer
from kvfleet.settings import EngineConfig, KafkaSettings

GREEDY = Sampling(temperature=0.0)
#: The short jobs of the issue: prompts of 16..128 tokens (byte tokenizer ids), one token out.
PROMPT_LENS = (16, 128)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randint(*PROMPT_LENS))] for _ in range(n)]


def engine_alone(model_source: str, jobs: Sequence[list[int]], max_new_tokens: int) -> dict:
    """The same jobs on one engine in this process, with every core: the better of torch
    using one thread and using all (a small model loses to its own threading), so the
    baseline is the strongest one engine gives."""
    import torch

    from workers.engine import Engine
    from workers.model.loader import load_model

    loaded = load_model(model_source)
    runs = []
    for threads in sorted({1, len(os.sched_getaffinity(0))}):
        torch.set_num_threads(threads)
        with Engine(loaded, EngineConfig()) as engine:
            engine.generate("warm-up", jobs[0][:8], 2, GREEDY)
            start = time.perf_counter()
            handles = [engine.submit(f"j{i}", p, max_new_tokens, GREEDY) for i, p in enumerate(jobs)]
            tokens = sum(len(h.result().tokens) for h in handles)
            wall = time.perf_counter() - start
        runs.append({"jobs": len(jobs), "tokens": tokens, "wall_s": wall, "jobs_per_s": len(jobs) / wall,
                     "tokens_per_s": tokens / wall, "torch_threads": threads})
    best = max(runs, key=lambda r: r["tokens_per_s"])
    return {**best, "by_threads": runs}


class Results:
    """Terminal results from the fleet's results topic, from its end when built."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        from kafka import KafkaConsumer, TopicPartition

        self.arrived: dict[str, float] = {}
        self.consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None,
                                      fetch_max_wait_ms=50)
        partitions = self.consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        self.consumer.assign(tps)
        self.consumer.seek_to_end(*tps)
        for tp in tps:
            self.consumer.position(tp)  # resolve the end now, before anything is produced

    def collect(self, wanted: set[str], timeout_s: float, progress: Callable[[int], None]) -> dict[str, JobResult]:
        """Every wanted job's first result; `arrived` holds when each reached this process."""
        got: dict[str, JobResult] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(wanted):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(wanted) - len(got)} of {len(wanted)} results missing after {timeout_s:.0f} s")
            for records in self.consumer.poll(timeout_ms=200).values():
                for record in records:
                    result = decode_result(record.value)
                    if result.job_id in wanted and result.job_id not in got:
                        got[result.job_id] = result
                        self.arrived[result.job_id] = time.time()
                        if len(got) % 500 == 0:
                            progress(len(got))
        return got

    def close(self) -> None:
        self.consumer.close()


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU time (user + system) so far of each named process and its children."""
    import psutil

    out = {}
    for name, pid in pids.items():
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        total = 0.0
        for proc in procs:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.NoSuchProcess:
                pass
        out[name] = total
    return out


def infra_pids(infra: dict[str, str]) -> dict[str, int]:
    """The Kafka broker's and both Redis servers' pids, found by their command lines."""
    import psutil

    ports = {infra["redis-state"].rsplit(":", 1)[1].split("/")[0]: "redis-state",
             infra["redis-cache"].rsplit(":", 1)[1].split("/")[0]: "redis-cache"}
    out = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(proc.info["cmdline"] or ())
        if "kafka.Kafka" in line:
            out["kafka"] = proc.info["pid"]
        elif "redis-server" in line:
            for port, name in ports.items():
                if f":{port}" in line:
                    out[name] = proc.info["pid"]
    return out


#: Where a job's time goes under load, from its stored timings: (name, from, to).
LOAD_HOPS = (("queued -> admitted (Kafka, scheduler, waiting for a slot)", "queued_at", "admitted_at"),
             ("admitted -> started (Celery, worker)", "admitted_at", "started_at"),
             ("started -> finished (engine)", "started_at", "finished_at"))

#: Every hop of a job, in order: (name, from, to), each moment one of `moments`' keys.
HOPS = (("queued -> admitted (Kafka read, policy, waiting for a slot)", "queued", "admitted"),
        ("admitted -> sent (admission Lua, Celery send)", "admitted", "sent"),
        ("sent -> delivered (Celery queue, worker's consumer, task thread)", "sent", "delivered"),
        ("delivered -> picked (a thread for a message's 2nd.. job)", "delivered", "picked"),
        ("picked -> begun (begin Lua)", "picked", "begun"),
        ("begun -> engine in (stream start, prefix step)", "begun", "engine_in"),
        ("engine in -> engine started (a step boundary, room in the batch)", "engine_in", "engine_started"),
        ("engine started -> finished (the job's steps)", "engine_started", "engine_finished"),
        ("finished -> stored (stream end, finish Lua)", "engine_finished", "stored"),
        ("stored -> on the results topic (relay, Kafka, this consumer)", "stored", "arrived"))


def log_lines(log_dir: Path, msg: str) -> Iterator[dict]:
    """The fleet's JSON log lines whose message is `msg`."""
    needle = f'"msg":"{msg}"'
    for path in sorted(log_dir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if needle in line:
                try:
                    yield json.loads(line)
                except ValueError:
                    continue  # a line cut by a process's death


def moments(log_dir: Path, got: dict[str, JobResult], arrived: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per job, the unix time of each moment of `HOPS`: from its stored timings, the
    scheduler's "admitted" and the worker's "done" log lines, and its arrival here."""
    out = {job_id: {"queued": r.timings.queued_at, "admitted": r.timings.admitted_at, "arrived": arrived.get(job_id)}
           for job_id, r in got.items()}
    for line in log_lines(log_dir, "admitted"):
        if line.get("job_id") in out and "sent_at" in line:
            out[line["job_id"]]["sent"] = line["sent_at"]
    for line in log_lines(log_dir, "done"):
        if line.get("job_id") in out and isinstance(line.get("at"), dict):
            out[line["job_id"]].update(line["at"])
    return out


def hop_medians(per_job: dict[str, dict[str, float]], average=statistics.median) -> dict[str, float]:
    """Median ms (or `average`'s) of each hop over the jobs that have both of its moments."""
    out = {}
    for name, a, b in HOPS:
        spans = [m[b] - m[a] for m in per_job.values() if m.get(a) is not None and m.get(b) is not None]
        out[name] = 1000 * average(spans) if spans else float("nan")
    return out


#: The engine's own clocks, summed over the workers (workers/engine/metrics.py).
ENGINE_CLOCKS = ("kvfleet_engine_step_seconds_sum", "kvfleet_engine_step_cpu_seconds_total",
                 "kvfleet_engine_step_cpu_wait_seconds_total")


#: A worker's Prometheus samples, {'name{labels}': value} (tests/fleet.py `Fleet.metrics`).
Samples = Callable[[], dict[str, float]]


def engine_clocks(workers: Sequence[Samples]) -> dict[str, float]:
    """ENGINE_CLOCKS, each summed over the workers."""
    samples = [read() for read in workers]
    return {name: sum(s.get(name, 0.0) for s in samples) for name in ENGINE_CLOCKS}


def engine_shares(before: dict[str, float], after: dict[str, float], wall_s: float, workers: int) -> dict:
    """Where the engines' time went during a run: the share of it in steps (the rest the
    step loops waited for work, or scheduled and delivered), and a step's wall time over
    its thread's CPU time (above 1: the step waited, in a worker for the GIL its other
    threads held, or for a core), and the share of its wall time it waited for a core."""
    def spent(name: str) -> float:
        return after[name] - before[name]

    step = spent("kvfleet_engine_step_seconds_sum")
    cpu = spent("kvfleet_engine_step_cpu_seconds_total")
    return {"engine_step_share": step / (wall_s * workers),
            "engine_step_wall_over_cpu": step / cpu if cpu else float("nan"),
            "engine_step_cpu_wait_share": spent("kvfleet_engine_step_cpu_wait_seconds_total") / step if step else float("nan")}


class LedgerSampler:
    """The jobs holding a reservation in the ledger (`HLEN`), every 20 ms while running:
    how many of the fleet's slots the run kept taken."""

    def __init__(self, redis_url: str, ledger_key: str) -> None:
        self._client = redis.Redis.from_url(redis_url)
        self._key = ledger_key
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ledger-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.samples.append(self._client.hlen(self._key))

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        busy = sorted(n for n in self.samples if n)
        if not busy:
            return {}
        return {"ledger_jobs_p50": busy[len(busy) // 2], "ledger_jobs_p90": busy[int(0.9 * (len(busy) - 1))],
                "ledger_jobs_max": busy[-1]}


def run_spread(done: Sequence[JobResult], sent_at: float) -> dict:
    """How the run began and ended: seconds from the first send (`sent_at`) to the first job
    admitted and started, and each worker's jobs and last finish (a worker that ends
    well before the others had fewer of the jobs: its core idled while they finished)."""
    by_worker: dict[str, list[JobResult]] = {}
    for r in done:
        by_worker.setdefault(r.worker or "?", []).append(r)
    ends = sorted(max(r.timings.finished_at for r in rs) - sent_at for rs in by_worker.values())
    return {"first_admitted_s": min(r.timings.admitted_at for r in done) - sent_at,
            "first_started_s": min(r.timings.started_at for r in done) - sent_at,
            "jobs_by_worker": sorted(len(rs) for rs in by_worker.values()),
            "last_finished_s_by_worker": ends}


def through_fleet(bootstrap: str, topic: str, results_topic: str, tenant: str, model: str,
                  jobs: Sequence[list[int]], max_new_tokens: int, *, label: str,
                  pids: dict[str, int] | None = None, log_dir: Path | None = None,
                  worker_metrics: Sequence[Samples] = (), ledger: tuple[str, str] | None = None) -> dict:
    """Produce every job to Kafka at once; wait for every result on the results topic.
    With `pids` ({name: pid}), also the CPU ms per job each of those processes spent;
    with `log_dir` (the fleet's logs), the median and the mean of each of its `HOPS`;
    with `worker_metrics` (each worker's samples), `engine_shares`; with `ledger` (the
    state Redis URL and the ledger's key), the jobs holding a reservation (LedgerSampler)."""
    results = Results(bootstrap, results_topic)
    cpu_before = cpu_seconds(pids or {})
    clocks_before = engine_clocks(worker_metrics)
    sampler = LedgerSampler(*ledger) if ledger else None
    producer = make_producer(KafkaSettings(bootstrap=bootstrap), client_id="bench-fleet-jobs")
    try:
        now = time.time()
        requests = [JobRequest(job_id=str(uuid.uuid4()), tenant=tenant, priority=Priority.NORMAL, model=model,
                               max_new_tokens=max_new_tokens, submitted_at=now, prompt_tokens=p, sampling=GREEDY)
                    for p in jobs]
        payloads = [(r.job_id, encode(r)) for r in requests]
        # A client's producer is connected and knows the topic before it sends: without
        # this the clock would count the new producer's first metadata fetch (~100 ms).
        producer.partitions_for(topic)
        start, started_at = time.perf_counter(), time.time()
        for job_id, value in payloads:
            producer.send(topic, key=tenant.encode(), value=value)
        producer.flush(timeout=60)
        produced = time.perf_counter() - start
        got = results.collect({r.job_id for r in requests}, 600,
                              lambda n: print(f"[bench] {label}: {n}/{len(requests)} results", flush=True))
        wall = time.perf_counter() - start
    finally:
        producer.close(timeout=5)
        results.close()
    cpu_after = cpu_seconds(pids or {})
    held = sampler.stop() if sampler else {}
    engine = engine_shares(clocks_before, engine_clocks(worker_metrics), wall, len(worker_metrics)) \
        if worker_metrics else {}
    done = [r for r in got.values() if r.status is JobState.DONE]
    tokens = sum(len(r.tokens) for r in done)
    attempts = [r.attempt for r in done]
    hops = {name: 1000 * statistics.median(getattr(r.timings, b) - getattr(r.timings, a) for r in done)
            for name, a, b in LOAD_HOPS} if done else {}
    every_hop, every_hop_mean = {}, {}
    spread = run_spread(done, started_at) if done else {}
    if log_dir is not None and done:
        time.sleep(1.0)  # the workers log a job's "done" line just after the result it waits on
        per_job = moments(log_dir, {r.job_id: r for r in done}, results.arrived)
        every_hop, every_hop_mean = hop_medians(per_job), hop_medians(per_job, statistics.fmean)
    return {"jobs": len(requests), "done": len(done), "tokens": tokens, "wall_s": wall, "produce_s": produced,
            "hops_median_ms": hops, "every_hop_median_ms": every_hop, "every_hop_mean_ms": every_hop_mean,
            **engine, **held, **spread,
            "jobs_per_s": len(requests) / wall, "tokens_per_s": tokens / wall,
            "runs_beyond_one": sum(max(0, a - 1) for a in attempts),
            "cpu_ms_per_job": {name: 1000 * (cpu_after[name] - cpu_before[name]) / len(requests)
                               for name in cpu_after if name in cpu_before},
            "not_done": sorted({r.status.value for r in got.values()} - {JobState.DONE.value})}


def overhead(url: str, api_key: str, n: int, seed: int, log_dir: Path | None = None) -> dict:
    """One 1-token job at a time on the idle fleet: client round trip, engine time, and the
    hops (with `log_dir`, every one of `HOPS`, the last one to the client's long poll)."""
    rows = []
    got: dict[str, JobResult] = {}
    seen_at: dict[str, float] = {}
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        for i, prompt in enumerate(prompts(n + 3, seed)):
            began = time.time()
            answer = client.post("/v1/jobs", json={"prompt_tokens": prompt, "max_new_tokens": 1})  # greedy
            accepted = time.time()
            answer.raise_for_status()
            result = msgspec.convert(
                client.get(f"/v1/jobs/{answer.json()['job_id']}", params={"wait": 30}).json(), JobResult)
            seen = time.time()
            assert result.status is JobState.DONE, result
            t = result.timings
            if i < 3:
                continue  # warm-up: connections, code paths
            got[result.job_id], seen_at[result.job_id] = result, seen
            rows.append({
                "total (client)": seen - began,
                "engine (started -> finished)": t.finished_at - t.started_at,
                "POST -> 202 (API)": accepted - began,
                "queued -> admitted (Kafka, scheduler)": t.admitted_at - t.queued_at,
                "admitted -> started (Celery, worker)": t.started_at - t.admitted_at,
                "finished -> client (long poll)": seen - t.finished_at,
            })
    median = {name: 1000 * statistics.median(r[name] for r in rows) for name in rows[0]}
    over = [1000 * (r["total (client)"] - r["engine (started -> finished)"]) for r in rows]
    every_hop = {}
    if log_dir is not None:
        time.sleep(1.0)  # the "done" log lines of the last jobs
        every_hop = hop_medians(moments(log_dir, got, seen_at))
    return {"jobs": len(rows), "overhead_p50_ms": statistics.median(over),
            "overhead_p90_ms": statistics.quantiles(over, n=10)[-1], "hops_median_ms": median,
            "every_hop_median_ms": every_hop}
