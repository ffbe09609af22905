"""The cold tier in front of every job: prefetch its prefix, decide load or recompute,
and prefill a shared prefix once fleet-wide.

Before a job reaches the engine, in the job's own task thread (never the step thread),
`PrefixSharing.prepare()`:

1. finds how much of the prompt's full blocks this worker holds (hot) and, after that,
   how much the Redis tier holds (cold), in one round trip (a script of EXISTS that
   stops at the first hole);
2. if at least `min_blocks` blocks are in neither tier, runs the fleet-wide single
   flight keyed on the first such block (kvstore.coldtier.ensure_prefix): requests that
   share a system prompt or a document meet on that key whatever they ask after it, so
   one worker prefills the shared blocks and writes them, the others wait and load
   them, and each computes only its own suffix. The builder's prefill is the job
   itself (`PrefixSharingEngine` hands `prepare` a way to submit it): the flight's lock
   is held until the job's first token, and the blocks are copied out and written only
   if someone waits for them then (SingleFlight's `store_if_waited`). A prompt nobody
   shares, the common case, so costs three calls and no thread: step 1's EXISTS run on
   the cache instance, then on the state instance the flight's claim (SET NX, and
   whether a build of this prefix wrote its blocks lately, in one script: only then
   does it look for them again under the lock), and at the job's first token one
   script that counts the waiters and, finding none, releases the lock. Each goes
   through a `ScriptBatch` (kvfleet/scriptbatch.py), so the jobs of one message or one
   engine step share each round trip. The lease is renewed by the flight's one shared
   thread, and only if the prefill outlasts a third of its TTL (issue 16: a separate
   one-token prefix run and a write per unique prompt cut a fleet's short jobs by a
   third; then five round trips and a renewal thread per build). A caller that starts
   waiting just after the builder looked finds the lock gone, takes it and prefills
   itself: at worst twice, never once per caller;
3. if blocks are cold, asks `FetchDecision` (kvstore/decision.py) whether loading them
   is sooner than recomputing them here, and if so fetches them now straight into pool
   blocks the engine sets aside for them (`BlockManager.reserve`), validates them
   there, and has the engine adopt the valid ones into its hot tier
   (`BlockManager.adopt`): the job's admission finds them cached. No Redis and no copy
   on the step thread, so a running batch never waits on a load.

The adopted blocks stay held until the job's first token arrives (its admission is
over by then) or it ends, so no other allocation evicts them first.

The jobs of a several-job message take the same steps together and without blocking
(`PrefixSharingEngine.start_many`, driven by workers/batch.py): step 1's lookups for
all of them in one round trip, the flights' claims in another, each builder submitted
at once with its first token reported back, and the builds reported together ended in
one round trip (`end_builds`). A job that would have to wait — cold blocks to load, a
flight another worker holds — is left to `generate`, on a thread of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from kvfleet.contracts import Sampling
from kvstore import metrics as kv_metrics
from kvstore.coldtier import ColdTier, PrefixBuild, PrefixSource
from kvstore.decision import FetchDecision
from workers.engine import Engine, RequestHandle

log = logging.getLogger("kvfleet.worker")

#: How the prefix step submits the job itself: `submit(on_token)` -> its handle.
Submit = Callable[[Callable[[int], None]], RequestHandle]


@dataclass(frozen=True)
class Prepared:
    """What `prepare` did for one job."""

    source: Optional[PrefixSource] = None  # the single flight ran: built here, or found cold
    held: list[int] = field(default_factory=list)  # pool blocks loaded for it, held until admitted
    decision: Optional[str] = None  # "load" | "recompute", when part of the prefix was cold


@dataclass(frozen=True)
class Plan:
    """What the prefix step must do for one job (`PrefixSharing.plan_many`)."""

    kind: str  # "none": submit it as it is | "build": its prefix's single flight | "load": cold blocks to fetch
    hashes: list[str]
    hot: int  # blocks from the first that this worker holds
    covered: int  # ... that this worker or the cold tier holds


@dataclass(frozen=True)
class Request:
    """One request of `PrefixSharingEngine.start_many`: `Engine.submit`'s arguments."""

    request_id: str
    prompt: Sequence[int]
    max_new_tokens: int
    sampling: Sampling
    priority_rank: int = 1
    stop: tuple[str, ...] = ()
    on_token: Optional[Callable[[int], None]] = None
    cache_salt: Optional[str] = None


