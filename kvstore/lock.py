"""A Redis lease: `SET NX PX` with a random owner token, renewed while held, released
only by its owner. It knows nothing about what it guards.

Used for the run lease of a job (one worker executes a job at a time) and for the
rebuild lock of a cache entry (one caller rebuilds a missing prefix).

Races, and why each is safe:
- Two callers `acquire()` at once: `SET NX` lets exactly one of them in.
- The holder dies: nobody renews, the key expires after `ttl_ms`, and the next
  `acquire()` succeeds (a takeover). A holder that was only paused (GC, swap) and
  comes back finds `renew()` / `release()` refuse, because the token no longer matches.
- Release after expiry and takeover: compare-and-delete in Lua, so a late release can
  never delete the new owner's lease.
"""

from __future__ import annotations

import secrets
import threading
from typing import Optional

import redis

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


class Lease:
    def __init__(self, client: redis.Redis, key: str, ttl_ms: int, *, token: Optional[str] = None) -> None:
        if ttl_ms <= 0:
            raise ValueError(f"lease ttl_ms must be > 0, got {ttl_ms}")
        self.client = client
        self.key = key
        self.ttl_ms = ttl_ms
        self.token = token or secrets.token_hex(16)
        self._release = client.register_script(_RELEASE)
        self._renew = client.register_script(_RENEW)
        self._stop = threading.Event()
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

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    if not self.renew():
                        return  # lost: see the docstring
                except redis.RedisError:
                    continue  # transient; the next tick retries before the TTL runs out

        self._stop.clear()
        self._renewer = threading.Thread(target=loop, name=f"lease-{self.key}", daemon=True)
        self._renewer.start()
