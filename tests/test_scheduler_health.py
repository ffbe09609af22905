"""A scheduler that owns no partitions while jobs wait says so (issue 13 #8).

Before, such a replica looked healthy: its metrics endpoint answered and its loop ran,
while every job waited on partitions held by a member that did not move them. Now
`/healthz` on its metrics port answers 503 with the reason, the
`kvfleet_scheduler_idle_with_lag` gauge is 1, and it rejoins the group once per window.
"""

from __future__ import annotations

import threading

import httpx
import pytest
from kafka import KafkaConsumer
from kafka.coordinator.assignors.range import RangePartitionAssignor

from kvfleet.constants import all_request_topics
from scheduler.health import IdleWithLag
from tests.fleet import free_port


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_idle_with_lag_needs_a_whole_window_of_waiting_jobs_not_going_down():
    clock = _Clock()
    idle = IdleWithLag(10.0, clock=clock)
    assert idle.observe(assigned=0, lag=5) is None  # just started waiting
    clock.t = 5
    assert idle.observe(0, 7) is None
    clock.t = 11
    assert "owns no partitions while 9 jobs wait" in idle.observe(0, 9)
    clock.t = 12
    assert idle.observe(3, None) is None  # it got partitions: healthy, and the window restarts
    clock.t = 30
    assert idle.observe(0, 9) is None
    clock.t = 45
    assert idle.observe(0, 4) is None  # going down: someone is draining the lag
    assert idle.observe(0, 0) is None  # no lag: an idle spare replica is healthy


class _Hog:
    """A member of the scheduler's group that takes every partition (its member id
    sorts first under the range assignor, and there is one partition per topic) and
    keeps polling, so the group stays settled, but never commits: jobs wait on it."""

    def __init__(self, bootstrap: str, group: str, topics: list[str]) -> None:
        self.consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, client_id="aaa-hog",
                                      enable_auto_commit=False, auto_offset_reset="earliest",
                                      partition_assignment_strategy=[RangePartitionAssignor])
        self.consumer.subscribe(topics)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self.stop.is_set():
            self.consumer.poll(timeout_ms=200)

    def start(self, timeout_s: float = 60) -> None:
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        self.consumer.close()  # leaves the group: the scheduler gets the partitions


def _health(port: int) -> tuple[int, dict]:
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
    except httpx.HTTPError:
        return 0, {}
    return r.status_code, r.json()


@pytest.mark.timeout(300)
def test_a_scheduler_without_partitions_while_jobs_wait_is_unhealthy_until_it_gets_them(make_fleet, kafka_bootstrap):
    port = free_port()
    fleet = make_fleet(workers=1, wait=False, extra_env={
        "KVFLEET_KAFKA_PARTITIONS": "1", "KVFLEET_SCHEDULER_IDLE_LAG_S": "3",
        "KVFLEET_SCHEDULER_METRICS_PORT": str(port)})
    fleet.wait_ready(workers=1)
    topics = all_request_topics(f"{fleet.prefix}.requests")
    hog = _Hog(kafka_bootstrap, f"{fleet.prefix}-scheduler", topics)
    hog.start()
    try:
        fleet.wait_for(lambda: len(hog.consumer.assignment()) == 3, "the hog holding every partition", timeout=120)
        assert _health(port)[0] == 200
        jobs = [fleet.submit("normal", prompt_len=4, max_new_tokens=2) for _ in range(5)]
        code, body = fleet.wait_for(lambda: (h := _health(port))[0] == 503 and h, "/healthz saying unhealthy",
                                    timeout=120)
        assert "owns no partitions while" in body["reason"] and "jobs wait" in body["reason"]
        assert fleet.metrics(port)["kvfleet_scheduler_idle_with_lag"] == 1.0
        assert all(fleet.state(j) == "queued" for j in jobs)  # the hog holds them
    finally:
        hog.close()
    fleet.wait_for(lambda: all(fleet.state(j) == "done" for j in jobs), "the jobs done once the hog left", timeout=120)
    fleet.wait_for(lambda: _health(port)[0] == 200, "/healthz healthy again", timeout=60)
