"""A job's state and result in Redis: one hash per job, moved one way by Lua scripts.

Layout of `kvfleet:job:{job_id}` (a hash):
    state, tenant, priority, request (JobRequest JSON), result (JobResult JSON, once
    terminal), queued_at / admitted_at / started_at / finished_at (unix seconds),
    attempts (times a worker started it), faults (runs an engine fault ended),
    reply_to (only for a job that names one).

Every write is a Lua script that checks the current state against the allowed
transitions first, so a duplicate delivery (a second "admit", a second "finish") finds
the job already moved and changes nothing. Two of them also move the job's token
reservation with the state, with the ledger's own Lua (kvfleet/ledger.py): `admit_many`
(the scheduler) reserves, `finish` (the worker, or a cancel) releases. Every state change is also PUBLISHed on the
job's events channel, which is what wakes a long-polling `GET /v1/jobs/{id}?wait=`.
The message is the new state's name, except from `finish`: there it is the result's
JSON, the same bytes the hash keeps, so a long poll answers without reading the job.

`finish` (and `fail`, through it) is the one place a terminal state is written, by the
API, the scheduler and the workers alike, and the same Lua call appends the result to
the results outbox (`Keys.results_outbox`), which kvfleet/results.py relays to Kafka:
a result is written if and only if it is queued for Kafka, whoever crashes when.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import msgspec
import redis
from redis.commands.core import Script

from kvfleet import constants, ledger
from kvfleet.lua import REDIS_NOW
from kvfleet.scriptbatch import ScriptBatch
from kvfleet.contracts import (
    ALLOWED_TRANSITIONS,
    JobError,
    JobRequest,
    JobResult,
    JobState,
    Priority,
    TERMINAL_STATES,
    Timings,
    decode_request,
    decode_result,
    encode,
)

#: `create(job_key, events_key, tenant, priority, request, queued_at, ttl, reply_to)`:
#: record a new job as queued; an existing id changes nothing. Returns created (1|0),
#: the state and the tenant. A Lua function, so the API's submit script
#: (producer/records.py) records the job with this very code in its own call.
CREATE_FN = """
local function create(job_key, events_key, tenant, priority, request, queued_at, ttl, reply_to)
  local cur = redis.call('HGET', job_key, 'state')
  if cur then
    return 0, cur, redis.call('HGET', job_key, 'tenant')
  end
  redis.call('HSET', job_key, 'state', 'queued', 'tenant', tenant, 'priority', priority,
             'request', request, 'queued_at', queued_at, 'attempts', 0)
  if reply_to ~= '' then redis.call('HSET', job_key, 'reply_to', reply_to) end
  redis.call('EXPIRE', job_key, ttl)
  redis.call('PUBLISH', events_key, 'queued')
  return 1, 'queued', tenant
end
"""

# KEYS: job, job events. ARGV: tenant, priority, request JSON, queued_at, ttl, reply_to ('' = none).
_CREATE = CREATE_FN + """
local created, state, tenant = create(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6])
return {created, state, tenant}
"""

#: Every job's state in one call: KEYS are the job hashes; a missing job's state is nil.
#: One script instead of a pipelined HGET per job, because a worker's run watch asks for
#: every running job's state five times a second, and redis-py spends per command several
#: times what Redis does (issue 16: 2,000 HGETs a second per worker at 200 jobs).
_STATES = """
local states = {}
for i, key in ipairs(KEYS) do
  states[i] = redis.call('HGET', key, 'state')
