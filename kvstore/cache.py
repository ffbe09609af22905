"""A stampede-safe value cache on Redis: the region in front of kvstore.singleflight.

    cache = Cache(redis.Redis.from_url(settings.redis.cache_url), settings.redis.keys,
                  name="chat_template", ttl_s=300)
    value = cache.get_or_build(key, build=expensive_function)

- Each value carries its logical expiry inside (kvstore.envelope); the key's physical
  TTL is that plus `grace_s`, so a stale value stays servable while one caller
  rebuilds it. Both are jittered (±`jitter`) so a batch written together spreads out.
- `get_or_build` is `SingleFlight.run` with a lookup that reads and decodes the key and
  a build that runs the caller's function, times it and stores the result.
- Values are encoded with msgpack by default (never pickle: the cache is shared by
  every worker, and unpickling is code execution). `None` is a storable value;
  `NO_VALUE` means nothing is stored.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, TypeVar, Union

import msgspec
import redis

from kvfleet.constants import Keys
from kvstore import envelope, metrics
from kvstore.errors import BlobError
from kvstore.expiry import DEFAULT_JITTER, jittered, physical_ttl_ms
from kvstore.singleflight import NO_VALUE, Entry, NoValueType, SingleFlight

log = logging.getLogger(__name__)

T = TypeVar("T")


class Cache:
    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        *,
        name: str = "cache",
        ttl_s: float = 60.0,
        grace_s: float = 60.0,
        jitter: float = DEFAULT_JITTER,
        lock_ttl_s: float = 10.0,
        wait_timeout_s: float = 30.0,
        poll_s: float = 0.25,
        early_refresh_beta: float = 1.0,
        use_lock: bool = True,
        lock_client: Optional[redis.Redis] = None,
        encode: Callable[[Any], bytes] = msgspec.msgpack.encode,
        decode: Callable[[Union[bytes, memoryview]], Any] = msgspec.msgpack.decode,
    ) -> None:
        """`client` stores the values; `lock_client` (default: the same) holds the locks.

        The cache instance runs `allkeys-lru`, which may evict a lock key under memory
        pressure and let a second builder in. That only costs a duplicate build; pass
        the `noeviction` state instance as `lock_client` to rule it out.
        `name` labels the metrics. See SingleFlight for the lock and wait settings.
        """
        if ttl_s <= 0 or grace_s < 0:
            raise ValueError(f"ttl_s must be > 0 and grace_s >= 0, got {ttl_s}, {grace_s}")
        self.client = client
        self.keys = keys
        self.name = name
        self.ttl_s = ttl_s
        self.grace_s = grace_s
        self.jitter = jitter
        self.encode = encode
        self.decode = decode
        self.flight = SingleFlight(
            lock_client or client, name=name, lock_ttl_s=lock_ttl_s, wait_timeout_s=wait_timeout_s,
            poll_s=poll_s, early_refresh_beta=early_refresh_beta, use_lock=use_lock,
        )

    def get_or_build(self, key: str, build: Callable[[], T], *, ttl_s: Optional[float] = None) -> T:
        """The value under `key`, built by `build()` once across the fleet when missing.

        Fresh: returned. Stale: returned, unless this caller wins the rebuild lock, in
        which case it rebuilds in this thread and returns the new value. Missing: one
        caller builds, the others wait for it (at most `wait_timeout_s`).
        An exception from `build` reaches the caller that ran it; waiters then retry.
        """

        def build_and_store() -> T:
            started = time.perf_counter()
            value = build()
            # Stored even if our lease was lost meanwhile: the value is as good as the
            # one the taker-over will store, and the last write wins harmlessly.
            self.set(key, value, ttl_s=ttl_s, build_s=time.perf_counter() - started)
            return value

        return self.flight.run(self.keys.lock(key), lambda: self.entry(key), build_and_store)

    def entry(self, key: str) -> Union[Entry[Any], NoValueType]:
        """The stored value with its expiry, fresh or stale; NO_VALUE when absent or corrupt."""
        raw = self.client.get(key)
        if raw is None:
            return NO_VALUE
        try:
            env = envelope.unpack(raw)
            value = self.decode(env.payload)
        except (BlobError, msgspec.DecodeError) as exc:
            # Never serve what we cannot read; delete it so the next caller rebuilds.
            metrics.CORRUPT_VALUES.labels(self.name).inc()
            log.warning("deleting an undecodable cache value", extra={"key": key, "error": str(exc)})
            self.client.delete(key)
            return NO_VALUE
        return Entry(value, env.expires_at, env.build_s)

    def get(self, key: str) -> Any:
        """The stored value even if stale, or NO_VALUE; never builds."""
        entry = self.entry(key)
        return entry if entry is NO_VALUE else entry.value

    def set(self, key: str, value: Any, *, ttl_s: Optional[float] = None, build_s: float = 0.0) -> None:
        logical_s = jittered(self.ttl_s if ttl_s is None else ttl_s, self.jitter)
        blob = envelope.pack(self.encode(value), time.time() + logical_s, build_s)
        self.client.set(key, blob, px=physical_ttl_ms(logical_s, self.grace_s))

    def delete(self, key: str) -> None:
        self.client.delete(key)
