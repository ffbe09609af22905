"""Where the engine's threads meet: requests, cancellations and calls in; results out.

Any thread puts work in (`put`, `cancel`, `call`, `stop`). The step thread takes it
out between two steps (`take`, which sleeps while there is nothing to do) and resolves
each request's future exactly once (`resolve`). One condition variable guards every
field here, and nothing in here is touched without it.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from kvfleet.contracts import Completion
from workers.engine.errors import EngineStopped, InvalidRequest
from workers.engine.sequence import Sequence

Call = tuple[Callable[[], Any], "Future[Any]"]


@dataclass(frozen=True)
class Work:
    """Everything that arrived since the step thread last looked."""

    new: list[Sequence]  # in arrival order
    cancelled: list[Sequence]  # still unresolved when taken
    calls: list[Call]


class Inbox:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        # Guarded by _cond:
        self._new: list[Sequence] = []
        self._cancels: set[str] = set()
        self._calls: list[Call] = []
        self._requests: dict[str, tuple[Sequence, Future[Completion]]] = {}  # every request not yet resolved
        self._stopping = False
        self._arrivals = itertools.count()

    # --- any thread ------------------------------------------------------------------

    def put(self, request_id: str, make: Callable[[int], Sequence]) -> "Future[Completion]":
        """Queue a new request. `make(arrival_order)` builds its sequence under the lock,
        so arrival order is the order in which `put`s got in."""
        future: Future[Completion] = Future()
        with self._cond:
            if self._stopping:
                raise EngineStopped("the engine is shut down")
            if request_id in self._requests:
                raise InvalidRequest(f"request {request_id!r} is already in this engine")
            seq = make(next(self._arrivals))
            self._requests[request_id] = (seq, future)
            self._new.append(seq)
            self._cond.notify()
        return future

    def cancel(self, request_id: str) -> bool:
        """False if the request is unknown or already resolved."""
        with self._cond:
            if request_id not in self._requests:
                return False
            self._cancels.add(request_id)
            self._cond.notify()
            return True

    def call(self, fn: Callable[[], Any]) -> "Future[Any]":
        future: Future[Any] = Future()
        with self._cond:
            if self._stopping:
                raise EngineStopped("the engine is shut down")
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()

    # --- the step thread -------------------------------------------------------------

    def take(self, *, idle: bool) -> Work | None:
        """Everything that arrived; while `idle` (no sequence to step), sleep until
        something does. None once stopping."""
        with self._cond:
            while idle and not (self._new or self._cancels or self._calls or self._stopping):
                self._cond.wait()
            if self._stopping:
                return None
            new, self._new = self._new, []
            cancels, self._cancels = self._cancels, set()
            calls, self._calls = self._calls, []
            cancelled = [self._requests[rid][0] for rid in cancels if rid in self._requests]
        return Work(new, cancelled, calls)

    def resolve(self, seq: Sequence, *, completion: Completion | None = None,
                error: Exception | None = None) -> None:
        """Deliver the result or the error to the request's waiter; once per request."""
        with self._cond:
            entry = self._requests.pop(seq.request_id, None)
        if entry is None:
            return  # resolved already
        # Outside the lock: a future runs its done-callbacks in the thread that sets it.
        if error is None:
            entry[1].set_result(completion)
        else:
            entry[1].set_exception(error)

    def taken(self) -> list[Sequence]:
        """The unresolved requests the step thread has taken (not those still queued)."""
        with self._cond:
            queued = {id(seq) for seq in self._new}
            return [seq for seq, _ in self._requests.values() if id(seq) not in queued]

    def close(self) -> tuple[list[Sequence], list[Call]]:
        """Refuse new work from now on; the unresolved requests and the calls never run."""
        with self._cond:
            self._stopping = True
            self._new.clear()
            calls, self._calls = self._calls, []
            return [seq for seq, _ in self._requests.values()], calls
