"""A bounded background writer: producers hand items over without waiting, a few
threads write them in batches.

The engine's eviction hook runs on the decode loop; a Redis round trip there would
stall every running sequence. So the hook only copies the block out and `offer()`s it
here. The queue is bounded in bytes, not items, because its items are megabytes: when
the writer falls behind, `offer()` refuses (the caller counts a drop) instead of
blocking the engine or growing without bound. A dropped spill costs a recompute later,
never correctness.

Several writer threads (`writers`) each take the next batch as soon as they are free,
so one slow write never holds the others back behind a barrier.

It knows nothing about Redis or tensors: `write_batch(items)` does the writing.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class SpillQueue(Generic[T]):
    def __init__(
        self,
        write_batch: Callable[[list[T]], None],
        *,
        max_bytes: int,
        max_batch: int = 8,
        writers: int = 1,
        name: str = "spill",
    ) -> None:
        """max_bytes: the most bytes waiting or being written at once (the memory bound).
        max_batch: items per `write_batch` call; one pipelined round trip each.
        writers: threads calling `write_batch` at once (it must be safe to call so).
        """
        if max_bytes <= 0 or max_batch <= 0 or writers <= 0:
            raise ValueError(f"max_bytes, max_batch and writers must be > 0, got {max_bytes}, {max_batch}, {writers}")
        self._write_batch = write_batch
        self.max_bytes = max_bytes
        self.max_batch = max_batch
        self._items: collections.deque[tuple[T, int]] = collections.deque()
        self._cond = threading.Condition()
        self._pending_bytes = 0  # queued + being written; what max_bytes bounds
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(writers)]
        for thread in self._threads:
            thread.start()

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def has_room(self, nbytes: int) -> bool:
        """A cheap check before the caller copies anything out; `offer` decides."""
        return not self._closed and self._pending_bytes + nbytes <= self.max_bytes

    def offer(self, item: T, nbytes: int) -> bool:
        """Queue `item` for writing; False (and nothing queued) when full or closed."""
        with self._cond:
            if self._closed or self._pending_bytes + nbytes > self.max_bytes:
                return False
            self._items.append((item, nbytes))
            self._pending_bytes += nbytes
            self._cond.notify_all()
            return True

    def flush(self, timeout_s: float) -> bool:
        """Wait until every item offered so far has been written (or failed); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending_bytes:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Refuse new items, write what is queued, stop the threads."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if not self._items:  # closed and drained
                    log.info("spill writer stopped: closed and drained")
                    return
                # Take what is there, up to a batch: under load batches fill up and
                # amortise the round trip; when idle one item goes out at once.
                batch = [self._items.popleft() for _ in range(min(self.max_batch, len(self._items)))]
            try:
                self._write_batch([item for item, _ in batch])
            except Exception:
                # write_batch handles the errors it expects; anything else must not kill
                # the writer, or every later spill would queue up and be dropped.
                log.exception("spill batch failed", extra={"items": len(batch)})
            finally:
                with self._cond:
                    self._pending_bytes -= sum(nbytes for _, nbytes in batch)
                    self._cond.notify_all()
