"""Batch benchmark: online latency while a large batch runs, and the batch's throughput.

    python bench/batch.py [--quick] [--lines N] [--out bench/results]

A real fleet (API with its batch driver, scheduler, one worker, the tiny built-in model,
on the local Kafka and Redis) answers sequential online `/v1/completions` requests
(normal priority, 8 prompt words, max_tokens 8, greedy) twice: on an idle fleet, then
while a batch of `--lines` requests (max_tokens 8, low priority, as batches run) is in
progress. Online samples are taken only while the batch is `in_progress`.

Figures: `online_p99_during_batch_over_unloaded` (target <= 1.5: the batch must not
take the online traffic's latency) and `batch_lines_per_s` (lines completed / time from
`in_progress_at` to `completed_at`).

Prints a table, writes <out>/batch.json and <out>/batch.png.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import openai  # noqa: E402

import kvfleet.infra  # noqa: E402
from tests.fleet import Fleet  # noqa: E402  (the integration tests' process launcher)

MODEL = "builtin:tiny"
TENANTS = {"tenants": [{"name": "bench", "tier": "silver", "tokens_per_minute": 10**9, "api_keys": ["sk-bench-batch"]}]}


def online(client: openai.OpenAI, n: int, *, while_=lambda: True, ids: list[str] | None = None) -> list[float]:
    """Seconds per sequential online completion; stops early when `while_()` turns false.
    The job ids go to `ids`, for the per-hop breakdown."""
    out = []
    for i in range(n):
        if not while_():
            break
        started = time.perf_counter()
        reply = client.completions.create(model=MODEL, prompt=f"Online request {i}: tell me something short",
                                          max_tokens=8, temperature=0)
        out.append(time.perf_counter() - started)
        if ids is not None:
            ids.append(reply.id)
    return out


#: The hops of one job, from its stored timings: (name, from, to).
HOPS = (("queued -> admitted (scheduler)", "queued_at", "admitted_at"),
        ("admitted -> started (Celery, worker)", "admitted_at", "started_at"),
        ("started -> first token (engine)", "started_at", "first_token_at"),
        ("first token -> finished (engine)", "first_token_at", "finished_at"))


def hops(fleet: Fleet, ids: list[str]) -> dict[str, float]:
    """Median seconds of each hop over the jobs `ids` (their stored JobResult timings)."""
    timings = [json.loads(fleet.field(job_id, "result"))["timings"] for job_id in ids]
    return {name: float(np.median([t[b] - t[a] for t in timings if t.get(a) and t.get(b)]))
            for name, a, b in HOPS}


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 3,000-line batch (about two minutes)")
    parser.add_argument("--lines", type=int, default=None, help="batch size (default 50,000; 3,000 with --quick)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    lines_n = args.lines or (3_000 if args.quick else 50_000)
    samples = 60 if args.quick else 300
    infra = kvfleet.infra.up()
    log_dir = Path("/tmp") / f"kvfleet-bench-batch-{uuid.uuid4().hex[:6]}"
    log_dir.mkdir(parents=True)
    fleet = Fleet(prefix=f"bb{uuid.uuid4().hex[:8]}", kafka=infra["kafka"], redis_url=infra["redis-state"],
                  cache_redis_url=infra["redis-cache"], log_dir=log_dir,
                  extra_env={"KVFLEET_TENANTS": json.dumps(TENANTS), "KVFLEET_FILES_DIR": str(log_dir / "files"),
                             "KVFLEET_LOG_LEVEL": "WARNING"})
    try:
        for role in ("api", "scheduler", "worker"):
            fleet.start(role)
        fleet.wait_ready(workers=1)
        client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="sk-bench-batch", max_retries=2, timeout=300)
        online(client, 5)  # warm-up: compile paths, fill caches
        idle_ids: list[str] = []
        busy_ids: list[str] = []
        unloaded = online(client, samples, ids=idle_ids)

        body = b"".join(json.dumps({"custom_id": f"b-{i}", "method": "POST", "url": "/v1/completions", "body": {
            "model": MODEL, "prompt": f"Batch line {i}: summarise item {i % 101}", "max_tokens": 8,
            "temperature": 0}}).encode() + b"\n" for i in range(lines_n))
        file = client.files.create(file=("bench.jsonl", io.BytesIO(body)), purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
        fleet.wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed > 0,
                       "the batch to start", timeout=120)
        during = online(client, samples, while_=lambda: client.batches.retrieve(batch.id).status == "in_progress",
                        ids=busy_ids)
        done = fleet.wait_for(lambda: (b := client.batches.retrieve(batch.id)).status in
                              ("completed", "failed", "expired", "cancelled") and b, "the batch to end",
                              timeout=3600)
        hops_idle, hops_busy = hops(fleet, idle_ids), hops(fleet, busy_ids)
    finally:
        fleet.stop()
    elapsed = (done.completed_at or time.time()) - (done.in_progress_at or done.created_at)
    report = {
        "lines": lines_n, "status": done.status, "completed": done.request_counts.completed,
        "failed": done.request_counts.failed, "batch_seconds": elapsed,
        "batch_lines_per_s": done.request_counts.completed / max(elapsed, 1e-9),
        "online_samples_unloaded": len(unloaded), "online_samples_during_batch": len(during),
        "online_p50_unloaded_s": pct(unloaded, 50), "online_p99_unloaded_s": pct(unloaded, 99),
        "online_p50_during_batch_s": pct(during, 50), "online_p99_during_batch_s": pct(during, 99),
    }
    report["online_p99_during_batch_over_unloaded"] = report["online_p99_during_batch_s"] / report[
        "online_p99_unloaded_s"]
    report["target_p99_ratio"] = 1.5
    report["quick"] = args.quick
    report["online_hops_median_s"] = {"idle": hops_idle, "during_batch": hops_busy}
    print(f"{'':22} {'samples':>8} {'p50 s':>8} {'p99 s':>8}")
    print(f"{'online, idle fleet':22} {len(unloaded):8d} {report['online_p50_unloaded_s']:8.3f} "
          f"{report['online_p99_unloaded_s']:8.3f}")
    print(f"{'online, during batch':22} {len(during):8d} {report['online_p50_during_batch_s']:8.3f} "
          f"{report['online_p99_during_batch_s']:8.3f}")
    print(f"\n{'median seconds per hop':38} {'idle':>8} {'batch':>8}")
    for name, _, _ in HOPS:
        print(f"{name:38} {hops_idle[name]:8.4f} {hops_busy[name]:8.4f}")
    print(f"p99 during / idle: {report['online_p99_during_batch_over_unloaded']:.2f} (target <= 1.5); batch: "
          f"{lines_n} lines, {done.status}, {report['batch_lines_per_s']:.1f} lines/s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "batch.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(unloaded, during, report, args.out / "batch.png")


def plot(unloaded: list[float], during: list[float], report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for values, label in ((unloaded, "idle fleet"), (during, f"during a {report['lines']}-line batch")):
        if values:
            xs = np.sort(values) * 1000
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label)
    ax.set_xlabel("online /v1/completions latency (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"p99 during / idle = {report['online_p99_during_batch_over_unloaded']:.2f}; "
                 f"batch {report['batch_lines_per_s']:.0f} lines/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
