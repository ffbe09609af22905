"""What the scheduler waits on while jobs wait for budget: a finishing job's tokens.

While the policy holds jobs it cannot place, only freed tokens (or a new worker) can
change its decision. Polling the ledger at a fixed interval left a slot empty for up to
that interval after every job (issue 16); instead the job store's `finish` publishes on
`Keys.ledger_freed` whenever it releases a reservation, and `BudgetWake.wait` returns as
soon as one arrives. The interval stays as the bound (new workers, reclaimed leases and
new Kafka records are noticed within it), and a Redis error degrades to it.

A wake-up gathers: it returns `gather_s` after the first release, with every release
seen by then. Jobs that ran in one engine step end together, and their releases
arrive over a few milliseconds; a round of admission at each of them would send a
Celery message per freed slot, each of which costs the scheduler and a worker's
consumer the same whatever it carries (docs/benchmarks.md, "Job path").
"""

from __future__ import annotations

import logging
import time

import redis

log = logging.getLogger("kvfleet.scheduler")


class BudgetWake:
    def __init__(self, client: redis.Redis, channel: str) -> None:
        self.client = client
        self.channel = channel
        self._pubsub: redis.client.PubSub | None = None

    def wait(self, timeout_s: float, *, gather_s: float = 0.0) -> int:
        """Block until tokens are freed or `timeout_s` passed, then gather releases for
        `gather_s` more; the releases seen (0: none)."""
        try:
            if self._pubsub is None:
                self._pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                self._pubsub.subscribe(self.channel)
            deadline = time.monotonic() + timeout_s
            while True:
                remaining = max(0.0, deadline - time.monotonic())
                # None on a timeout, and also at once for the subscription's confirmation
                # (ignored): then wait out the rest.
                message = self._pubsub.get_message(timeout=remaining)
                if message is not None:
                    break
                if remaining <= 0:
                    return 0
            seen = 0
            gather_until = time.monotonic() + gather_s
            while True:  # every release since the last wait, and until gather_until: one wake-up
                while message is not None:
                    seen += message["type"] == "message"
                    message = self._pubsub.get_message(timeout=0)
                remaining = gather_until - time.monotonic()
                if remaining <= 0:
                    return seen
                message = self._pubsub.get_message(timeout=remaining)
        except redis.RedisError as exc:
            log.warning("budget wake-up unavailable; waiting the interval", extra={"error": str(exc)})
            self.close()
            time.sleep(timeout_s)
            return 0

    def close(self) -> None:
        if self._pubsub is not None:
            try:
                self._pubsub.close()
            except redis.RedisError:
                pass
            self._pubsub = None