@dataclass(frozen=True)
class Running:
    """A request `start_many` submitted; `build`: its prefix's flight, which this worker
    holds until the prompt is computed (then `end_builds`)."""

    handle: RequestHandle
    build: Optional[tuple[PrefixBuild, Callable[[], None]]] = None  # the flight and how to store its blocks


class PrefixSharing:
    def __init__(self, engine: Engine, tier: ColdTier, *, min_blocks: int = 4,
                 prefill_tokens_per_s: float = 0.0) -> None:
        """`prefill_tokens_per_s`: this worker's prefill rate for the load-or-recompute
        decision; 0 = measured by the engine (`Engine.tokens_per_s`)."""
        self.engine = engine
        self.tier = tier
        self.min_blocks = min_blocks
        self.decision = FetchDecision(
            blob_bytes=tier.blob_nbytes, block_tokens=engine.block_manager.block_size,
            prefill_tokens_per_s=(lambda: prefill_tokens_per_s) if prefill_tokens_per_s > 0 else engine.tokens_per_s)

    def prepare(self, job_id: str, prompt: Sequence[int], cache_salt: str | None = None, *,
                submit: Optional[Submit] = None) -> Prepared:
        """Make the prompt's prefix ready (see the module docstring); `held` blocks are
        to be released (`BlockManager.release`, on the step thread) once the job is
        admitted. The hashes are those of the job's
        cache namespace, so the flight never tells a job that another tenant prefilled
        the same prompt. With `submit`, a builder's prefill is the job itself:
        `submit(on_token)` submits it (the caller keeps its handle); without, the
        builder prefills the prompt in a one-token run of its own first."""
        blocks = self.engine.block_manager
        hashes = blocks.prefix_hashes(prompt, cache_salt)
        # A hint read off the step thread (see BlockManager.cached_block_ids): blocks it
        # calls hot may be evicted before admission, which then recomputes them.
        hot = len(blocks.cached_block_ids(hashes))
        if hot == len(hashes):
            return Prepared()
        cold = self.tier.present_run(hashes[hot:])
        covered = hot + cold
        source = None
        if len(hashes) - covered >= self.min_blocks:
            def build() -> None:
                if submit is None:
                    self._prefill_and_store(job_id, prompt, hashes, cache_salt, cold_run=(hot, covered))
                else:
                    self._run_until_computed(submit)

            # present_run stopped at hashes[covered]: the flight need not look again. With
            # the job as the prefill, its blocks are stored only if somebody waits for them.
            store = None if submit is None else lambda: self._store(hashes, (hot, covered))
            source = self.tier.ensure_prefix(hashes, build, first_missing=covered, known_missing=True, store=store)
            # Built here is nearly every unique prompt's case: worth a line only when debugging.
            log.log(logging.DEBUG if source is PrefixSource.BUILT else logging.INFO, "shared prefix",
                    extra={"job_id": job_id, "blocks": len(hashes) - covered, "source": source.value})
            if source is PrefixSource.BUILT:
                return Prepared(source)  # computed here: hot now
            cold = self.tier.present_run(hashes[hot:])  # what the builder wrote
        if cold == 0:
            return Prepared(source)
        if not self.decision.should_load(cold):
            return Prepared(source, decision="recompute")
        return Prepared(source, self._load(prompt, hashes, cache_salt, hot, cold), "load")

    def plan_many(self, prompts: Sequence[tuple[Sequence[int], Optional[str]]]) -> list[Plan]:
        """Step 1 of `prepare` for several prompts (each with its cache salt) at once: the
        cold tier's lookups are one round trip for all of them."""
        blocks = self.engine.block_manager
        hashed = []
        for prompt, salt in prompts:
            hashes = blocks.prefix_hashes(prompt, salt)
            hashed.append((hashes, len(blocks.cached_block_ids(hashes))))  # a hint, as in `prepare`
        colds = self.tier.present_runs([hashes[hot:] for hashes, hot in hashed])
        plans = []
        for (hashes, hot), cold in zip(hashed, colds):
            covered = hot + cold
            if len(hashes) - covered >= self.min_blocks:
                kind = "build"
            elif cold and self.decision.prefers_load(cold):
                kind = "load"  # `prepare` counts the decision when it loads
            else:
                if cold:
                    kv_metrics.KV_DECISIONS.labels("recompute").inc()
                kind = "none"
            plans.append(Plan(kind, hashes, hot, covered))
        return plans

    def _load(self, prompt: Sequence[int], hashes: list[str], cache_salt: str | None, hot: int, cold: int) -> list[int]:
        """Fetch the cold run straight into pool blocks set aside for it, and have the
        engine adopt those that came in valid: the job's admission then finds them in
        the hot tier. The blocks stay held (so no other allocation evicts them before
        the job is admitted); the caller releases them."""
        blocks, bs = self.engine.block_manager, self.engine.block_manager.block_size
        ids = self.engine.call_soon(lambda: blocks.reserve(cold)).result()  # on the step thread, between steps
        landed = 0
        try:
            started = time.perf_counter()
            landed, nbytes = self.tier.fetch_into(hashes[hot:hot + len(ids)], ids,
                                                  rebuild_s=self.decision.recompute_seconds(cold) or 0.0)
            if nbytes:
                self.decision.observe_fetch(nbytes, time.perf_counter() - started)
        finally:
            filled = [(ids[j], hashes[hot + j], hashes[hot + j - 1] if hot + j else cache_salt,
                       tuple(prompt[(hot + j) * bs:(hot + j + 1) * bs])) for j in range(landed)]

            def publish() -> None:
                blocks.adopt(filled)
                blocks.release(ids[landed:])  # not filled, or invalid: free again

            self.engine.call_soon(publish).result()
        return ids[:landed]

    def _prefill_and_store(self, job_id: str, prompt: Sequence[int], hashes: list[str],
                           cache_salt: str | None, *, cold_run: tuple[int, int]) -> None:
        # One token of output is the cheapest request that computes every prompt block.
        self.engine.generate(f"{job_id}/prefix", prompt, 1, Sampling(), cache_salt=cache_salt)
        self._store(hashes, cold_run)

    def _store(self, hashes: list[str], cold_run: tuple[int, int]) -> None:
        """Write the prompt's computed blocks to the cold tier, those of `cold_run` (there
        already) aside: copied on the step thread, where no step can reuse a block
        mid-copy, written from this one."""
        self.tier.write(self.engine.call_soon(lambda: self._copy(hashes, cold_run)).result())

    @staticmethod
    def _run_until_computed(submit: Submit) -> None:
        """The builder's prefill, as the job itself: submit it and wait until its prompt
        is computed (its first token, or its end); the flight then counts who waits and
        has `store` write the blocks only for them."""
        computed = threading.Event()
        handle = submit(lambda token: computed.set())  # on the step thread: O(1)
        handle.add_done_callback(lambda _: computed.set())  # ended (or failed) before a token
        computed.wait()

    def _copy(self, hashes: list[str], cold_run: tuple[int, int]) -> list:
        held = self.engine.block_manager.cached_block_ids(hashes)  # exact here: we are on the step thread
        keep = [i for i in range(len(held)) if not cold_run[0] <= i < cold_run[1]]  # the cold run is there already
        return self.tier.copy_out([hashes[i] for i in keep], [held[i] for i in keep])


