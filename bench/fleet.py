"""Fleet benchmark: how many jobs the front door takes, against a minimal endpoint, and
how fast jobs go through the fleet, against the same jobs on one engine.

    python bench/fleet.py [--quick] [--part all|front|jobs] [--rounds N] [--api-workers N]
                          [--workers N] [--out bench/results]

The job path (`--part jobs`) is bench/fleet_jobs.py's docstring: 1-token and 128-token
jobs (and 8, 32 in a full run) produced to Kafka, fleet jobs/s over one engine's with
the same cores, run alone before the fleet starts and again after it stops, the mean
of the two (`short_jobs_fleet_over_engine`, target >= 0.5;
`long_jobs_fleet_over_engine` in tokens/s, target >= 0.9), and `overhead_p50_ms`, one
1-token job's client round trip on the idle fleet minus the engine's time (target <= 10),
and the median of every hop of a job (queued, admitted, sent, delivered, begun, in the
engine, finished, stored, on the results topic), under load and idle.

The front door (`--part front`):

A real fleet (the API, one scheduler, one worker with the tiny built-in model, on the
local Kafka and Redis, every setting at its default but the backlog bounds) takes small
jobs from `wrk`: `POST /v1/jobs` with a 32-character text prompt and max_new_tokens 4,
an API key, a tenant whose quota is charged and never runs out. The API runs
`--api-workers` processes (`KVFLEET_API_WORKERS`; default 1, the API's own default), and
the fleet processes the jobs meanwhile. In the same run the same `wrk` drives `bench/minimal_api.py`, the least an
endpoint can do to take a job (one Redis hash write, one produce with acks=all on the
API's own librdkafka producer, awaited through the event loop, in one uvicorn process).
It queues the very job the API recorded for the same body, under a new id, to the same
fleet, so the fleet runs both endpoints' jobs alike and each endpoint shares the two
cores with a fleet at work (each round's `fleet_cpu_cores` says how much it used).

The load generator is wrk (C, the Debian package; installed here when missing, never
needed by the test suite): two threads that use a few percent of a core at these rates.

Figures (medians over interleaved rounds of 64 connections, `wrk -t2 -c64`):
`api_submits_per_s_at_64`, `api_submit_p50_ms_at_64`, `api_submit_p99_ms_at_64`
(target <= 100), the minimal endpoint's, `api_submits_vs_minimal` (target >= 0.7), and
the CPU time each server spent per job (all its processes and threads), which the
machine's other load changes far less than the rates. Then a sweep of offered load
(1..128 connections) for both, the plot; and where the time of one job goes, hop by
hop: the API's steps under load (its `kvfleet_api_submit_step_seconds` histogram) and
one job at a time on the idle fleet, from its stored timings.

Backlog bounds are lifted (a 429, which stays exactly as it is, would be a faster
answer, not a job taken); what the run leaves on Kafka and Redis is deleted at the end.
Prints a table, writes <out>/fleet.json and <out>/fleet.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import redis  # noqa: E402

import kvfleet.infra  # noqa: E402
from kvfleet.constants import Keys, request_topic  # noqa: E402
from kvfleet.contracts import decode_request  # noqa: E402
from kvfleet.kafka import make_admin  # noqa: E402
from kvfleet.settings import KafkaSettings  # noqa: E402
from tests.fleet import Fleet, free_port, wait_for  # noqa: E402  (the integration tests' process launcher)

import fleet_jobs  # noqa: E402  (bench/fleet_jobs.py, beside this file)

API_KEY = "sk-bench-fleet"
TENANTS = {"tenants": [{"name": "bench", "tier": "silver", "tokens_per_minute": 10**12, "api_keys": [API_KEY]}]}
#: A small job: 32 bytes of text (32 tokens with the byte tokenizer), 4 tokens out.
BODY = json.dumps({"prompt": "Say something short about item 7", "max_new_tokens": 4})
#: Backlog bounds far above what a run queues (see the module's docstring).
NO_BACKLOG_BOUND = str(10**9)
CONNECTIONS = 64
SWEEP = (1, 2, 4, 8, 16, 32, 64, 128)

#: wrk's script: the POST, and a JSON line of the figures at the end (latency in µs).
WRK_LUA = """
wrk.method = "POST"
wrk.body = [[%(body)s]]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %(key)s"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRKJSON {"requests": %%d, "duration_us": %%d, "status_errors": %%d, ' ..
    '"socket_errors": %%d, "p50_us": %%d, "p90_us": %%d, "p99_us": %%d, "max_us": %%d}\\n',
    summary.requests, summary.duration, e.status, e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
