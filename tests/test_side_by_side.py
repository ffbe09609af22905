"""The jobs of a several-job message run side by side on its task thread
(workers/batch.py): each ends as it would on a thread of its own (done, cancelled,
rejected by the engine, a duplicate), with its lease released; and the prefix step of
all of them together (workers/prefix.py `start_many`) costs one round trip on the cache
and two on the state instance for every unique prompt of the message, leaves a prompt
whose flight another worker holds to `generate`, and stores the blocks of a build that
another worker waits for. The real engine and the real Redis instances; the task body
is the one Celery runs, called directly."""

from __future__ import annotations

import queue
import threading
import time

import msgspec
import pytest
import redis
from celery import Celery

from kvfleet import constants
from kvfleet.constants import Keys
from kvfleet.contracts import JobRequest, JobState, Priority, Sampling, to_builtins
from kvfleet.jobstore import Admit, JobStore
from kvfleet.settings import ColdTierSettings
from kvstore.blob import Quant
from kvstore.coldtier import ColdTier, PrefixSource, connect
from kvstore.hooks import ColdTierHooks
from workers.engine import Engine, EngineConfig
from workers.model.loader import load_model
from workers.prefix import PrefixSharing, PrefixSharingEngine, Request, Running
from workers.batch import run_side_by_side
from workers.runner import JobRunner, Outcome, Started
from workers.tasks import register
from tests.recording_redis import Recording

TIMEOUT_S = 60.0  # the most a wait below may take; only a broken behaviour reaches it


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _prompt(seed: int, n: int = 200) -> list[int]:
    return [(i * 37 + seed * 101 + 11) % 250 for i in range(n)]  # 12 full blocks of 16


# --- a message's jobs through the task body --------------------------------------
@pytest.fixture
def worker(redis_client, prefix):
    """The run_jobs task body over a real engine (builtin:bench: its greedy runs go on for
    hundreds of tokens, long enough to cancel one mid-run)."""
    engine = Engine(load_model("builtin:bench"), EngineConfig())
    store = JobStore(redis_client, Keys(prefix))
    runner = JobRunner(store, redis_client, engine, engine.loaded.tokenizer, worker_id="w", lease_s=5.0)
    app = Celery("side-by-side")
    register(app, runner, threads=8)
    try:
        yield store, app.tasks[constants.CELERY_JOBS_TASK_NAME], runner
    finally:
        engine.shutdown()


def _message(store: JobStore, jobs: list[tuple[str, int]]) -> list[JobRequest]:
    requests = [JobRequest(job_id=f"m{i}-{time.monotonic_ns()}", tenant="acme", priority=Priority.NORMAL,
                           model="builtin:bench", prompt=prompt, max_new_tokens=n, submitted_at=time.time(),
                           sampling=Sampling(temperature=0.0)) for i, (prompt, n) in enumerate(jobs)]
    store.create_many(requests)
    assert all(a.reserved for a in store.admit_many([Admit(r.job_id, 64, r.tenant, r.priority) for r in requests],
                                                    capacity=10**9, lease_s=600, now=time.time(), by="test"))
    return requests


def test_each_job_of_a_message_ends_as_it_would_alone(worker, redis_client):
    store, run_jobs, runner = worker
    jobs = _message(store, [("quick 0", 1), ("quick 1", 4), ("a long job 3", 3000), ("x" * 40_000, 4),
                            ("done already", 1), ("asks too much", 1)])
    quick0, quick1, long_job, too_long, done, invalid = (j.job_id for j in jobs)
    store.start(done, now=time.time(), worker="another")
    store.fail(done, JobState.CANCELLED, "cancelled", "cancelled by the client", now=time.time())
    outcome: list = []
    raws = [to_builtins(j) for j in jobs]
    raws[-1]["max_new_tokens"] = 10**9  # a task no scheduler sends: it does not decode
    thread = threading.Thread(target=lambda: outcome.append(run_jobs.run(raws)))
    thread.start()
    _wait_for(lambda: store.state(quick1) == JobState.DONE and long_job in runner.running_jobs(),
              "the quick jobs done while the long one runs")
    # Cancelled as the API cancels: the run's watch stops it in the engine.
    store.fail(long_job, JobState.CANCELLED, "cancelled", "cancelled by the client", now=time.time())
    thread.join(TIMEOUT_S)
    # The prompt longer than the model's context is the engine's to refuse, the task
    # that does not decode the runner's: each on a thread of its own, as before.
    assert outcome == [["done", "done", "cancelled", "failed", "duplicate", "invalid"]]
    assert [store.state(j.job_id) for j in jobs] == [JobState.DONE, JobState.DONE, JobState.CANCELLED,
                                                     JobState.FAILED, JobState.CANCELLED, JobState.FAILED]
    for job_id in (quick0, quick1):
        result = msgspec.json.decode(redis_client.hget(store.keys.job(job_id), "result"))
        assert result["worker"] == "w" and result["attempt"] == 1 and result["usage"]["completion_tokens"] >= 1
    assert not any(redis_client.exists(store.keys.run_lease(j.job_id)) for j in jobs)  # every lease released
    assert runner.running_jobs() == []


