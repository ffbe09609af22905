"""Redis scripts called in the same turn of the event loop, sent as one pipeline.

    pipeline = AutoPipeline(client)
    reply = await pipeline.run(script, keys, args)      # what `await script(keys=, args=)` returns

Every submission makes two Redis calls (the quota, the record); with 64 of them in
flight, one turn of the loop often starts many (the Kafka acknowledgements of one batch
resume their submissions together). redis.asyncio spends about 100 µs of CPU on a lone
call (a connection checkout, a write, a read loop, a release) and about 30 µs on each
call of a pipeline, so a call is queued and the queue is sent, as one pipeline without
a transaction, when the loop next comes round (`call_soon`): a call waits at most that
turn, and a lone call goes alone. Each script is atomic on its own, as before; a
pipeline only saves the round trips, never orders anything that was not ordered.

Pipelines do not wait for each other: calls queued while one is in flight go in the
next, on another connection of the pool.
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

import redis.asyncio as aredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError


class AutoPipeline:
    def __init__(self, client: aredis.Redis) -> None:
        self.client = client
        self._queued: list[tuple[AsyncScript, Sequence[Any], Sequence[Any], asyncio.Future]] = []
        self._sending: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks

    async def run(self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """The script's reply, as `await script(keys=keys, args=args)` would give it."""
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        if not self._queued:  # the first call of this turn sends the turn's calls
            loop.call_soon(self._send)
        self._queued.append((script, keys, args, reply))
        return await reply

    def _send(self) -> None:
        calls, self._queued = self._queued, []
        # A task of its own, so that the caller that queued first is not the one to
        # await the round trip for everyone (its cancellation must not cancel theirs).
        task = asyncio.get_running_loop().create_task(self._execute(calls))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _execute(self, calls: list) -> None:
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for script, keys, args, _ in calls:
                    pipe.evalsha(script.sha, len(keys), *keys, *args)
                replies = await pipe.execute(raise_on_error=False)
        except Exception as exc:  # noqa: BLE001 - the connection failed: every call of the pipeline fails with it
            for *_, reply in calls:
                if not reply.done():  # its caller may have been cancelled meanwhile
                    reply.set_exception(exc)
            return
        for (script, keys, args, reply), outcome in zip(calls, replies):
            if isinstance(outcome, NoScriptError):  # Redis lost its scripts (a restart, SCRIPT FLUSH)
                try:
                    outcome = await script(keys=keys, args=args)  # loads it, then runs it
                except Exception as exc:  # noqa: BLE001 - handed to the caller, like any reply
                    outcome = exc
            if reply.done():
                continue
            if isinstance(outcome, Exception):
                reply.set_exception(outcome)
            else:
                reply.set_result(outcome)