"""


def ensure_wrk() -> str:
    """The wrk binary, installed from Debian's packages when missing."""
    found = shutil.which("wrk")
    if found:
        return found
    print("[bench] installing wrk (Debian package)")
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    subprocess.run([*sudo, "apt-get", "update", "-qq"], check=True)
    subprocess.run([*sudo, "apt-get", "install", "-y", "-qq", "wrk"], check=True,
                   env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    return shutil.which("wrk") or "/usr/bin/wrk"


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process and all its children, seconds."""
    return fleet_jobs.cpu_seconds({"server": pid}).get("server", 0.0)


def wrk(binary: str, script: Path, url: str, *, connections: int, seconds: float, pid: int,
        fleet_pids: Optional[dict[str, int]] = None) -> dict:
    """One wrk run against the server `pid` (and its children); its figures: jobs
    accepted per second, latency percentiles in ms, errors, the server's CPU per job, and
    the cores the fleet's other processes (`fleet_pids`) used meanwhile: the two servers
    share the machine with them, so a round is only comparable to the other server's if
    the fleet worked as hard during both."""
    threads = min(2, connections)
    fleet_before = sum(fleet_jobs.cpu_seconds(fleet_pids or {}).values())
    cpu_before = cpu_seconds(pid)
    out = subprocess.run([binary, f"-t{threads}", f"-c{connections}", f"-d{seconds:g}s", "--timeout", "10s",
                          "-s", str(script), url], capture_output=True, text=True, check=True).stdout
    cpu = cpu_seconds(pid) - cpu_before
    fleet_cpu = sum(fleet_jobs.cpu_seconds(fleet_pids or {}).values()) - fleet_before
    line = next(line for line in out.splitlines() if line.startswith("WRKJSON "))
    raw = json.loads(line[len("WRKJSON "):])
    seconds_run = raw["duration_us"] / 1e6
    ok = raw["requests"] - raw["status_errors"]
    return {"connections": connections, "requests": raw["requests"], "ok_per_s": ok / seconds_run,
            "p50_ms": raw["p50_us"] / 1000, "p90_ms": raw["p90_us"] / 1000, "p99_ms": raw["p99_us"] / 1000,
            "max_ms": raw["max_us"] / 1000, "non_2xx": raw["status_errors"], "socket_errors": raw["socket_errors"],
            "server_cpu_ms_per_job": 1000 * cpu / max(ok, 1), "server_cpu_cores": cpu / seconds_run,
            "fleet_cpu_cores": fleet_cpu / seconds_run, "load_avg_1m": os.getloadavg()[0]}


def step_totals(fleet: Fleet) -> dict[str, tuple[float, float]]:
    """The API's submit steps so far: {step: (seconds in all, times)} (its Prometheus histogram)."""
    samples = fleet.metrics(fleet.port)
    out = {}
    for key, total in samples.items():
        if key.startswith("kvfleet_api_submit_step_seconds_sum"):
            step = key.split('step="', 1)[1].split('"', 1)[0]
            out[step] = (total, samples.get(key.replace("_sum", "_count"), 0.0))
    return out


def step_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean ms of each step between two readings."""
    out = {}
    for step, (total, count) in after.items():
        total0, count0 = before.get(step, (0.0, 0.0))
        out[step] = 1000 * (total - total0) / (count - count0) if count > count0 else float("nan")
    return out


#: The hops of one job after the API answered, from its stored timings: (name, from, to).
HOPS = (("submitted -> admitted (Kafka, scheduler)", "queued_at", "admitted_at"),
        ("admitted -> started (Celery, worker)", "admitted_at", "started_at"),
        ("started -> first token (engine)", "started_at", "first_token_at"),
        ("first token -> finished (engine)", "first_token_at", "finished_at"))


def one_job_at_a_time(fleet: Fleet, n: int) -> dict[str, float]:
    """Median ms of each hop of `n` jobs run one after the other on the idle fleet."""
    rows: list[dict[str, float]] = []
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=fleet.url, headers=headers, timeout=60) as client:
        for _ in range(n):
            started = time.time()
            answer = client.post("/v1/jobs", content=BODY, headers={"Content-Type": "application/json"})
            accepted = time.time()
            answer.raise_for_status()
            job_id = answer.json()["job_id"]
            result = client.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()
            seen = time.time()
            t = result["timings"]
            row = {"POST -> 202 (API)": accepted - started}
            row.update({name: t[b] - t[a] for name, a, b in HOPS if t.get(a) and t.get(b)})
            row["finished -> client (long poll)"] = seen - t["finished_at"]
            row["total (client)"] = seen - started
            rows.append(row)
    return {name: 1000 * statistics.median(r[name] for r in rows if name in r) for name in rows[0]}


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def cleanup(fleet: Fleet, redis_url: str, kafka: str, topics: list[str]) -> None:
    """Delete what the run left on the shared Kafka and Redis (tens of thousands of jobs)."""
    client = redis.Redis.from_url(redis_url)
    for pattern in (f"{fleet.prefix}:*", f"{fleet.prefix}.*", f"{fleet.prefix}-*"):  # keys, Celery queues
        batch = []
        for key in client.scan_iter(match=pattern, count=5000):
            batch.append(key)
            if len(batch) >= 5000:
                client.unlink(*batch)
                batch = []
        if batch:
            client.unlink(*batch)
    client.close()
    admin = make_admin(KafkaSettings(bootstrap=kafka), client_id="bench-fleet-cleanup")
    try:
        admin.delete_topics([t for t in topics if t in set(admin.list_topics())])
    except Exception as exc:  # noqa: BLE001 - a topic left behind is not a failed benchmark
        print(f"[bench] could not delete the bench's topics: {exc}")
    finally:
        admin.close()


def accelerators() -> dict[str, bool]:
    """The optional C speed-ups the Kafka and Redis clients use when installed."""
    found = {}
    for name in ("crc32c", "hiredis"):  # kafka-python's record checksums; redis-py's reply parser
        try:
            __import__(name)
            found[name] = True
        except ImportError:
            found[name] = False
    return found


def api_job(fleet: Fleet, redis_url: str) -> bytes:
    """The JobRequest the API recorded for one `BODY`: what the minimal endpoint queues."""
    answer = httpx.post(f"{fleet.url}/v1/jobs", content=BODY, timeout=30,
                        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    answer.raise_for_status()
    client = redis.Redis.from_url(redis_url)
    try:
        return client.hget(Keys(fleet.prefix).job(answer.json()["job_id"]), "request")
    finally:
        client.close()


def start_minimal(fleet: Fleet, infra: dict[str, str], log_dir: Path) -> tuple[subprocess.Popen, str]:
    """The minimal endpoint, queuing the API's job to the same fleet, answering; its process and URL."""
    job = api_job(fleet, infra["redis-state"])
    topic = request_topic(fleet.env["KVFLEET_TOPIC_PREFIX"], decode_request(job).priority)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "minimal_api.py"), "--port", str(port), "--kafka", infra["kafka"],
         "--redis", infra["redis-state"], "--topic", topic, "--prefix", fleet.prefix, "--job", job.decode()],
        cwd=ROOT, env=fleet.env, stdout=open(log_dir / "minimal.log", "ab"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _up(url), "the minimal endpoint to answer", 60)
    return proc, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (about two minutes in all)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds at 64 (default 5; 3 quick)")
    parser.add_argument("--api-workers", type=int, default=1,
                        help="KVFLEET_API_WORKERS of the fleet's API (default 1; 0: one process per CPU)")
    parser.add_argument("--part", choices=("all", "front", "jobs"), default="all",
                        help="front: the front door only; jobs: the job path only (the other part's figures "
                             "in fleet.json are kept)")
    parser.add_argument("--workers", type=int, default=2, help="workers of the job-path fleet (default 2)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    infra = kvfleet.infra.up()
    path = args.out / "fleet.json"
    report = json.loads(path.read_text()) if args.part != "all" and path.exists() else {}
    if args.part in ("all", "front"):
        report.update(front_door(args, infra))
    if args.part in ("all", "jobs"):
        report["jobs"] = job_path(args, infra)
        report.setdefault("targets", {}).update(JOB_TARGETS)
        for key in JOB_TARGETS:
            report[key] = report["jobs"][key]
    print_table(report)
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out / "fleet.png")