# --- the prefix step of a message's jobs at once ----------------------------------
def _sharing(cache_url: str, state, prefix: str, cache=None) -> tuple[PrefixSharingEngine, ColdTier]:
    hooks = ColdTierHooks(prefetch_only=True)
    engine = Engine(load_model("builtin:tiny"), EngineConfig(num_blocks=128, max_model_len=512), hooks=hooks)
    cache = cache if cache is not None else connect(cache_url)
    hooks.tier = ColdTier(cache, Keys(prefix), engine.block_manager.fingerprint, engine.kv_cache,
                          kernels=engine.kernels, quant=Quant.NONE, ttl_s=120, grace_s=60,
                          spill_max_bytes=ColdTierSettings().spill_max_bytes, lock_client=state)
    hooks.give_back = engine.block_manager.give_back
    return PrefixSharingEngine(engine, PrefixSharing(engine, hooks.tier, min_blocks=4)), hooks.tier


def _close(*pairs) -> None:
    for sharing, tier in pairs:
        sharing.engine.shutdown()
        tier.close()


def _start(sharing: PrefixSharingEngine, prompts: list[list[int]], name: str):
    computed: list[int] = []
    running = sharing.start_many([Request(f"{name}{i}", p, 1, Sampling()) for i, p in enumerate(prompts)],
                                 computed.append)
    return running, computed


def test_a_messages_unique_prompts_cost_one_lookup_a_claim_and_a_release_for_all(cache_redis_url, redis_url, prefix):
    cache, state = Recording.from_url(cache_redis_url), Recording.from_url(redis_url)
    pair = sharing, tier = _sharing(cache_redis_url, state, prefix, cache=cache)
    try:
        warm, computed = _start(sharing, [_prompt(99)], "warm")  # loads the scripts
        _wait_for(lambda: computed, "the warm-up's prompt computed")
        sharing.end_builds([warm[0].build])
        before = cache.round_trips, state.round_trips
        running, computed = _start(sharing, [_prompt(k) for k in range(3)], "u")
        assert all(r is not None and r.build is not None for r in running)  # each builds its own prefix
        for r in running:
            assert len(r.handle.result(TIMEOUT_S).tokens) == 1
        assert sorted(computed) == [0, 1, 2]
        sharing.end_builds([r.build for r in running])
        assert (cache.round_trips - before[0], state.round_trips - before[1]) == (1, 2), state.trips[before[1]:]
        blocks = sharing.engine.block_manager
        for k in range(3):
            lock = tier._prefix_lock(blocks.prefix_hashes(_prompt(k)), 0)
            assert not state.exists(lock, f"{lock}:stored")  # released; nobody waited, nothing written
    finally:
        _close(pair)


def test_a_prompt_whose_flight_another_worker_holds_is_left_to_generate(cache_redis_url, redis_url, prefix):
    a = _sharing(cache_redis_url, redis.Redis.from_url(redis_url), prefix)
    b = _sharing(cache_redis_url, redis.Redis.from_url(redis_url), prefix)
    try:
        held, _ = _start(a[0], [_prompt(7)], "a")  # worker A builds the prefix, its flight not ended yet
        running, _ = _start(b[0], [_prompt(7), _prompt(8)], "b")
        assert running[0] is None  # B waits for A's build: that is `generate`'s to do, on a thread
        assert running[1] is not None and running[1].build is not None
        running[1].handle.result(TIMEOUT_S)
        b[0].end_builds([running[1].build])
        held[0].handle.result(TIMEOUT_S)
        a[0].end_builds([held[0].build])
    finally:
        _close(a, b)


