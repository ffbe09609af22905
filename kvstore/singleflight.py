"""One builder per key across the fleet; every other caller serves the old value or waits.

The primitive knows nothing about what it builds nor where values live. It takes two
collaborators per call, as dogpile's `Lock` does:

- `lookup() -> Entry | NO_VALUE`: read the current value and its logical expiry;
- `build() -> value`: make a new value *and store it* where `lookup` will find it;

and uses the Redis lease of kvstore.lock as its mutex, so the callers may be threads,
processes or hosts. kvstore.cache puts single values behind it; kvstore.coldtier puts
whole KV prefixes behind it.

What one call does (nginx's `proxy_cache_lock` plus `proxy_cache_use_stale updating`):

    entry found    lock free                        lock held by another caller
    fresh          return it                        return it
    stale          take the lock, build, return it  return the stale value
    none           take the lock, build, return it  wait for the holder's release, then
                                                    read; after `wait_timeout_s` build
                                                    without the lock

A stale entry is rebuilt *by the caller that wins the lock*, in its own thread: it pays
the build's latency, everyone else keeps getting the stale value at once. XFetch may
treat a fresh entry as stale a little before its expiry (kvstore.expiry.xfetch_due).

Waiters learn of a release from a pub/sub message on a channel named like the lock
key, and poll every `poll_s` as well, because a holder killed mid-build announces
nothing: its lease simply expires and the next poll takes it over.

Holders' leases are renewed by one `Renewer` thread per flight, not a thread per build:
a build shorter than a third of `lock_ttl_s` costs no renewal at all.

With `recheck="after_builds"` (the cold tier's prefixes, where nearly every miss is a
prompt nobody shares) a miss that takes the lock skips dogpile's double check unless
a build under that lock stored a value lately: such a holder leaves a record beside the
lock on release (`{lock_key}:stored`, for `lock_ttl_s`), and taking the lock reads it in
the same round trip. A miss then costs the claim and the release, two round trips. A
caller paused for longer than the record lives between its miss and its claim builds
again after a build that stored: at worst twice, as a waiter that times out does.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Callable, Generic, Iterator, Optional, TypeVar, Union

import redis

from kvfleet.scriptbatch import ScriptBatch
from kvstore import metrics
from kvstore.expiry import xfetch_due
from kvstore.lock import Lease, Renewer

log = logging.getLogger(__name__)

T = TypeVar("T")


class NoValueType:
    """The type of `NO_VALUE`: "nothing stored", distinct from a stored None."""

    _instance: "NoValueType | None" = None

    def __new__(cls) -> "NoValueType":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "NO_VALUE"


NO_VALUE = NoValueType()


@dataclass(frozen=True)
class Entry(Generic[T]):
    value: T
    #: Logical expiry, `time.time()` seconds; `math.inf` for "never stale".
    expires_at: float
    #: How long the value took to build (XFetch's δ); 0 when unknown.
    build_s: float = 0.0

    def stale(self, now: float) -> bool:
        return now >= self.expires_at


Lookup = Callable[[], Union[Entry[T], NoValueType]]


@dataclass(frozen=True)
class Held:
    """A missing value's lock taken by `claim_many`, for a build computed elsewhere
    (the cold tier's prefix: the job itself, in the engine); `finish_held` ends it."""

    lease: Lease
    started: float  # perf_counter() at the claim

# Take the lock (SET NX PX, as Lease.acquire) and say in the same round trip whether a
# build under it stored a value lately (its holder left KEYS[2] on release): 0 held by
# another, 1 taken and no build stored anything within the record's life, 2 taken after one.
_CLAIM = """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end
return 1 + redis.call('EXISTS', KEYS[2])
"""
# Release a holder's lock if nobody waits for its value, and say so, in one round trip
# (waiters listen on the lock's channel, so PUBSUB NUMSUB counts them): -1 the lease is
# no longer ours, 0 released (nobody to tell), n > 0 the number waiting (still held).
# Atomic, so a waiter that subscribes after the count finds the lock gone and takes it.
_RELEASE_UNLESS_WAITED = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local waiting = redis.call('PUBSUB', 'NUMSUB', KEYS[1])[2]
if waiting == 0 then redis.call('DEL', KEYS[1]) end
return waiting
"""
#: How `run` looks again under the lock after a miss: "always" (dogpile's double
#: check), or "after_builds": only if a build under this lock stored a value in the
#: last `lock_ttl_s` (see the module docstring).
RECHECKS = ("always", "after_builds")


class SingleFlight:
    def __init__(
        self,
        client: redis.Redis,
        *,
        name: str = "cache",
        lock_ttl_s: float = 10.0,
        wait_timeout_s: float = 30.0,
        poll_s: float = 0.25,
        early_refresh_beta: float = 1.0,
        use_lock: bool = True,
        recheck: str = "always",
    ) -> None:
        """`client` holds the locks and carries the wake-ups (the values may live elsewhere).

        lock_ttl_s: how long a dead builder blocks others; renewed every third of it while
            the build runs, so it need not cover the build time, only a stall.
        wait_timeout_s: a waiter builds the value itself after this long; bounds the
            damage of a builder that hangs while its renewer thread keeps the lease.
        poll_s: the longest a waiter sleeps between checks; bounds how late it notices
            the lease of a killed builder expire.
        early_refresh_beta: XFetch's β; 0 disables early refresh, 1 is the paper's optimum.
        use_lock: False turns the protection off (every caller that misses builds); it
            exists for the tests and benchmark that show what the lock prevents.
        recheck: "always", or "after_builds" where values are stored by this flight's
            builds (others, e.g. the cold tier's spills, may land too: one of those
            stored in the instant between the caller's miss and its claim is rebuilt,
            a cost and never a wrong value); see the module docstring.
        """
        if lock_ttl_s <= 0 or wait_timeout_s < 0 or poll_s <= 0:
            raise ValueError("lock_ttl_s and poll_s must be > 0 and wait_timeout_s >= 0")
        if recheck not in RECHECKS:
            raise ValueError(f"recheck must be one of {RECHECKS}, got {recheck!r}")
        self.client = client
        self.name = name
        self.lock_ttl_ms = int(lock_ttl_s * 1000)
        self.wait_timeout_s = wait_timeout_s
        self.poll_s = poll_s
        self.early_refresh_beta = early_refresh_beta
        self.use_lock = use_lock
        self.recheck = recheck
        self._claim = client.register_script(_CLAIM) if client is not None else None
        self._release_unless_waited = client.register_script(_RELEASE_UNLESS_WAITED) if client is not None else None
        #: The claims and releases of builds running at once share round trips.
        self._batch = ScriptBatch(client) if client is not None else None
        #: Renews every lease this flight's builders hold: one thread, not one per build.
        self.renewer = Renewer(name=f"lease-renewer-{name}")

    def run(self, lock_key: str, lookup: Lookup[T], build: Callable[[], T], *, missing: bool = False,
            stored: Optional[Callable[[], bool]] = None, store_if_waited: Optional[Callable[[], None]] = None) -> T:
        """The value behind `lock_key`: found, built by this caller, or built by another.
        `missing`: the caller has just read that there is no value (a read of its own
        that covers `lookup`'s), so the first lookup is skipped; the one under the lock,
        and a waiter's, still run (under the lock, with recheck="after_builds", only
        after a build that stored). `stored()`, asked once `build` returned: whether it
        stored a value where `lookup` finds it (default: it did); with False the holder
        leaves no record, as nothing could be found.

        `store_if_waited`: `build` only computes the value, and this stores it, called
        only when a missing value's build is done and somebody waits for it; nobody
        waiting, the release and the count are one round trip and nothing is stored (the
        cold tier's prefixes: nearly every prompt is nobody else's)."""
        entry = NO_VALUE if missing else lookup()
        if entry is NO_VALUE:
            metrics.MISSES.labels(self.name).inc()
            return self._build_or_wait(lock_key, lookup, build, stored, store_if_waited)
        now = time.time()
        early = not entry.stale(now)
        if early and not xfetch_due(now, entry.expires_at, entry.build_s, self.early_refresh_beta):
            metrics.HITS.labels(self.name, "fresh").inc()
            return entry.value
        return self._refresh_or_serve(lock_key, entry, lookup, build, early=early)

    # --- several missing values at once, built elsewhere -------------------------
    def claim_many(self, lock_keys: list[str]) -> list[Optional[Held]]:
        """Take the locks of several missing values in one round trip, for builds that
        a caller drives without blocking (a message's jobs, whose prefill is each job
        itself): a `Held` for each lock taken, whose build the caller computes and then
        ends with `finish_held`, as `run(missing=True, store_if_waited=...)` would for
        one blocking caller. None where that caller should call `run` instead: the lock
        is another's (`run` waits for it), a build under it stored a value lately and a
        look again is due (released again here; `run` claims anew and looks), or the
        claim failed (`run` meets the error itself)."""
        if not self.use_lock or not lock_keys:
            return [None] * len(lock_keys)
        leases = [Lease(self.client, key, self.lock_ttl_ms) for key in lock_keys]
        replies = self._batch.run_all([(self._claim, [lease.key, self._stored_key(lease.key)],
                                        [lease.token, self.lock_ttl_ms]) for lease in leases])
        held: list[Optional[Held]] = []
        for lease, claimed in zip(leases, replies):
            if isinstance(claimed, BaseException) or not claimed:
                held.append(None)
                continue
            if claimed == 2 or self.recheck == "always":
                try:
                    self._release(lease)
                except redis.RedisError as exc:  # not renewed: it expires within one lock TTL
                    log.warning("could not release a lock taken for a look again",
                                extra={"lock": lease.key, "error": str(exc)})
                held.append(None)
                continue
            metrics.MISSES.labels(self.name).inc()
            self.renewer.hold(lease)  # as `_build_holding`: renewed while the build runs
            held.append(Held(lease, time.perf_counter()))
        return held

    def finish_held(self, builds: list[tuple[Held, Callable[[], None], Callable[[], bool]]]) -> None:
        """End builds of `claim_many` whose values are computed, each given with its
        `store_if_waited` and `stored` (as `run` takes them): counting who waits and,
        where nobody does, releasing are one round trip for all of them; each build
        somebody waits for is stored, then released and announced. A Redis error on
        one build is logged: its lock is released if it can be, else it expires."""
        if not builds:
            return
        replies = self._batch.run_all([(self._release_unless_waited, [held.lease.key], [held.lease.token])
                                       for held, _, _ in builds])
        for (held, store_if_waited, stored), waiting in zip(builds, replies):
            metrics.BUILDS.labels(self.name).inc()
            metrics.BUILD_SECONDS.labels(self.name).observe(time.perf_counter() - held.started)
            released = not isinstance(waiting, BaseException) and int(waiting) <= 0
            stored_one = False
            try:
                if not released and not isinstance(waiting, BaseException):
                    store_if_waited()
                    stored_one = stored()
            except Exception:  # noqa: BLE001 - the waiters find no value and build it themselves
                log.warning("could not store a build somebody waited for", extra={"lock": held.lease.key},
                            exc_info=True)
            finally:
                self.renewer.drop(held.lease)
                if not released:
                    try:
                        self._release(held.lease, stored=stored_one)
                    except redis.RedisError as exc:  # it expires within one lock TTL
                        log.warning("could not release a build's lock", extra={"lock": held.lease.key,
                                                                                "error": str(exc)})

    # --- an entry exists: one caller refreshes it, the others serve it ------------
    def _refresh_or_serve(self, lock_key: str, entry: Entry[T], lookup: Lookup[T], build: Callable[[], T], *, early: bool) -> T:
        if not self.use_lock:
            return self._build(build)
        lease = Lease(self.client, lock_key, self.lock_ttl_ms)
        if not lease.acquire():
            # Another caller is rebuilding it right now: serve what we have.
            metrics.HITS.labels(self.name, "fresh" if early else "stale").inc()
            return entry.value
        if early:
            metrics.EARLY_REFRESHES.labels(self.name).inc()
        return self._build_holding(lease, lookup, build, seen=entry, took_over=False)

    # --- nothing stored: one caller builds, the others wait for it -----------------
    def _build_or_wait(self, lock_key: str, lookup: Lookup[T], build: Callable[[], T],
                       stored: Optional[Callable[[], bool]] = None,
                       store_if_waited: Optional[Callable[[], None]] = None) -> T:
        if not self.use_lock:
            value = self._build(build)
            if store_if_waited is not None:
                store_if_waited()  # no lock, no count of who waits: store, as a build would
            return value
        lease = Lease(self.client, lock_key, self.lock_ttl_ms)
        claimed = self._batch.run(self._claim, [lock_key, self._stored_key(lock_key)], [lease.token, self.lock_ttl_ms])
        if claimed:
            # 1 under "after_builds": no build under this lock stored a value for a lock TTL
            # before our claim, so none landed after our miss: no need to look again.
            recheck = claimed == 2 or self.recheck == "always"
            return self._build_holding(lease, lookup, build, seen=NO_VALUE, took_over=False, recheck=recheck,
                                       stored=stored, store_if_waited=store_if_waited)
        metrics.LOCK_WAITS.labels(self.name).inc()
        deadline = time.monotonic() + self.wait_timeout_s
        with self._wakeups(lock_key) as wakeups:
            while True:
                # Look again now that we are subscribed: a holder that stored its value
                # and released between our acquire() and our SUBSCRIBE told nobody,
                # but its value is there. From here on no release goes unheard.
                entry = lookup()
                if entry is not NO_VALUE:
                    return entry.value
                # Free and still no value: the holder failed, or died and its lease
                # expired. Exactly one waiter wins this SET NX and builds again.
                if lease.acquire():
                    return self._build_holding(lease, lookup, build, seen=NO_VALUE, took_over=True, stored=stored,
                                               store_if_waited=store_if_waited)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                wakeups.get_message(timeout=min(self.poll_s, remaining))
        # The holder keeps its lease alive but has not finished: it may hang forever, and
        # this caller has a deadline of its own. Building a second copy is the lesser harm.
        metrics.WAIT_TIMEOUTS.labels(self.name).inc()
        log.warning("gave up waiting for the builder; building without the lock",
                    extra={"lock": lock_key, "waited_s": self.wait_timeout_s})
        value = self._build(build)
        if store_if_waited is not None:
            store_if_waited()  # others may wait as this caller did
        return value

    def _build_holding(self, lease: Lease, lookup: Lookup[T], build: Callable[[], T], *, seen, took_over: bool,
                       recheck: bool = True, stored: Optional[Callable[[], bool]] = None,
                       store_if_waited: Optional[Callable[[], None]] = None) -> T:
        """Build while holding `lease`; release it and wake the waiters however it ends."""
        stored_one = False
        released = False
        try:
            # Run the getter again under the lock: the previous holder may have stored a
            # newer value between our lookup and our acquire (dogpile's double check).
            entry = lookup() if recheck else NO_VALUE
            if entry is not NO_VALUE and (seen is NO_VALUE or entry.expires_at > seen.expires_at):
                return entry.value
            if took_over:
                metrics.LOCK_TAKEOVERS.labels(self.name).inc()
                log.info("took over a rebuild lock whose holder left no value", extra={"lock": lease.key})
            # Renew while building, so a build longer than a third of the lease TTL keeps
            # it; a holder that dies stops renewing and loses it after at most one TTL.
            self.renewer.hold(lease)
            try:
                value = self._build(build)
                if store_if_waited is not None:
                    waiting = self.release_unless_waited(lease)
                    released = waiting <= 0  # nobody waits (released now), or the lease was lost
                    if not released:
                        store_if_waited()
            finally:
                self.renewer.drop(lease)
            stored_one = not released and (stored is None or stored())
            return value
        finally:
            if not released:
                self._release(lease, stored=stored_one)

    def _build(self, build: Callable[[], T]) -> T:
        started = time.perf_counter()
        value = build()
        metrics.BUILDS.labels(self.name).inc()
        metrics.BUILD_SECONDS.labels(self.name).observe(time.perf_counter() - started)
        return value

    def release_unless_waited(self, lease: Lease) -> int:
        """Release `lease` if nobody waits for its value: 0 released, n > 0 the number
        waiting (still held), -1 the lease is no longer ours. One round trip, shared
        with the builds that end at the same moment."""
        return int(self._batch.run(self._release_unless_waited, [lease.key], [lease.token]))

    # --- wake-ups -----------------------------------------------------------------
    @staticmethod
    def _stored_key(lock_key: str) -> str:
        """Where a holder whose build stored a value records it, for `lock_ttl_s` (see
        the module docstring)."""
        return f"{lock_key}:stored"

    # Pub/sub channels live apart from the keyspace, so the lock key names the channel.
    def _release(self, lease: Lease, *, stored: bool = False) -> None:
        """Release the lease (compare-and-delete: never frees one we already lost),
        record a build that stored a value (`stored`), and announce it, in one round trip; a
        connection error raises, as a release's would, and a refused announcement costs
        the waiters at most `poll_s`, as below."""
        with self.client.pipeline(transaction=False) as pipe:
            if stored and self.recheck == "after_builds":  # "always" looks again anyway
                # Before the release: a pipeline's commands may interleave with other
                # clients', and a newcomer that took the freed lock before the record
                # existed would skip the double check and build again.
                pipe.set(self._stored_key(lease.key), b"1", px=self.lock_ttl_ms)
            lease.release(pipe=pipe)
            pipe.publish(lease.key, b"released")
            *_, announced = pipe.execute(raise_on_error=False)
        if isinstance(announced, Exception):
            log.warning("could not announce a lock release", extra={"lock": lease.key, "error": str(announced)})

    @contextlib.contextmanager
    def _wakeups(self, lock_key: str) -> Iterator[redis.client.PubSub]:
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(lock_key)
            yield pubsub
        finally:
            pubsub.close()
