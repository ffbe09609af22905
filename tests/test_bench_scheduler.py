"""bench/scheduler.py's arithmetic: the burst rate counts k − 1 intervals' worth of jobs."""

from __future__ import annotations

import json

import pytest

from bench.scheduler import burst_rate


def test_jobs_after_the_first_batch_over_first_to_last_admission():
    # Three steps (one admitted_at each) one second apart: 4 + 2 + 3 jobs.
    stamps = [10.0] * 4 + [11.0] * 2 + [12.0] * 3
    rate, counted, batches = burst_rate(stamps)
    assert (counted, batches) == (5, 3)
    assert rate == pytest.approx(5 / 2.0)  # not 9 / 2: the first batch opens the clock


def test_order_does_not_matter():
    assert burst_rate([12.0, 10.0, 11.0, 10.0]) == burst_rate([10.0, 10.0, 11.0, 12.0])


def test_one_batch_has_no_interval():
    with pytest.raises(ValueError, match="one batch"):
        burst_rate([5.0, 5.0, 5.0])


def test_a_sim_only_run_keeps_the_live_figures_it_did_not_measure(tmp_path):
    from bench.scheduler import LIVE_KEYS, _earlier_live

    path = tmp_path / "scheduler.json"
    assert _earlier_live(path) == dict.fromkeys(LIVE_KEYS) | {"live_command": None}  # no earlier file
    path.write_text(json.dumps({"command": "python bench/scheduler.py --quick", "seeds": 3,
                                "dispatch_p50_ms": 2.5, "dispatch_workers": 2, "admitted_to_start_p50_ms": 1.0,
                                "kvfleet_jain_vs_quota": 0.9}))
    kept = _earlier_live(path)
    assert kept == {"dispatch_p50_ms": 2.5, "dispatch_workers": 2, "admitted_to_start_p50_ms": 1.0,
                    "live_command": "python bench/scheduler.py --quick"}
    path.write_text(json.dumps({"command": "python bench/scheduler.py --sim-only", "dispatch_p50_ms": 2.5,
                                "live_command": "python bench/scheduler.py"}))
    assert _earlier_live(path)["live_command"] == "python bench/scheduler.py"  # still the run that measured
