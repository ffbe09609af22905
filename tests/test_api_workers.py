"""Several API processes behind one port (`KVFLEET_API_WORKERS`): the setting, and a
real fleet whose API runs two processes that take jobs and answer /metrics for both."""

from __future__ import annotations

import os

import psutil
import pytest

from kvfleet.settings import Settings
from producer.api import process_count


def test_the_setting_defaults_to_one_process_and_zero_means_one_per_cpu():
    assert Settings.from_env({}).api.workers == 1
    assert process_count(Settings.from_env({})) == 1
    assert process_count(Settings.from_env({"KVFLEET_API_WORKERS": "3"})) == 3
    assert process_count(Settings.from_env({"KVFLEET_API_WORKERS": "0"})) == len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="KVFLEET_API_WORKERS"):
        Settings.from_env({"KVFLEET_API_WORKERS": "-1"})


def test_two_api_processes_take_jobs_on_one_port_and_count_them_together(make_fleet):
    fleet = make_fleet(workers=1, extra_env={"KVFLEET_API_WORKERS": "2"})
    api = psutil.Process(fleet.procs["api-1"].pid)
    serving = [p for p in api.children() if "spawn_main" in " ".join(p.cmdline())]
    assert len(serving) == 2, [p.cmdline() for p in api.children()]

    jobs = [fleet.submit(max_new_tokens=2) for _ in range(12)]  # a connection each: the kernel spreads them
    for job_id in jobs:
        fleet.wait_for(lambda: fleet.state(job_id) == "done", f"{job_id} done", timeout=60)
    # Either process answers the scrape, with both processes' samples added up.
    for _ in range(4):
        assert fleet.metrics(fleet.port)['kvfleet_api_jobs_submitted_total{priority="normal"}'] == 12.0