def front_door(args: argparse.Namespace, infra: dict[str, str]) -> dict:
    """The API against the minimal endpoint under wrk (the module's docstring)."""
    rounds = args.rounds or (3 if args.quick else 5)
    seconds = 8 if args.quick else 20
    sweep_s = 3 if args.quick else 8
    binary = ensure_wrk()
    log_dir = Path(tempfile.mkdtemp(prefix="kvfleet-bench-fleet-"))
    prefix = f"bf{uuid.uuid4().hex[:8]}"
    # Every other setting is the default (logs at INFO included): the fleet as deployed.
    env = {"KVFLEET_TENANTS": json.dumps(TENANTS), "KVFLEET_API_WORKERS": str(args.api_workers),
           "KVFLEET_MAX_BACKLOG_HIGH": NO_BACKLOG_BOUND, "KVFLEET_MAX_BACKLOG_NORMAL": NO_BACKLOG_BOUND,
           "KVFLEET_MAX_BACKLOG_LOW": NO_BACKLOG_BOUND, "KVFLEET_FILES_DIR": str(log_dir / "files")}
    fleet = Fleet(prefix=prefix, kafka=infra["kafka"], redis_url=infra["redis-state"],
                  cache_redis_url=infra["redis-cache"], log_dir=log_dir, extra_env=env)
    topics = [f"{prefix}.requests.{p}" for p in ("high", "normal", "low", "dlq", "results")]
    script = log_dir / "post.lua"
    script.write_text(WRK_LUA % {"body": BODY, "key": API_KEY})
    minimal = None
    try:
        api_name = fleet.start("api")
        for role in ("scheduler", "worker"):
            fleet.start(role)
        fleet.wait_ready(workers=1)
        minimal, minimal_url = start_minimal(fleet, infra, log_dir)
        servers = {"api": (f"{fleet.url}/v1/jobs", fleet.procs[api_name].pid),
                   "minimal": (f"{minimal_url}/v1/jobs", minimal.pid)}

        def drive(name: str, connections: int, seconds_: float) -> dict:
            url, pid = servers[name]
            return wrk(binary, script, url, connections=connections, seconds=seconds_, pid=pid,
                       fleet_pids={n: p.pid for n, p in fleet.procs.items() if n != api_name})

        hops_idle = one_job_at_a_time(fleet, 10 if args.quick else 30)
        for name in servers:  # warm-up: connections, producer batches, code paths
            drive(name, CONNECTIONS, 2)
        steps_before = step_totals(fleet)
        at64: dict[str, list[dict]] = {"api": [], "minimal": []}
        for r in range(rounds):
            for name in (("api", "minimal") if r % 2 == 0 else ("minimal", "api")):  # neither always first
                run = drive(name, CONNECTIONS, seconds)
                at64[name].append(run)
                print(f"[bench] round {r + 1}/{rounds} {name:8} {run['ok_per_s']:7.0f} jobs/s  p50 "
                      f"{run['p50_ms']:6.1f} ms  p99 {run['p99_ms']:6.1f} ms  cpu {run['server_cpu_ms_per_job']:.2f} "
                      f"ms/job  fleet {run['fleet_cpu_cores']:.2f} cores  non-2xx {run['non_2xx']}  load "
                      f"{run['load_avg_1m']:.1f}", flush=True)
        steps = step_means(steps_before, step_totals(fleet))
        sweep: dict[str, list[dict]] = {"api": [], "minimal": []}
        for c in SWEEP:
            for name in servers:
                sweep[name].append(drive(name, c, sweep_s))
        fleet.assert_alive()
    finally:
        try:
            if minimal is not None:
                minimal.terminate()
                try:
                    minimal.wait(timeout=20)
                except subprocess.TimeoutExpired:  # a loaded machine: do not leave it, nor the fleet
                    minimal.kill()
                    minimal.wait()
        finally:
            fleet.stop()
            cleanup(fleet, infra["redis-state"], infra["kafka"], topics)
    shutil.rmtree(log_dir, ignore_errors=True)  # kept (for its logs) only when the run failed

    api, base = at64["api"], at64["minimal"]
    version = subprocess.run([binary, "-v"], capture_output=True, text=True).stdout.split()[1]
    report = {
        "machine": {"cores": os.cpu_count(),
                    "load_avg_1m_median": statistics.median(r["load_avg_1m"] for r in api + base)},
        "load_generator": f"wrk {version} (C), -t2 -c{CONNECTIONS}, {seconds} s a run",
        "api_processes": args.api_workers or len(os.sched_getaffinity(0)),
        "accelerators": accelerators(),
        "rounds": rounds, "quick": args.quick,
        "api_submits_per_s_at_64": median_of(api, "ok_per_s"),
        "api_submit_p50_ms_at_64": median_of(api, "p50_ms"),
        "api_submit_p99_ms_at_64": median_of(api, "p99_ms"),
        "api_cpu_ms_per_submit_at_64": median_of(api, "server_cpu_ms_per_job"),
        "minimal_submits_per_s_at_64": median_of(base, "ok_per_s"),
        "minimal_submit_p50_ms_at_64": median_of(base, "p50_ms"),
        "minimal_submit_p99_ms_at_64": median_of(base, "p99_ms"),
        "minimal_cpu_ms_per_submit_at_64": median_of(base, "server_cpu_ms_per_job"),
        # The cores the scheduler and worker used during each server's rounds: the fleet
        # runs both servers' jobs, so the two should be alike (docs/benchmarks.md).
        "fleet_cpu_cores_in_api_rounds": median_of(api, "fleet_cpu_cores"),
        "fleet_cpu_cores_in_minimal_rounds": median_of(base, "fleet_cpu_cores"),
        "api_non_2xx": sum(r["non_2xx"] for r in api), "api_socket_errors": sum(r["socket_errors"] for r in api),
        "targets": {"api_submits_vs_minimal": 0.7, "api_submit_p99_ms_at_64": 100},
        "api_submit_steps_mean_ms_at_64": steps,
        "one_job_hops_median_ms_idle": hops_idle,
        "rounds_at_64": at64, "sweep": sweep,
    }
    # The ratio of medians, and the median of each round's ratio (a round's two runs are
    # back to back, so they share that moment's load).
    report["api_submits_vs_minimal"] = report["api_submits_per_s_at_64"] / report["minimal_submits_per_s_at_64"]
    report["api_submits_vs_minimal_per_round_median"] = statistics.median(
        a["ok_per_s"] / m["ok_per_s"] for a, m in zip(api, base))
    return report