def test_a_build_another_worker_waits_for_is_stored_and_the_waiter_loads_it(cache_redis_url, redis_url, prefix):
    a = _sharing(cache_redis_url, redis.Redis.from_url(redis_url), prefix)
    b = _sharing(cache_redis_url, redis.Redis.from_url(redis_url), prefix)
    try:
        prompt = _prompt(3)
        running, computed = _start(a[0], [prompt], "a")
        built = running[0].handle.result(TIMEOUT_S)
        _wait_for(lambda: computed == [0], "the builder's prompt computed")
        waited: list = []
        waiter = threading.Thread(target=lambda: waited.append(b[0].generate("b", prompt, 1, Sampling())))
        waiter.start()
        hashes = a[0].engine.block_manager.prefix_hashes(prompt)
        _wait_for(lambda: a[1].prefix_waiters(hashes) == 1, "worker B waiting for A's build")
        a[0].end_builds([running[0].build])  # somebody waits: the blocks are written, then the lock released
        waiter.join(TIMEOUT_S)
        assert waited and waited[0].tokens == built.tokens
        assert waited[0].cached_tokens == len(hashes) * 16  # loaded, not prefilled again
        assert a[1].present_run(hashes) == len(hashes)
    finally:
        _close(a, b)


def test_the_flights_of_start_many_meet_those_of_ensure_prefix(cache_redis_url, redis_url, prefix):
    # A caller of the blocking flight (ensure_prefix) and a build of start_many are one
    # flight: whichever claims first builds, the other waits for it or is left to wait.
    a = _sharing(cache_redis_url, redis.Redis.from_url(redis_url), prefix)
    try:
        prompt = _prompt(5)
        hashes = a[0].engine.block_manager.prefix_hashes(prompt)
        release = threading.Event()
        sources: list = []

        def blocking_build() -> None:
            release.wait(TIMEOUT_S)

        holder = threading.Thread(target=lambda: sources.append(a[1].ensure_prefix(hashes, blocking_build)))
        holder.start()
        _wait_for(lambda: a[1].flight.client.exists(a[1]._prefix_lock(hashes, 0)), "the blocking caller's claim")
        running, _ = _start(a[0], [prompt], "s")
        assert running == [None]
        release.set()
        holder.join(TIMEOUT_S)
        assert sources == [PrefixSource.BUILT]
    finally:
        _close(a)


def test_a_one_job_message_writes_its_result_before_its_flight_ends(cache_redis_url, redis_url, prefix):
    # `run_job` takes the several-job path: the result a client waits for is written
    # first, then the prefix flight (claimed for its unique prompt) ends; `JobRunner.run`
    # ended the flight first, a round trip before the result.
    state = Recording.from_url(redis_url)
    pair = sharing, tier = _sharing(cache_redis_url, state, prefix)
    try:
        store = JobStore(state, Keys(prefix))
        runner = JobRunner(store, state, sharing, sharing.engine.loaded.tokenizer, worker_id="w", lease_s=5.0)
        app = Celery("one-job")
        register(app, runner, threads=8)
        prompt = _prompt(41)
        job = JobRequest(job_id=f"one-{time.monotonic_ns()}", tenant="acme", priority=Priority.NORMAL,
                         model="builtin:tiny", prompt_tokens=prompt, max_new_tokens=1, submitted_at=time.time(),
                         sampling=Sampling(temperature=0.0))
        store.create(job)
        assert store.admit_many([Admit(job.job_id, 64, job.tenant, job.priority)], capacity=10**9, lease_s=600,
                                now=time.time(), by="test")[0].reserved
        assert app.tasks[constants.CELERY_TASK_NAME].run(to_builtins(job)) == "done"
        lock = tier._prefix_lock(sharing.engine.block_manager.prefix_hashes(prompt), 0)
        # Read before any call of the test's own: the job's last trip is its finish.
        flight_ended, result_written = state.last_trip_with(lock), state.last_trip_with(store.keys.job(job.job_id))
        assert flight_ended >= 0 and result_written >= 0, "the job claimed a flight and wrote its result"
        assert result_written < flight_ended, state.sent_args
        assert store.state(job.job_id) == JobState.DONE
        assert not state.exists(lock) and not state.exists(store.keys.run_lease(job.job_id))
    finally:
        _close(pair)


