"""kvstore.spill.SpillQueue: bounded in bytes, never blocks the producer, batches, drains."""

from __future__ import annotations

import threading
import time

from kvstore.spill import SpillQueue

#: The most any wait below may take; only a broken behaviour reaches it.
TIMEOUT_S = 30.0


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


class GatedWriter:
    """Records batches; holds the writer thread until `gate` opens."""

    def __init__(self, *, fail_first: bool = False) -> None:
        self.batches: list[list[int]] = []
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail_first = fail_first

    def __call__(self, items: list[int]) -> None:
        self.entered.set()
        self.gate.wait(2 * TIMEOUT_S)  # held until the test opens it
        if self.fail_first and not self.batches:
            self.batches.append([])
            raise RuntimeError("redis exploded")
        self.batches.append(items)


def test_offer_refuses_instead_of_blocking_when_full():
    writer = GatedWriter()
    queue = SpillQueue(writer, max_bytes=300, max_batch=4)
    assert queue.offer(0, 100)
    assert writer.entered.wait(TIMEOUT_S)  # item 0 is being written: it still counts against the bound
    assert queue.offer(1, 100) and queue.offer(2, 100)
    assert not queue.has_room(100)
    assert not queue.offer(3, 100)  # dropped, at once
    assert queue.pending_bytes == 300
    writer.gate.set()
    assert queue.flush(TIMEOUT_S)
    assert [i for batch in writer.batches for i in batch] == [0, 1, 2]
    assert queue.pending_bytes == 0
    queue.close()


def test_backlog_goes_out_in_batches_in_order():
    writer = GatedWriter()
    queue = SpillQueue(writer, max_bytes=10_000, max_batch=4)
    assert queue.offer(0, 1)
    assert writer.entered.wait(TIMEOUT_S)
    for i in range(1, 11):
        assert queue.offer(i, 1)
    writer.gate.set()
    assert queue.flush(TIMEOUT_S)
    assert writer.batches == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    queue.close()


def test_a_failing_batch_does_not_stop_the_writer():
    writer = GatedWriter(fail_first=True)
    writer.gate.set()
    queue = SpillQueue(writer, max_bytes=100, max_batch=1)
    assert queue.offer(0, 10)
    assert queue.flush(TIMEOUT_S)
    assert queue.offer(1, 10)
    assert queue.flush(TIMEOUT_S)
    assert writer.batches == [[], [1]]
    queue.close()


def test_close_drains_then_refuses():
    writer = GatedWriter()
    queue = SpillQueue(writer, max_bytes=100, max_batch=8)
    for i in range(3):
        queue.offer(i, 1)
    writer.gate.set()
    queue.close()
    assert [i for batch in writer.batches for i in batch] == [0, 1, 2]
    assert not queue.offer(3, 1)


def test_flush_times_out_while_the_writer_is_stuck():
    writer = GatedWriter()
    queue = SpillQueue(writer, max_bytes=100)
    queue.offer(0, 1)
    assert not queue.flush(0.1)
    writer.gate.set()
    queue.close()


def test_with_several_writers_a_stuck_write_does_not_hold_back_the_next_items():
    stuck, written = threading.Event(), []

    def write(items: list[int]) -> None:
        if items == [0]:
            stuck.wait(2 * TIMEOUT_S)  # the first write hangs (a slow connection)
        written.extend(items)

    queue = SpillQueue(write, max_bytes=1000, max_batch=1, writers=2)
    assert queue.offer(0, 100)
    assert queue.offer(1, 100) and queue.offer(2, 100)
    try:
        wait_until(lambda: written == [1, 2], "the other writer wrote items 1 and 2 while 0 hangs")
    finally:
        stuck.set()
    assert queue.flush(TIMEOUT_S) and sorted(written) == [0, 1, 2]
    queue.close()