class PrefixSharingEngine:
    """The engine as the job runner sees it, with the prefix step before each job."""

    def __init__(self, engine: Engine, sharing: PrefixSharing) -> None:
        self.engine = engine
        self.sharing = sharing

    def generate(self, request_id: str, prompt_tokens: Sequence[int], max_new_tokens: int, sampling: Sampling, *,
                 priority_rank: int = 1, stop: tuple[str, ...] = (), on_token: Callable[[int], None] | None = None,
                 cache_salt: str | None = None):
        held: list[int] = []
        submitted: list[RequestHandle] = []  # the job, if the prefix step submitted it (as the builder)

        def submit(hook: Callable[[int], None]) -> RequestHandle:
            def tokens(token: int) -> None:
                hook(token)
                if on_token is not None:
                    on_token(token)

            submitted.append(self.engine.submit(request_id, prompt_tokens, max_new_tokens, sampling,
                                                priority_rank=priority_rank, stop=stop, on_token=tokens,
                                                cache_salt=cache_salt))
            return submitted[0]

        try:
            held = self.sharing.prepare(request_id, prompt_tokens, cache_salt, submit=submit).held
        except Exception:  # noqa: BLE001 - the cold tier is an optimisation: never fail a job for it
            log.warning("shared-prefix step failed; prefilling locally", extra={"job_id": request_id}, exc_info=True)
        if submitted:  # built here: the job runs already (whatever happened to the write after)
            return submitted[0].result()
        blocks = self.engine.block_manager
        # At the first token (the step thread: queue it, never wait) or at the end.
        release = _Once((lambda: self.engine.call_soon(lambda: blocks.release(held))) if held else (lambda: None))

        def first_token(token: int) -> None:
            release()  # admitted: the job holds the blocks it found cached now
            if on_token is not None:
                on_token(token)

        try:
            return self.engine.generate(request_id, prompt_tokens, max_new_tokens, sampling,
                                        priority_rank=priority_rank, stop=stop,
                                        on_token=first_token if held or on_token else None, cache_salt=cache_salt)
        finally:
            release()

    def start_many(self, requests: Sequence[Request], computed: Callable[[int], None]) -> list[Optional[Running]]:
        """Submit several requests past their prefix step without blocking on any of them
        (a Celery message's jobs, run side by side by one thread, workers/batch.py):
        the prefix lookups are one round trip for all, the flights' claims another.
        A request whose prefix this worker now builds calls `computed(i)` (i: its
        index; on the step thread, O(1)) once, at its first token or at its end if it
        ends without one; the caller then hands its `Running.build` to `end_builds`. None for a request that
        needs what only `generate` does: cold blocks to load, a flight another worker
        holds (or one to look at again), or a prefix step that failed."""
        try:
            plans = self.sharing.plan_many([(r.prompt, r.cache_salt) for r in requests])
        except Exception:  # noqa: BLE001 - `generate` tries again, and prefills locally if it fails too
            log.warning("shared-prefix lookups failed; each job tries on its own", exc_info=True)
            return [None] * len(requests)
        flights = [i for i, plan in enumerate(plans) if plan.kind == "build"]
        try:
            claimed = self.sharing.tier.claim_prefixes([(plans[i].hashes, plans[i].covered) for i in flights])
        except Exception:  # noqa: BLE001 - as above
            log.warning("shared-prefix claims failed; each job tries on its own", exc_info=True)
            claimed = [None] * len(flights)
        builds = dict(zip(flights, claimed))
        started: list[Optional[Running]] = []
        for i, (request, plan) in enumerate(zip(requests, plans)):
            build = builds.get(i)
            if plan.kind == "load" or (plan.kind == "build" and build is None):
                started.append(None)
                continue
            on_token = request.on_token
            if build is not None:
                store = (lambda plan=plan: self.sharing._store(plan.hashes, (plan.hot, plan.covered)))
                first = _Once(lambda i=i: computed(i))  # once: not a wake-up per token

                def tokens(token: int, first: _Once = first,
                           on_token: Optional[Callable[[int], None]] = on_token) -> None:
                    first()
                    if on_token is not None:
                        on_token(token)
                on_token = tokens
            try:
                handle = self.engine.submit(request.request_id, request.prompt, request.max_new_tokens,
                                            request.sampling, priority_rank=request.priority_rank,
                                            stop=request.stop, on_token=on_token, cache_salt=request.cache_salt)
            except Exception:  # noqa: BLE001 - e.g. the engine's input checks: `generate` meets them again
                if build is not None:  # nothing computed: the waiters, if any, build it themselves
                    self.end_builds([(build, lambda: None)])
                started.append(None)
                continue
            if build is not None:
                handle.add_done_callback(lambda _, first=first: first())  # ended (or failed) before a token
            started.append(Running(handle, None if build is None else (build, store)))
        return started

    def end_builds(self, builds: list[tuple[PrefixBuild, Callable[[], None]]]) -> None:
        """The prompts of these `start_many` builds are computed: store the blocks
        somebody waits for, release every flight (SingleFlight.finish_held)."""
        try:
            self.sharing.tier.finish_prefixes(builds)
        except Exception:  # noqa: BLE001 - the cold tier is an optimisation; a lock left expires
            log.warning("could not end shared-prefix builds", exc_info=True)

    def cancel(self, request_id: str) -> bool:
        return self.engine.cancel(request_id)


class _Once:
    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Optional[Callable[[], None]] = fn
        self._lock = threading.Lock()

    def __call__(self) -> None:
        if self._fn is None:  # called already: no lock for each of a build's later tokens
            return
        with self._lock:
            fn, self._fn = self._fn, None
        if fn is not None:
            fn()