# --- the order of a report's work (logic only: a recording generator and runner) ----
class _Ended:
    """A request that ended before its report was read, as a 1-token job does in the
    step that computes its prompt: its done callback runs at once (RequestHandle's)."""

    def add_done_callback(self, fn) -> None:
        fn(self)

    def result(self, timeout=None):
        return "completion"


class _Recording:
    def __init__(self, fail: bool) -> None:
        self.calls: list[str] = []
        self.fail = fail
        self.engine = self  # the generator and the runner in one: both record into `calls`

    def start_many(self, requests, computed):
        computed(0)
        return [Running(_Ended(), build=("build", lambda: None))]

    def end_builds(self, builds) -> None:
        self.calls.append("end_builds")

    def settle_many(self, finished):
        self.calls.append("settle_many")
        if self.fail:
            raise redis.ConnectionError("the state Redis is gone")
        return [Outcome("done", s.job.job_id) for s, _, _ in finished]


class _Lease:
    def release(self) -> None:
        pass


@pytest.mark.parametrize("fail", [False, True])
def test_a_report_settles_its_ended_jobs_before_it_ends_their_builds(fail):
    # A 1-token job's end comes in the same report as its build's: its result (what its
    # client waits for) is written first, and the flights end even when settling fails.
    recording = _Recording(fail)
    job = JobRequest(job_id="j", tenant="acme", priority=Priority.NORMAL, model="builtin:tiny",
                     prompt="p", max_new_tokens=1, submitted_at=0.0)
    ended = run_side_by_side(recording, [Started(job, _Lease(), None, {}, [1, 2, 3], None, None)])
    assert recording.calls == ["settle_many", "end_builds"]
    assert isinstance(ended[0], redis.ConnectionError) if fail else ended[0] == Outcome("done", "j")


class _EndsLate:
    """A request whose end comes just after the task thread read its first token's
    report on its own: its done callback runs when the thread next finds the queue empty."""

    def __init__(self) -> None:
        self.callbacks = []

    def add_done_callback(self, fn) -> None:
        self.callbacks.append(fn)

    def result(self, timeout=None):
        return "completion"


@pytest.mark.parametrize("max_new_tokens, calls", [(1, ["settle_many", "end_builds"]),
                                                   (2, ["end_builds", "settle_many"])])
def test_a_one_token_jobs_build_ends_after_its_result_even_when_its_end_is_reported_apart(
        monkeypatch, max_new_tokens, calls):
    # The step thread reports a build's first token, then (same step, for a 1-token job)
    # its end; the task thread may wake between the two. A 1-token job's build still ends
    # after its result; a longer job's build ends at its first token, as it should.
    handle = _EndsLate()

    class Queue(queue.SimpleQueue):
        def get_nowait(self):
            if self.empty() and handle.callbacks:
                callbacks, handle.callbacks = handle.callbacks, []
                for fn in callbacks:  # the end arrives now, just after this read found nothing
                    fn(handle)
                raise queue.Empty
            return super().get_nowait()

    monkeypatch.setattr("workers.batch.queue.SimpleQueue", Queue)
    recording = _Recording(False)
    recording.start_many = lambda requests, computed: (computed(0), [Running(handle, build=("b", lambda: None))])[1]
    job = JobRequest(job_id="j", tenant="acme", priority=Priority.NORMAL, model="builtin:tiny",
                     prompt="p", max_new_tokens=max_new_tokens, submitted_at=0.0)
    ended = run_side_by_side(recording, [Started(job, _Lease(), None, {}, [1, 2, 3], None, None)])
    assert recording.calls == calls
    assert ended[0] == Outcome("done", "j")
