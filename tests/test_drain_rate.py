"""scheduler/drain_rate.py: the rate the policy's buffer drains at, over seconds of backlog only."""

from __future__ import annotations

import pytest

from scheduler.drain_rate import DrainRate


def test_no_rate_until_a_whole_window_of_backlog():
    drain = DrainRate(window_s=10.0)
    for t in range(10):
        drain.record(float(t), 500, waiting=True)
        assert drain.tokens_per_s() is None  # at most 9 s of backlog seen so far
    drain.record(10.0, 500, waiting=True)
    assert drain.tokens_per_s() == pytest.approx(500.0)


def test_seconds_with_nothing_waiting_are_left_out():
    drain = DrainRate(window_s=10.0)
    for t in range(11):
        drain.record(float(t), 1000, waiting=True)
    drain.record(11.0, 1000, waiting=False)  # the buffer emptied: what follows is arrivals
    for t in range(12, 100):
        drain.record(float(t), 10, waiting=False)
    # The quiet minutes neither lower the rate nor forget it.
    assert drain.tokens_per_s() == pytest.approx(1000.0)


def test_the_window_slides_to_the_latest_backlog():
    drain = DrainRate(window_s=10.0)
    for t in range(11):
        drain.record(float(t), 1000, waiting=True)
    for t in range(11, 31):  # a worker lost: half the rate for 20 s
        drain.record(float(t), 500, waiting=True)
    assert drain.tokens_per_s() == pytest.approx(500.0)


def test_nothing_admitted_is_no_rate():
    drain = DrainRate(window_s=5.0)
    for t in range(10):
        drain.record(float(t), 0, waiting=True)  # stalled: a guess of 0 would shed everything
    assert drain.tokens_per_s() is None
