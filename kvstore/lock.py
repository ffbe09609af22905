"""A Redis lease: `SET NX PX` with a unique owner token, renewed while held, released
only by its owner. It knows nothing about what it guards.

Used for the run lease of a job (one worker executes a job at a time) and for the
rebuild lock of a cache entry (one caller rebuilds a missing prefix).

Two ways to keep a lease alive while its work runs: `Lease.keep_alive()`, a thread of
its own, or a `Renewer` that many leases share: one thread for all the rebuild locks of
a flight (kvstore.singleflight), so a build costs no thread, and one shorter than a
third of the TTL (a short job's prefill, the common case) no renewal either.

Races, and why each is safe:
- Two callers `acquire()` at once: `SET NX` lets exactly one of them in.
- The holder dies: nobody renews, the key expires after `ttl_ms`, and the next
  `acquire()` succeeds (a takeover). A holder that was only paused (GC, swap) and
  comes back finds `renew()` / `release()` refuse, because the token no longer matches.
- Release after expiry and takeover: compare-and-delete in Lua, so a late release can
  never delete the new owner's lease.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import secrets
import threading
import time
import weakref
from typing import Optional

import redis
from redis.commands.core import Script

log = logging.getLogger(__name__)

# Delete only if we still own it; one round trip, atomic in Redis.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
# Extend only if we still own it.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


#: client -> its (release, renew) scripts. A Lease is made per job run and per rebuild
#: lock, and registering a script hashes its text and builds an encoder each time
#: (about 0.1 ms a job of a worker's CPU, issue 16); the scripts are the same for every
#: lease of a client. Weak: a client dropped takes its entry with it.
_SCRIPTS: "weakref.WeakKeyDictionary[redis.Redis, tuple[Script, Script]]" = weakref.WeakKeyDictionary()


def _scripts(client: redis.Redis) -> tuple[Script, Script]:
    scripts = _SCRIPTS.get(client)
    if scripts is None:  # two threads may both register: the same scripts, either wins
        scripts = _SCRIPTS[client] = (client.register_script(_RELEASE), client.register_script(_RENEW))
    return scripts


class _Tokens:
    """Owner tokens: a random 128-bit prefix per process and a count. Unique across
    processes and hosts (the prefix) and within one (the count), as a random token per
    lease is, without the system call for fresh randomness that each of those cost (a
    lease per job run, and another per prefix build: issue 16). A forked child draws a
    prefix of its own."""

    def __init__(self) -> None:
        self._reseed()
        os.register_at_fork(after_in_child=self._reseed)

    def _reseed(self) -> None:
        self._prefix = secrets.token_hex(16)
        self._count = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}-{next(self._count):x}"  # itertools.count: atomic under the GIL


_TOKENS = _Tokens()


class Lease:
    def __init__(self, client: redis.Redis, key: str, ttl_ms: int, *, token: Optional[str] = None) -> None:
        if ttl_ms <= 0:
            raise ValueError(f"lease ttl_ms must be > 0, got {ttl_ms}")
        self.client = client
        self.key = key
        self.ttl_ms = ttl_ms
        self.token = token or _TOKENS.next()
        self._release, self._renew = _scripts(client)
        self._stop: Optional[threading.Event] = None  # made by `keep_alive`, the only one that waits on it
        self._renewer: Optional[threading.Thread] = None

    def acquire(self) -> bool:
        """One attempt; True if we now hold the lease."""
        return bool(self.client.set(self.key, self.token, nx=True, px=self.ttl_ms))

    def renew(self, *, pipe: Optional[redis.client.Pipeline] = None) -> bool:
        """Extend the lease by its TTL if we still own it. With `pipe`, the renewal is
        queued on that pipeline instead (its reply, 1 or 0, comes with `execute`)."""
        if pipe is not None:
            self._renew(keys=[self.key], args=[self.token, self.ttl_ms], client=pipe)
            return True
        return bool(self._renew(keys=[self.key], args=[self.token, self.ttl_ms]))

    def release(self, *, pipe: Optional[redis.client.Pipeline] = None) -> bool:
        """Stop renewing and delete the key if we still own it; False if we did not.
        With `pipe`, the delete is queued on that pipeline instead (its reply, 1 or 0,
        comes with `execute`)."""
        if self._stop is not None:
            self._stop.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(timeout=self.ttl_ms / 1000)
        self._renewer = None
        if pipe is not None:
            # EVAL with the text: a pipeline holding a registered script would first ask
            # Redis whether it is loaded (SCRIPT EXISTS), a round trip of its own.
            pipe.eval(_RELEASE, 1, self.key, self.token)
            return True
        return bool(self._release(keys=[self.key], args=[self.token]))

    def keep_alive(self) -> None:
        """Renew every third of the TTL from a daemon thread until `release()`, or until
        a renewal finds the lease gone (expired or taken over): renewing then would only
        fail again. Nothing here tells the holder; a holder whose writes must not outlive
        its lease checks ownership where it writes (the job store compares the run
        lease's token).

        A third leaves two renewal chances before expiry if Redis is briefly slow.
        """
        interval = self.ttl_ms / 3000
        stop = self._stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval):
                try:
                    if not self.renew():
                        return  # lost: see the docstring
                except redis.RedisError:
                    continue  # transient; the next tick retries before the TTL runs out

        self._renewer = threading.Thread(target=loop, name=f"lease-{self.key}", daemon=True)
        self._renewer.start()


class Renewer:
    """One daemon thread renewing every lease `hold` hands it, each a third of its TTL
    after it was taken or last renewed, until `drop`; the renewals due at one moment go
    in one pipelined round trip per client. The thread starts with the first `hold`.

    Races, and why each is safe:
    - `drop` while a renewal of that lease is on the wire: the renewal either lands
      before the holder's release (which then deletes the key) or after it (and finds
      the token gone: it extends nothing). A lease is never renewed once released.
    - A renewal finds the lease gone (expired, evicted, taken over): it is dropped, as
      `keep_alive`'s thread stops; renewing it again would only fail again. The holder
      is not told (see `Lease.keep_alive`).
    - Redis errors: the lease stays, and is tried again a third of the TTL later,
      which leaves a second chance before it expires.
    """

    def __init__(self, *, name: str = "lease-renewer") -> None:
        self.name = name
        # id(lease) -> (lease, the sequence number of its one live heap entry), while held;
        # a heap entry whose number is not that one is stale (its lease dropped, or held again).
        self._held: dict[int, tuple[Lease, int]] = {}
        self._due: list[tuple[float, int, int]] = []  # heap of (monotonic due time, sequence number, id(lease))
        self._order = itertools.count()
        self._changed = threading.Condition()
        self._thread: Optional[threading.Thread] = None

    def hold(self, lease: Lease) -> None:
        """Renew `lease` (just acquired) until `drop(lease)`."""
        with self._changed:
            seq = self._schedule(lease)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            # Wake the thread only if this lease is now the first due: otherwise it sleeps
            # until an earlier one, and then looks at the heap again. Leases of one TTL come
            # due in the order they were taken, so a busy flight wakes nobody per build.
            if self._due[0][1] == seq:
                self._changed.notify()

    def drop(self, lease: Lease) -> None:
        """Stop renewing `lease` (its heap entry is skipped when it comes due)."""
        with self._changed:
            self._held.pop(id(lease), None)

    @property
    def held(self) -> int:
        """How many leases are being renewed."""
        with self._changed:
            return len(self._held)

    def _schedule(self, lease: Lease) -> int:
        """Due a third of the TTL from now (under the condition); its sequence number."""
        seq = next(self._order)
        self._held[id(lease)] = (lease, seq)
        heapq.heappush(self._due, (time.monotonic() + lease.ttl_ms / 3000, seq, id(lease)))
        return seq

    def _live(self, entry: tuple[float, int, int]) -> bool:
        held = self._held.get(entry[2])
        return held is not None and held[1] == entry[1]

    def _run(self) -> None:
        while True:
            with self._changed:
                due = self._take_due()
            try:
                self._renew(due)
            except Exception:  # noqa: BLE001 - one thread renews every lease: it must not die of one bug
                log.exception("lease renewal failed", extra={"leases": len(due)})
                with self._changed:
                    for lease in due:  # still held: try again a third of the TTL later
                        if self._held.get(id(lease), (None,))[0] is lease:
                            self._schedule(lease)

    def _take_due(self) -> list[Lease]:
        """Wait (under the condition) until some held lease is due; pop those that are."""
        while True:
            while self._due and not self._live(self._due[0]):
                heapq.heappop(self._due)  # dropped since it was scheduled
            if not self._due:
                self._changed.wait()
                continue
            wait_s = self._due[0][0] - time.monotonic()
            if wait_s > 0:
                self._changed.wait(wait_s)
                continue
            due, now = [], time.monotonic()
            while self._due and self._due[0][0] <= now:
                entry = heapq.heappop(self._due)
                if self._live(entry):
                    due.append(self._held[entry[2]][0])
            return due

    def _renew(self, due: list[Lease]) -> None:
        by_client: dict[int, list[Lease]] = {}
        for lease in due:
            by_client.setdefault(id(lease.client), []).append(lease)
        for leases in by_client.values():
            try:
                with leases[0].client.pipeline(transaction=False) as pipe:
                    for lease in leases:
                        # EVAL with the text, as in `release`: no SCRIPT EXISTS round trip.
                        pipe.eval(_RENEW, 1, lease.key, lease.token, lease.ttl_ms)
                    renewed = pipe.execute()
            except redis.RedisError:
                renewed = [True] * len(leases)  # transient: keep them, retry a third of the TTL later
            with self._changed:
                for lease, ok in zip(leases, renewed):
                    if self._held.get(id(lease), (None,))[0] is not lease:
                        continue  # dropped meanwhile
                    if ok:
                        self._schedule(lease)
                    else:
                        del self._held[id(lease)]  # lost: see the class docstring
