"""Redis scripts called at once from many threads, sent as one pipeline (group commit).

    batch = ScriptBatch(client)
    reply = batch.run(script, keys, args)     # what `script(keys=keys, args=args)` returns

A worker runs each job in a task thread of its own, and the jobs of one Celery message
(or of one engine step) reach the same Redis call within microseconds of each other:
the prefix lookup, the flight's claim and release, the result's write. Each such call
alone costs a round trip, and in a process whose threads share one GIL every blocking
read hands the GIL over and waits to get it back (issue 16: a worker's step took 4.3×
its own CPU time). So calls are queued, and one caller at a time, the leader, sends
the queue as one pipeline without a transaction and hands each caller its own reply:

- the first caller finds nobody sending and sends its call at once, alone (an idle
  fleet pays nothing: no timer, no extra thread);
- callers that arrive while a pipeline is on the wire queue up and wait; when it
  returns, its leader wakes the first of them to send the next one with all of them.

A call so waits at most for the pipeline in flight and its own. Each script stays
atomic on its own, as a lone call is; a pipeline only shares the round trip and never
orders anything that was not ordered. A connection error fails every call of its
pipeline, as it would have failed each alone; a reply that is an error fails only its
own call. producer/autopipeline.py does the same for the API's event loop.
"""

from __future__ import annotations

import threading
from typing import Any, Optional, Sequence

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

#: The most calls one pipeline carries: a bound on the leader's own latency.
MAX_BATCH = 128


class _Call:
    __slots__ = ("script", "keys", "args", "ready", "lead", "reply", "error")

    def __init__(self, script: Script, keys: Sequence[Any], args: Sequence[Any]) -> None:
        self.script, self.keys, self.args = script, keys, args
        self.ready = threading.Event()
        self.lead = False  # woken to send the next pipeline, not with a reply
        self.reply: Any = None
        self.error: Optional[BaseException] = None


class ScriptBatch:
    def __init__(self, client: redis.Redis, *, max_batch: int = MAX_BATCH) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.client = client
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._queued: list[_Call] = []
        self._sending = False  # a leader is sending (or about to): newcomers queue
        #: Pipelines sent and calls they carried (tests and benchmarks read them).
        self.pipelines = 0
        self.calls = 0

    def run(self, script: Script, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        """The script's reply, as `script(keys=keys, args=args)` would give it (or its error)."""
        call = _Call(script, keys, args)
        with self._lock:
            self._queued.append(call)
            lead = not self._sending
            self._sending = True
        if not lead:
            call.ready.wait()
            lead = call.lead
        if lead:
            self._send()
        if call.error is not None:
            raise call.error
        return call.reply

    def run_all(self, calls: Sequence[tuple[Script, Sequence[Any], Sequence[Any]]]) -> list[Any]:
        """Several calls of one caller, queued together (so they share a pipeline, with
        each other and with other threads' calls): each call's reply, or its own error
        as the value in its place (a caller of several settles each on its own)."""
        mine = [_Call(script, keys, args) for script, keys, args in calls]
        if not mine:
            return []
        with self._lock:
            self._queued.extend(mine)
            lead = not self._sending
            self._sending = True
        if lead:
            self._send()
        for call in mine:
            call.ready.wait()
            if call.lead:
                # Woken to send the next pipeline (ours is the oldest call queued): the
                # pipeline's end sets `ready` again, with the reply.
                call.lead = False
                call.ready.clear()
                self._send()
                call.ready.wait()
        return [call.error if call.error is not None else call.reply for call in mine]

    def _send(self) -> None:
        """Send the queue's oldest calls (the leader's among them: it is the oldest), then
        make the next caller in the queue the leader, or stop sending."""
        with self._lock:
            calls, self._queued = self._queued[:self.max_batch], self._queued[self.max_batch:]
        try:
            self._execute(calls)
        finally:
            with self._lock:
                following = self._queued[0] if self._queued else None
                self._sending = following is not None
            for call in calls:
                call.ready.set()
            if following is not None:
                following.lead = True
                following.ready.set()

    def _execute(self, calls: list[_Call]) -> None:
        self.pipelines += 1
        self.calls += len(calls)
        try:
            if len(calls) == 1:  # alone: no pipeline object to build
                replies: list[Any] = [_outcome(calls[0], self.client)]
            else:
                with self.client.pipeline(transaction=False) as pipe:
                    for call in calls:
                        # EVALSHA, not the Script: a pipeline holding a registered script
                        # first asks Redis whether it is loaded, a round trip of its own.
                        pipe.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
                    replies = pipe.execute(raise_on_error=False)
        except Exception as exc:  # noqa: BLE001 - the connection failed: every call of it fails
            for call in calls:
                call.error = exc
            return
        for call, outcome in zip(calls, replies):
            if isinstance(outcome, NoScriptError):  # Redis lost its scripts (a restart, SCRIPT FLUSH)
                outcome = _outcome(call, self.client)  # loads it, then runs it
            if isinstance(outcome, BaseException):
                call.error = outcome
            else:
                call.reply = outcome


def _outcome(call: _Call, client: redis.Redis) -> Any:
    """A lone call's reply (the Script loads itself if Redis lost it), or its own error."""
    try:
        return call.script(keys=call.keys, args=call.args, client=client)
    except redis.ResponseError as exc:  # the script's own error: its caller's, not the batch's
        return exc