end
return states
"""
#: Jobs per `_STATES` call: a script holds Redis while it runs, so a batch's 50,000 lines
#: are read a thousand (about half a millisecond of Redis) at a time.
STATES_PER_CALL = 1000

# ARGV: to_state, ttl (0 = keep), allowed-from states joined by ',', then field, value...
_TRANSITION = """
local cur = redis.call('HGET', KEYS[1], 'state')
if not cur then return {0, ''} end
if not string.find(',' .. ARGV[3] .. ',', ',' .. cur .. ',', 1, true) then return {0, cur} end
redis.call('HSET', KEYS[1], 'state', ARGV[1])
local attempts = 0
for i = 4, #ARGV, 2 do
  if ARGV[i] == 'attempts' then
    attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
  else
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
if tonumber(ARGV[2]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
redis.call('PUBLISH', KEYS[2], ARGV[1])
return {1, cur, attempts}
"""

# The one call that ends a job: result, final state, the release of the job's token
# reservation (kvfleet/ledger.py) and the result's entry in the outbox for Kafka,
# together or not at all. The outbox entry carries the result's bytes, not a pointer to
# the job hash: the relay produces exactly what was written, even after the hash expired.
# KEYS: ledger, leases, meta, job, events, run lease, results outbox, ledger-freed channel
# ARGV: to_state, result JSON, finished_at, ttl, allowed-from, job_id, lease token ('' = no check),
#       outbox ttl
_FINISH = ledger.RELEASE + """
local cur = redis.call('HGET', KEYS[4], 'state')
if not cur then return {0, ''} end
if not string.find(',' .. ARGV[5] .. ',', ',' .. cur .. ',', 1, true) then return {0, cur} end
-- Refused only if another runner holds the lease now. A lease that merely expired
-- (this runner stalled past it, and nobody took over) still finishes: the work is done.
if ARGV[7] ~= '' then
  local holder = redis.call('GET', KEYS[6])
  if holder and holder ~= ARGV[7] then return {0, 'lease_lost'} end
end
redis.call('HSET', KEYS[4], 'state', ARGV[1], 'result', ARGV[2], 'finished_at', ARGV[3])
redis.call('EXPIRE', KEYS[4], ARGV[4])
if release(KEYS[1], KEYS[2], KEYS[3], ARGV[6]) == 1 then redis.call('PUBLISH', KEYS[8], ARGV[6]) end
-- The run is over: its lease goes with it (one round trip less per job than a release).
if ARGV[7] ~= '' and redis.call('GET', KEYS[6]) == ARGV[7] then redis.call('DEL', KEYS[6]) end
redis.call('XADD', KEYS[7], '*', 'job_id', ARGV[6], 'status', ARGV[1],
           'reply_to', redis.call('HGET', KEYS[4], 'reply_to') or '', 'result', ARGV[2])
-- Only so that the outbox of a fleet that is gone (a test's prefix) does not stay
-- forever: every finish pushes the TTL back, and a running relay drains it long before.
redis.call('EXPIRE', KEYS[7], ARGV[8])
-- The result itself, not the state's name: a long poll woken by it needs no read.
redis.call('PUBLISH', KEYS[5], ARGV[2])
return {1, cur}
"""

# The one call that starts a run of a job, in place of six round trips (issue 16): unless
# the job is terminal or another copy holds its run lease, take the run lease, mark the
# job running, count the attempt and move its token reservation (if any) from the
# admission lease to the run lease. A job past its deadline is leased but not started:
# the caller, as lease holder, ends it `expired`.
# It also says whether anyone follows the job's stream (kvfleet/streams.py `follow` marks
# it), so a worker writes the streams of followed jobs only, at no extra round trip.
# KEYS: job, events, run lease, ledger, ledger leases, followed marker
# ARGV: lease token, lease ms, started_at, worker, reservation lease s, job_id,
#       terminal states joined by ',', deadline ('' = none)
# Returns {outcome, state before, attempt, queued_at, admitted_at, followed (0/1)};
# outcome is one of started | expired | terminal | held | missing.
_BEGIN = REDIS_NOW + """
local cur = redis.call('HGET', KEYS[1], 'state')
if not cur then return {'missing', ''} end
if string.find(',' .. ARGV[7] .. ',', ',' .. cur .. ',', 1, true) then return {'terminal', cur} end
if not redis.call('SET', KEYS[3], ARGV[1], 'NX', 'PX', ARGV[2]) then return {'held', cur} end
if ARGV[8] ~= '' and tonumber(ARGV[3]) > tonumber(ARGV[8]) then return {'expired', cur} end
redis.call('HSET', KEYS[1], 'state', 'running', 'started_at', ARGV[3], 'worker', ARGV[4])
local attempt = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('PUBLISH', KEYS[2], 'running')
if redis.call('HEXISTS', KEYS[4], ARGV[6]) == 1 then
  redis.call('ZADD', KEYS[5], 'XX', redis_now('') + tonumber(ARGV[5]), ARGV[6])
end
return {'started', cur, attempt, redis.call('HGET', KEYS[1], 'queued_at') or '',
        redis.call('HGET', KEYS[1], 'admitted_at') or '', redis.call('EXISTS', KEYS[6])}
"""

_TIMING_FIELDS = ("queued_at", "admitted_at", "started_at", "finished_at")


_TERMINAL = ",".join(sorted(s.value for s in TERMINAL_STATES))


def _sources(to_state: JobState) -> str:
    return ",".join(s.value for s, targets in ALLOWED_TRANSITIONS.items() if to_state in targets)


def result_from_hash(job_id: str, fields: Mapping[bytes, bytes]) -> Optional[JobResult]:
    """The JobResult a client sees, from the raw hash (None: no such job)."""
    if not fields:
        return None
    f = {k.decode(): v.decode() for k, v in fields.items()}
    if "result" in f:
        return decode_result(f["result"])
    timings = Timings(**{k: float(f[k]) for k in _TIMING_FIELDS if k in f})
    return JobResult(
        job_id=job_id,
        status=JobState(f["state"]),
        tenant=f["tenant"],
        priority=Priority(f["priority"]),
        timings=timings,
        worker=f.get("worker"),
        attempt=int(f.get("attempts") or 0),
    )


class Transition(msgspec.Struct, frozen=True):
    ok: bool
    previous: Optional[str]  # state before the call; None when the job does not exist
    attempt: int = 0  # from `start`: the run it began (1 = the first)


class Begun(msgspec.Struct, frozen=True):
    """What `begin` did: `outcome` started (this run holds the lease and the job is
    running), expired (the lease is held, the deadline passed: end the job), terminal
    (done already), held (another copy holds the lease) or missing (no job record)."""

    outcome: str
    previous: Optional[str] = None  # state before the call
    attempt: int = 0  # the run it began (1 = the first)
    timings: Timings = Timings()  # queued_at and admitted_at, when started
    followed: bool = False  # when started: a client follows the job's stream (write it)


class BeginArgs(msgspec.Struct, frozen=True):
    """One job to `begin_many`: its id, the run lease's token and its deadline."""

    job_id: str
    lease_token: str
    deadline: Optional[float] = None


class Admit(msgspec.Struct, frozen=True):
    """One job to admit: reserve `tokens` for it and move it to admitted."""

    job_id: str
    tokens: int
    tenant: str
    priority: Priority
    revive: bool = False  # reserve it again although running: its worker died


class Admitted(msgspec.Struct, frozen=True):
    reserved: bool  # the job holds its reservation now: send it
    full: bool  # not enough free tokens: try again later
    previous: Optional[JobState]  # state before the call; None when the job does not exist


class JobStore:
    def __init__(self, client: redis.Redis, keys: constants.Keys) -> None:
        self.client = client
        self.keys = keys
        self._create = client.register_script(_CREATE)
        self._transition = client.register_script(_TRANSITION)
        self._finish = client.register_script(_FINISH)
        #: The results of one engine step's jobs, written from their threads at once,
        #: share a round trip (each write stays atomic on its own).
        self._finishes = ScriptBatch(client)
        self._begin = client.register_script(_BEGIN)
        self._states = client.register_script(_STATES)
        self._admit = client.register_script(ledger.ADMIT)
        self._ledger_keys = ledger.ledger_keys(keys)

    def create(self, request: JobRequest) -> tuple[bool, JobState, str]:
        """Record a new job as queued. If the id exists, change nothing and return
        (False, its state, its tenant): the caller decides what a duplicate means."""
        created, state, tenant = self._create(**self._create_call(request))
        return bool(created), JobState(state.decode()), tenant.decode()

    def create_many(self, requests: Sequence[JobRequest]) -> list[tuple[bool, JobState, str]]:
        """`create` for each job, in one round trip (each atomic on its own)."""
        with self.client.pipeline(transaction=False) as pipe:
            for request in requests:
                call = self._create_call(request)
                # EVAL with the text: a pipeline holding a registered script first asks
                # Redis whether it is loaded, a round trip of its own.
                pipe.eval(_CREATE, len(call["keys"]), *call["keys"], *call["args"])
            replies = pipe.execute()
        return [(bool(created), JobState(state.decode()), tenant.decode()) for created, state, tenant in replies]

    def _create_call(self, request: JobRequest) -> dict:
        return {"keys": [self.keys.job(request.job_id), self.keys.job_events(request.job_id)],
                "args": [request.tenant, request.priority.value, encode(request), repr(request.submitted_at),
                         constants.PENDING_TTL_S, request.reply_to or ""]}

    def transition(self, job_id: str, to_state: JobState, *, ttl: int = 0, **fields: Any) -> Transition:
        """Move the job to `to_state` if the current state allows it; set `fields` with it.
        Pass attempts=True to count an attempt. Never to a terminal state: that is `finish`."""
        if to_state.terminal:
            raise ValueError(f"{to_state.value} is terminal: end a job with finish() or fail(), which write "
                             "its result and queue it for Kafka")
        args: list[Any] = [to_state.value, ttl, _sources(to_state)]
        for name, value in fields.items():
            args += [name, value if isinstance(value, (str, bytes)) else repr(value)]
        ok, previous, *_ = self._transition(keys=[self.keys.job(job_id), self.keys.job_events(job_id)], args=args)
        return Transition(ok=bool(ok), previous=previous.decode() or None)

    def finish(self, result: JobResult, *, lease_token: str = "",
               only_from: Optional[frozenset[JobState]] = None) -> Transition:
        """Write the terminal result, move the state and release the reservation, atomically.
        With a lease token, no other run-lease holder may hold the lease (an expired lease
        nobody took over does not throw the result away), and the lease is released
        with the write if that token holds it; with `only_from`,
        only a job in one of those states (a subset of what the state machine allows)."""
        ok, previous = self._finishes.run(*self._finish_call(result, lease_token, only_from))
        return Transition(ok=bool(ok), previous=previous.decode() or None)

    def finish_many(self, results: Sequence[tuple[JobResult, str]]) -> list[Transition]:
        """`finish(result, lease_token=token)` for each pair, in one round trip; each
        stays atomic on its own. A connection error raises, as `finish` would; a
        script error raises too, after every other write was tried."""
        replies = _raising(self._finishes.run_all([self._finish_call(r, token, None) for r, token in results]))
        return [Transition(ok=bool(ok), previous=previous.decode() or None) for ok, previous in replies]

    def _finish_call(self, result: JobResult, lease_token: str, only_from: Optional[frozenset[JobState]]):
        assert result.status.terminal, result.status
        job_id = result.job_id
        sources = _sources(result.status)
        if only_from is not None:
            sources = ",".join(s for s in sources.split(",") if JobState(s) in only_from)
        return (self._finish,
                [*self._ledger_keys, self.keys.job(job_id), self.keys.job_events(job_id),
                 self.keys.run_lease(job_id), self.keys.results_outbox, self.keys.ledger_freed],
                [result.status.value, encode(result), repr(result.timings.finished_at or 0.0),
                 constants.RESULT_TTL_S, sources, job_id, lease_token, constants.RESULTS_OUTBOX_TTL_S])

    def fail(self, job_id: str, status: JobState, code: str, message: str, *, now: float,
             lease_token: str = "", only_from: Optional[frozenset[JobState]] = None) -> Transition:
        """End a job that produced no output (failed, expired, rejected, cancelled)."""
        fields = self.client.hgetall(self.keys.job(job_id))
        current = result_from_hash(job_id, fields)
        if current is None:
            return Transition(ok=False, previous=None)
        result = JobResult(
            job_id=job_id, status=status, tenant=current.tenant, priority=current.priority,
            timings=msgspec.structs.replace(current.timings, finished_at=now),
            error=JobError(code=code, message=message), worker=current.worker, attempt=current.attempt,
        )
        return self.finish(result, lease_token=lease_token, only_from=only_from)

    def start(self, job_id: str, *, now: float, worker: str) -> Transition:
        """Mark the job running (again, on a takeover after a worker died) and count the
        attempt. The only transition that may repeat its own state."""
        ok, previous, *attempt = self._transition(
            keys=[self.keys.job(job_id), self.keys.job_events(job_id)],
            args=[JobState.RUNNING.value, 0, "queued,admitted,running", "started_at", repr(now),
                  "worker", worker, "attempts", "1"],
        )
        return Transition(ok=bool(ok), previous=previous.decode() or None, attempt=int(attempt[0]) if attempt else 0)

    def begin(self, job_id: str, *, lease_token: str, lease_ms: int, now: float, worker: str,
              reservation_lease_s: float, deadline: Optional[float] = None) -> Begun:
        """Take the job's run lease and start the run, in one atomic call (see `_BEGIN`):
        what `start` does, preceded by the checks a runner makes before it, and followed
        by the renewal of the job's reservation for `reservation_lease_s`."""
        return self._begun(self._begin(**self._begin_call(BeginArgs(job_id, lease_token, deadline), lease_ms=lease_ms,
                                                           now=now, worker=worker,
                                                           reservation_lease_s=reservation_lease_s)), now)

    def begin_many(self, jobs: Sequence["BeginArgs"], *, lease_ms: int, now: float, worker: str,
                   reservation_lease_s: float) -> list[Begun]:
        """`begin` for each job, in one round trip: one `_BEGIN` call per job, pipelined
        (each atomic on its own; the jobs have nothing in common to keep together)."""
        if not jobs:
            return []
        calls = [self._begin_call(job, lease_ms=lease_ms, now=now, worker=worker,
                                  reservation_lease_s=reservation_lease_s) for job in jobs]
        # EVALSHA through the batch, not EVAL with the script's text (kilobytes a job for
        # Redis to hash and parse); ScriptBatch loads the script where Redis lost it.
        replies = _raising(self._finishes.run_all([(self._begin, c["keys"], c["args"]) for c in calls]))
        return [self._begun(raw, now) for raw in replies]

    def _begin_call(self, job: "BeginArgs", *, lease_ms: int, now: float, worker: str,
                    reservation_lease_s: float) -> dict:
        return {"keys": [self.keys.job(job.job_id), self.keys.job_events(job.job_id),
                         self.keys.run_lease(job.job_id), *self._ledger_keys[:2],
                         self.keys.job_followed(job.job_id)],
                "args": [job.lease_token, lease_ms, repr(now), worker, reservation_lease_s, job.job_id, _TERMINAL,
                         "" if job.deadline is None else repr(job.deadline)]}

    @staticmethod
    def _begun(raw: list, now: float) -> Begun:
        outcome, previous = raw[0].decode(), raw[1].decode() or None
        if outcome != "started":
            return Begun(outcome, previous)
        queued_at, admitted_at = (float(v) if v else None for v in raw[3:5])
        return Begun(outcome, previous, int(raw[2]), Timings(queued_at=queued_at, admitted_at=admitted_at,
                                                               started_at=now), followed=bool(int(raw[5])))

    def count_fault(self, job_id: str) -> int:
        """Count a run of the job that an infrastructure fault ended (its engine raised);
        the count so far. Bounds how often a job is retried elsewhere."""
        return int(self.client.hincrby(self.keys.job(job_id), "faults", 1))

    def admit_many(self, jobs: Sequence[Admit], *, capacity: int, lease_s: float, now: float,
                   by: str, max_jobs: int = 0) -> list[Admitted]:
        """Reserve and admit each job, in order, in one atomic call, within `capacity`
        tokens and (when > 0) `max_jobs` reservations in all. A job already admitted
        keeps (and extends) its reservation: admitting it again is how a lost task is
        re-sent without counting its tokens twice."""
        if not jobs:
            return []
        keys, args = list(self._ledger_keys), [capacity, lease_s, repr(now), by, max_jobs]
        for job in jobs:
            keys += [self.keys.job(job.job_id), self.keys.job_events(job.job_id)]
            args += [job.job_id, job.tokens, f"{job.tenant} {job.priority.value}", "1" if job.revive else ""]
        raw = self._admit(keys=keys, args=args)
        return [Admitted(reserved=code == 1, full=code == -1, previous=JobState(prev.decode()) if prev else None)
                for prev, code in zip(raw[::2], raw[1::2])]

    def states(self, job_ids: Sequence[str]) -> list[Optional[JobState]]:
        """Every job's state (None: no such job), in one round trip per STATES_PER_CALL."""
        return self.decode_states([script(keys=keys, args=args) for script, keys, args in self.states_calls(job_ids)])

    def states_calls(self, job_ids: Sequence[str]) -> list[tuple[Script, list, list]]:
        """The script calls `states` makes, for a caller that sends them in one pipeline
        with calls of its own (`ScriptBatch.run_all`); `decode_states` reads their replies."""
        return [(self._states, [self.keys.job(job_id) for job_id in job_ids[start:start + STATES_PER_CALL]], [])
                for start in range(0, len(job_ids), STATES_PER_CALL)]

    @staticmethod
    def decode_states(replies: Sequence[list]) -> list[Optional[JobState]]:
        return [JobState(r.decode()) if r else None for raw in replies for r in raw]

    def get(self, job_id: str) -> Optional[JobResult]:
        return result_from_hash(job_id, self.client.hgetall(self.keys.job(job_id)))

    def state(self, job_id: str) -> Optional[JobState]:
        raw = self.client.hget(self.keys.job(job_id), "state")
        return JobState(raw.decode()) if raw else None

    def request(self, job_id: str) -> Optional[JobRequest]:
        raw = self.client.hget(self.keys.job(job_id), "request")
        return decode_request(raw) if raw else None

    def field(self, job_id: str, name: str) -> Optional[str]:
        raw = self.client.hget(self.keys.job(job_id), name)
        return raw.decode() if raw else None


def _raising(replies: list[Any]) -> list[Any]:
    """ScriptBatch.run_all's replies, or the first error among them raised (after every
    call was tried, as a pipeline's `execute` raises)."""
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply
    return replies