#: The job path's targets (issue 16): fleet over engine, and one job's overhead in ms.
JOB_TARGETS = {"short_jobs_fleet_over_engine": 0.5, "long_jobs_fleet_over_engine": 0.9, "overhead_p50_ms": 10}
#: Output lengths of the job-path sweep: 1 is `short`, 128 is `long`.
OUTPUT_LENGTHS = (1, 8, 32, 128)


def job_path(args: argparse.Namespace, infra: dict[str, str]) -> dict:
    """Jobs through the fleet against the same jobs on one engine (bench/fleet_jobs.py),
    per output length, and one job's overhead on the idle fleet."""
    short_n = 1000 if args.quick else 2000
    long_n = 300 if args.quick else 500  # quick: 300, not 100: a run of a few seconds on 2 cores is noisy
    lengths = (1, 128) if args.quick else OUTPUT_LENGTHS
    counts = {n: short_n if n == 1 else long_n if n == 128 else max(long_n, short_n // n) for n in lengths}
    # The engine runs alone before the fleet starts and again after it stopped (nothing
    # else on the machine either time), and the ratios use the mean of the two: this
    # machine's own speed drifts by tens of percent over a few minutes, and one baseline
    # taken at one end would put that drift into the ratio.
    engine_runs: dict[int, list[dict]] = {n: [] for n in lengths}

    def engine_alone(when: str) -> None:
        for n in lengths:
            run = fleet_jobs.engine_alone("builtin:tiny", fleet_jobs.prompts(counts[n], seed=n), n)
            engine_runs[n].append({**run, "when": when})
            print(f"[bench] engine alone ({when} the fleet), {counts[n]} jobs of {n} tokens: {run['jobs_per_s']:.0f} "
                  f"jobs/s {run['tokens_per_s']:.0f} tokens/s (best with {run['torch_threads']} torch threads)",
                  flush=True)

    engine_alone("before")
    log_dir = Path(tempfile.mkdtemp(prefix="kvfleet-bench-jobs-"))
    prefix = f"bj{uuid.uuid4().hex[:8]}"
    env = {"KVFLEET_TENANTS": json.dumps(TENANTS), "KVFLEET_MAX_BACKLOG_HIGH": NO_BACKLOG_BOUND,
           "KVFLEET_MAX_BACKLOG_NORMAL": NO_BACKLOG_BOUND, "KVFLEET_MAX_BACKLOG_LOW": NO_BACKLOG_BOUND,
           "KVFLEET_FILES_DIR": str(log_dir / "files")}
    fleet = Fleet(prefix=prefix, kafka=infra["kafka"], redis_url=infra["redis-state"],
                  cache_redis_url=infra["redis-cache"], log_dir=log_dir, extra_env=env)
    topics = [f"{prefix}.requests.{p}" for p in ("high", "normal", "low", "dlq", "results")]
    fleet_runs = {}
    try:
        fleet.start("api")
        fleet.start("scheduler")
        worker_metrics = []
        for _ in range(args.workers):  # each with its metrics endpoint: the engines' clocks
            port = free_port()
            fleet.start("worker", env={"KVFLEET_WORKER_METRICS_PORT": str(port)})
            worker_metrics.append(lambda port=port: fleet.metrics(port))
        fleet.wait_ready(workers=args.workers)
        pids = {**{name: proc.pid for name, proc in fleet.procs.items()}, **fleet_jobs.infra_pids(infra)}
        over = fleet_jobs.overhead(fleet.url, API_KEY, 30 if args.quick else 40, seed=99, log_dir=log_dir)
        print(f"[bench] overhead of one 1-token job on the idle fleet: p50 {over['overhead_p50_ms']:.1f} ms",
              flush=True)
        fleet_jobs.through_fleet(infra["kafka"], topics[1], topics[4], "bench", "builtin:tiny",
                                 fleet_jobs.prompts(50, seed=7), 1, label="warm-up")
        for n in lengths:
            run = fleet_jobs.through_fleet(infra["kafka"], topics[1], topics[4], "bench", "builtin:tiny",
                                           fleet_jobs.prompts(counts[n], seed=n), n, label=f"{n}-token jobs",
                                           pids=pids, log_dir=log_dir, worker_metrics=worker_metrics,
                                           ledger=(infra["redis-state"], fleet.keys.ledger))
            fleet_runs[n] = run
            print(f"[bench] fleet, {counts[n]} jobs of {n} tokens: {run['jobs_per_s']:.0f} jobs/s "
                  f"{run['tokens_per_s']:.0f} tokens/s, {run['done']} done, {run['runs_beyond_one']} reruns "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
        fleet.assert_alive()
    finally:
        fleet.stop()
        cleanup(fleet, infra["redis-state"], infra["kafka"], topics)
    shutil.rmtree(log_dir, ignore_errors=True)
    engine_alone("after")
    engine = {n: bracketed(engine_runs[n]) for n in lengths}
    by_length = [{"max_new_tokens": n, "jobs": counts[n], "fleet": fleet_runs[n], "engine": engine[n],
                  "jobs_fleet_over_engine": fleet_runs[n]["jobs_per_s"] / engine[n]["jobs_per_s"],
                  "tokens_fleet_over_engine": fleet_runs[n]["tokens_per_s"] / engine[n]["tokens_per_s"]}
                 for n in lengths]
    row = {r["max_new_tokens"]: r for r in by_length}
    return {"workers": args.workers, "model": "builtin:tiny", "by_output_length": by_length, "overhead": over,
            "short_jobs_fleet_over_engine": row[1]["jobs_fleet_over_engine"],
            "long_jobs_fleet_over_engine": row[128]["tokens_fleet_over_engine"],
            "overhead_p50_ms": over["overhead_p50_ms"], "load_avg_1m_end": os.getloadavg()[0]}


def bracketed(runs: list[dict]) -> dict:
    """One engine baseline from its runs before and after the fleet: their mean rates,
    and how far apart they were (the machine's drift over the fleet's run)."""
    jobs_per_s = [r["jobs_per_s"] for r in runs]
    tokens_per_s = [r["tokens_per_s"] for r in runs]
    return {"jobs_per_s": statistics.fmean(jobs_per_s), "tokens_per_s": statistics.fmean(tokens_per_s),
            "spread": (max(tokens_per_s) - min(tokens_per_s)) / statistics.fmean(tokens_per_s), "runs": runs}


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def print_table(report: dict) -> None:
    if "api_submits_per_s_at_64" in report:
        print_front_door(report)
    if "jobs" in report:
        print_job_path(report["jobs"])


def print_job_path(jobs: dict) -> None:
    print(f"\n{'job path: ' + str(jobs['workers']) + ' workers':24} {'jobs':>6} {'fleet jobs/s':>13} "
          f"{'engine jobs/s':>14} {'fleet tok/s':>12} {'engine tok/s':>13} {'fleet/engine':>13} "
          f"{'engine drift':>13}")
    for r in jobs["by_output_length"]:
        n = r["max_new_tokens"]
        ratio = r["jobs_fleet_over_engine"] if n == 1 else r["tokens_fleet_over_engine"]
        print(f"{str(n) + '-token jobs':24} {r['jobs']:6d} {r['fleet']['jobs_per_s']:13.0f} "
              f"{r['engine']['jobs_per_s']:14.0f} {r['fleet']['tokens_per_s']:12.0f} "
              f"{r['engine']['tokens_per_s']:13.0f} {ratio:13.2f} {r['engine'].get('spread', 0):13.0%}")
    print("(engine: the mean of its runs before and after the fleet's; drift: how far apart those two were)")
    print(f"short (1-token) fleet/engine {jobs['short_jobs_fleet_over_engine']:.2f} (target >= 0.5); long "
          f"(128-token, tokens/s) {jobs['long_jobs_fleet_over_engine']:.2f} (target >= 0.9)")
    for r in jobs["by_output_length"]:
        hops, means = r["fleet"].get("every_hop_median_ms"), r["fleet"].get("every_hop_mean_ms") or {}
        if hops:
            print(f"\n{r['max_new_tokens']}-token jobs under load, every hop (ms)  {'median':>9} {'mean':>9}")
            for hop, ms in hops.items():
                print(f"  {hop:66} {ms:9.1f} {means.get(hop, float('nan')):9.1f}")
        if "engine_step_share" in r["fleet"]:
            f = r["fleet"]
            print(f"  the engines: {f['engine_step_share']:.0%} of the run in steps; a step's wall time "
                  f"{f['engine_step_wall_over_cpu']:.1f}x its step thread's CPU time, "
                  f"{f.get('engine_step_cpu_wait_share', float('nan')):.0%} of it waiting for a core")
        if "ledger_jobs_p50" in r["fleet"]:
            f = r["fleet"]
            print(f"  jobs holding a reservation (slots taken): p50 {f['ledger_jobs_p50']}, p90 {f['ledger_jobs_p90']}, "
                  f"max {f['ledger_jobs_max']}")
        if "jobs_by_worker" in r["fleet"]:
            f = r["fleet"]
            print(f"  jobs by worker {f['jobs_by_worker']}, each worker's last finish "
                  f"{', '.join(f'{s:.2f}' for s in f['last_finished_s_by_worker'])} s; first job admitted "
                  f"{1000 * f['first_admitted_s']:.1f} ms and started {1000 * f['first_started_s']:.1f} ms after the first send")
    o = jobs["overhead"]
    print(f"\none 1-token job on the idle fleet (median ms of {o['jobs']}); overhead p50 "
          f"{o['overhead_p50_ms']:.1f} ms (target <= 10), p90 {o['overhead_p90_ms']:.1f} ms")
    for hop, ms in o["hops_median_ms"].items():
        print(f"  {hop:38} {ms:8.2f}")
    if o.get("every_hop_median_ms"):
        print("  every hop (the last one: to the client's long poll)")
        for hop, ms in o["every_hop_median_ms"].items():
            print(f"  {hop:66} {ms:9.2f}")


def print_front_door(report: dict) -> None:
    print(f"\n{'64 connections (median of ' + str(report['rounds']) + ' rounds)':40} {'jobs/s':>8} {'p50 ms':>8} "
          f"{'p99 ms':>8}")
    for name in ("api", "minimal"):
        print(f"{name:40} {report[name + '_submits_per_s_at_64']:8.0f} {report[name + '_submit_p50_ms_at_64']:8.1f} "
              f"{report[name + '_submit_p99_ms_at_64']:8.1f}")
    print(f"CPU per job: api {report['api_cpu_ms_per_submit_at_64']:.2f} ms, minimal "
          f"{report['minimal_cpu_ms_per_submit_at_64']:.2f} ms (all the server's processes and threads)")
    print(f"api / minimal: {report['api_submits_vs_minimal']:.2f} (target >= 0.7); api p99 "
          f"{report['api_submit_p99_ms_at_64']:.0f} ms (target <= 100); non-2xx {report['api_non_2xx']}")
    print(f"\n{'connections':>11} {'api jobs/s':>11} {'p99 ms':>8} {'minimal jobs/s':>15} {'p99 ms':>8}")
    for a, m in zip(report["sweep"]["api"], report["sweep"]["minimal"]):
        print(f"{a['connections']:11d} {a['ok_per_s']:11.0f} {a['p99_ms']:8.1f} {m['ok_per_s']:15.0f} "
              f"{m['p99_ms']:8.1f}")
    print(f"\n{'API submit steps at 64 (mean ms)':40}")
    for step, ms in report["api_submit_steps_mean_ms_at_64"].items():
        print(f"  {step:38} {ms:8.2f}")
    print(f"\n{'one job on the idle fleet (median ms)':40}")
    for hop, ms in report["one_job_hops_median_ms_idle"].items():
        print(f"  {hop:38} {ms:8.1f}")


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    front, jobs = "sweep" in report, "jobs" in report
    fig, axes = plt.subplots(1, 2 * front + jobs, figsize=(5.5 * (2 * front + jobs), 4.5), squeeze=False)
    axes = list(axes[0])
    if front:
        ax, lat = axes[0], axes[1]
        for name, label, color in (("api", "kvfleet API", "tab:blue"), ("minimal", "minimal endpoint", "tab:orange")):
            runs = report["sweep"][name]
            xs = [r["connections"] for r in runs]
            ax.plot(xs, [r["ok_per_s"] for r in runs], marker="o", color=color, label=label)
            lat.plot(xs, [r["p99_ms"] for r in runs], marker="o", color=color, label=f"{label} p99")
            lat.plot(xs, [r["p50_ms"] for r in runs], marker=".", color=color, linestyle="--", label=f"{label} p50")
        for axis in (ax, lat):
            axis.set_xscale("log", base=2)
            axis.set_xlabel("offered load: concurrent connections (wrk)")
            axis.legend()
        ax.set_ylabel("jobs accepted per second")
        lat.set_ylabel("latency (ms)")
        lat.set_yscale("log")
        ax.set_title(f"POST /v1/jobs: api / minimal = {report['api_submits_vs_minimal']:.2f} at 64")
        lat.set_title(f"api p99 at 64 = {report['api_submit_p99_ms_at_64']:.0f} ms")
    if jobs:
        ax = axes[-1]
        rows = report["jobs"]["by_output_length"]
        xs = [r["max_new_tokens"] for r in rows]
        ax.plot(xs, [r["fleet"]["jobs_per_s"] for r in rows], marker="o", label="through the fleet")
        ax.plot(xs, [r["engine"]["jobs_per_s"] for r in rows], marker="o", label="one engine, same cores")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("output tokens per job")
        ax.set_ylabel("jobs finished per second")
        ax.set_title(f"job path: short fleet/engine = {report['jobs']['short_jobs_fleet_over_engine']:.2f}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
