"""The job gate's bookkeeping (workers/gate.py); tests/test_tasks.py runs it in a real
worker on the real broker."""

from __future__ import annotations

from kvfleet.constants import celery_queue
from kvfleet.contracts import Priority
from workers.gate import HIGH_ONLY_BRPOP_S, JobGate

HIGH, NORMAL, LOW = (celery_queue("p", c) for c in (Priority.HIGH, Priority.NORMAL, Priority.LOW))


def jobs(priority: str, n: int) -> list[dict]:
    return [{"job_id": f"j{i}", "priority": priority} for i in range(n)]


def test_normal_and_low_take_the_shared_slots_and_high_the_rest():
    gate = JobGate(slots=8, high_slot_reserve=0.25, key_prefix="p")  # shared 6, as the scheduler splits 8
    assert gate.shared == 6
    normal = gate.hold(jobs("normal", 4))
    assert all(gate.admits(q) for q in (HIGH, NORMAL, LOW))
    low = gate.hold(jobs("low", 2))
    assert gate.admits(HIGH) and not gate.admits(NORMAL) and not gate.admits(LOW)
    high = gate.hold(jobs("high", 2))  # every slot held: nothing more, high neither
    assert not any(gate.admits(q) for q in (HIGH, NORMAL, LOW))
    gate.release(high)
    assert gate.admits(HIGH) and not gate.admits(NORMAL)
    gate.release(low)
    assert gate.admits(NORMAL) and gate.held() == {"high": 0, "shared": 4}
    gate.release(normal)
    assert gate.held() == {"high": 0, "shared": 0}


def test_a_worker_holding_nothing_takes_a_message_larger_than_its_slots():
    gate = JobGate(slots=1, high_slot_reserve=0.25, key_prefix="p")
    assert gate.admits(NORMAL)
    held = gate.hold(jobs("normal", 16))
    assert not gate.admits(NORMAL) and not gate.admits(HIGH)
    gate.release(held)
    assert gate.admits(NORMAL)


def test_reopening_wakes_the_loop_once_and_only_then():
    gate = JobGate(slots=4, high_slot_reserve=0.25, key_prefix="p")
    woken = []
    gate._wake = lambda: woken.append(1)
    a, b = gate.hold(jobs("normal", 2)), gate.hold(jobs("normal", 2))
    gate.release(a)  # closed (4 of 4) -> open
    assert woken == [1]
    gate.release(b)  # open already
    assert woken == [1]


class Cycle:
    """What the gate wraps of a kombu Redis channel: its queue cycle and BRPOP start."""

    def __init__(self, queues: list[str]) -> None:
        self.queues = queues

    def consume(self, n: int) -> list[str]:
        return self.queues[:n]


class Channel:
    def __init__(self) -> None:
        self._queue_cycle = Cycle([HIGH, NORMAL, LOW])
        self.sent: list[tuple[list[str], float | None]] = []

    def _brpop_start(self, timeout=None):
        self.sent.append((self._queue_cycle.consume(3), timeout))


def test_a_gated_channel_reads_only_the_open_queues_and_high_alone_briefly():
    gate, channel = JobGate(slots=4, high_slot_reserve=0.25, key_prefix="p"), Channel()
    gate.wrap(channel, hub=None)
    channel._brpop_start()
    held = gate.hold(jobs("normal", 3))
    channel._brpop_start()
    gate.hold(jobs("high", 1))
    channel._brpop_start()
    gate.release(held)
    channel._brpop_start()
    assert channel.sent == [([HIGH, NORMAL, LOW], None), ([HIGH], HIGH_ONLY_BRPOP_S), ([], HIGH_ONLY_BRPOP_S),
                            ([HIGH, NORMAL, LOW], None)]
