"""`kvfleet status`: `frame()` on made-up data, and `--once` against a live fleet."""

from __future__ import annotations

import json
import time

from kvfleet import cli, registry
from kvfleet.contracts import JobResult, JobState, Priority, Timings, Usage
from kvfleet.recent import summarise
from kvfleet.snapshot import ClassRow, Snapshot, TenantRow, WorkerRow
from kvfleet.status import frame
from tests.fleet import free_port

SECTIONS = ("WORKERS", "CLASSES", "TENANTS", "LAST MINUTE")


def result(i: int, *, queued: float, status: JobState = JobState.DONE) -> JobResult:
    """A job queued at `queued`, started 0.1 s later, first token 0.2 s after that, then
    one token per 10 ms: 11 tokens, finished at queued + 0.4."""
    return JobResult(job_id=f"j{i}", status=status, tenant="acme", priority=Priority.NORMAL,
                     usage=Usage(prompt_tokens=8, completion_tokens=11),
                     timings=Timings(queued_at=queued, admitted_at=queued + 0.05, started_at=queued + 0.1,
                                     first_token_at=queued + 0.3, finished_at=queued + 0.4))


def test_summarise_counts_and_takes_percentiles():
    r = summarise([result(i, queued=100.0 + i) for i in range(9)] + [result(9, queued=100, status=JobState.FAILED)],
                  window_s=60.0)
    assert r.by_status == {"done": 9, "failed": 1} and r.finished == 10
    assert r.completion_tokens == 110 and abs(r.tokens_per_s - 110 / 60) < 1e-9
    assert abs(r.queue.p50 - 0.1) < 1e-9 and abs(r.ttft.p95 - 0.3) < 1e-9
    assert abs(r.tpot.p50 - 0.01) < 1e-9 and abs(r.total.p50 - 0.4) < 1e-9 and r.total.samples == 10
    assert summarise([], window_s=60.0).ttft.p50 is None


def test_frame_renders_every_section_from_made_up_data():
    snap = Snapshot(
        taken_at=time.time(), api_url="http://api:8000", api_ready=True, capacity_tokens=16384, in_use_tokens=4096,
        unstarted_jobs=2, unstarted_tokens=96,
        workers=[WorkerRow("w-1", "builtin:tiny", 8192, 4000, 3, 1.2), WorkerRow("w-2", "llama", 8192, 0, 0, 9.0)],
        classes=[ClassRow("high", 4000, buffered=1, lag=2, paused=0, holding=1), ClassRow("normal", 96),
                 ClassRow("low", 0, buffered=0, lag=7, paused=2, holding=0)],
        tenants=[TenantRow("acme", "gold", 4000, 1500, 6000, 12.0), TenantRow("dev", "silver", 96)],
        recent=summarise([result(i, queued=100.0) for i in range(3)], window_s=60.0),
        results_topic="kvfleet.requests.results", errors=["scheduler metrics http://s:9101/metrics: refused"])
    text = frame(snap)
    assert "\x1b" not in text
    for section in (*SECTIONS, "ERRORS"):
        assert section in text
    lines = text.splitlines()

    def line(*words: str) -> str:
        found = [ln for ln in lines if all(w in ln for w in words)]
        assert len(found) == 1, (words, text)
        return found[0]

    assert "4,096 / 16,384 tokens reserved (25%)" in text and "2 jobs, 96 tokens" in text
    assert "4,000 / 8,192 (49%)" in line("w-1", "builtin:tiny") and "ok (1.2s ago)" in line("w-1")
    assert "late" in line("w-2", "llama")  # 9 s: more than two missed beats
    assert line("high ").split()[1:5] == ["1", "2", "0", "yes"]
    assert line("normal ").split()[1:5] == ["-", "-", "-", "-"]  # no scheduler read for it
    assert "1,500 / 6,000 (25%)" in line("acme", "gold") and "no quota" in line("dev", "silver")
    assert "finished 3 (done 3)" in text and "3.0 jobs/min" in text
    assert line("first token").split()[2:4] == ["300ms", "300ms"]
    assert "refused" in line("scheduler metrics")


def test_status_once_shows_a_live_fleet(make_fleet, monkeypatch, capsys):
    scheduler_port = free_port()
    # A bucket that refills slowly (0.1 token/s), so the jobs' charge is still visible.
    tenants = {"tenants": [{"name": "acme", "tier": "silver", "tokens_per_minute": 6, "burst_tokens": 1000}]}
    fleet = make_fleet(workers=1, extra_env={"KVFLEET_SCHEDULER_METRICS_PORT": str(scheduler_port),
                                             "KVFLEET_TENANTS": json.dumps(tenants)})
    ids = [fleet.submit(p, prompt_len=8, max_new_tokens=4) for p in ("high", "normal", "low")]
    for job_id in ids:
        fleet.wait_for(lambda: fleet.state(job_id) == "done", f"job {job_id} done", timeout=120)
    # Every result relayed to Kafka: the outbox drains once the relay has its acks.
    fleet.wait_for(lambda: fleet.redis.xlen(fleet.keys.results_outbox) == 0, "results on Kafka")
    (beat,) = registry.live(fleet.redis, fleet.keys)
    for name in ("KVFLEET_KAFKA_BOOTSTRAP", "KVFLEET_KEY_PREFIX", "KVFLEET_TOPIC_PREFIX", "KVFLEET_TENANTS"):
        monkeypatch.setenv(name, fleet.env[name])

    code = cli.main(["status", "--once", "--url", fleet.url, "--redis-url", fleet.env["KVFLEET_REDIS_URL"],
                     "--scheduler-metrics", f"http://127.0.0.1:{scheduler_port}/metrics"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "\x1b" not in text and "ERRORS" not in text, text
    for section in SECTIONS:
        assert section in text, text
    assert f"API {fleet.url} ready" in text
    worker = next(ln for ln in text.splitlines() if beat.worker_id in ln)
    assert beat.model in worker and f"/ {beat.capacity_tokens:,}" in worker and " ok (" in worker, text
    high = next(ln for ln in text.splitlines() if ln.strip().startswith("high "))
    # Read from the scheduler: numbers, not "-" (their values trail by up to the
    # scheduler's OBSERVE_EVERY_S, so a just-admitted job may still count).
    assert all(v.isdigit() for v in high.split()[1:4]), text
    # 3 jobs × (8 + 4) tokens charged to acme's bucket at submission (a few have
    # refilled since, hence the range).
    acme = next(ln for ln in text.splitlines() if ln.strip().startswith("acme "))
    used = int(acme.split("/")[0].split()[-1].replace(",", ""))
    assert "silver" in acme and "/ 1,000" in acme and 20 <= used <= 36, text
    assert "finished 3 (done 3)" in text, text
