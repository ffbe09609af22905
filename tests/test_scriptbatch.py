"""Scripts called at once from many threads go to Redis as one pipeline
(kvfleet/scriptbatch.py): each caller gets its own reply, a lone call goes alone, a
script error fails only its caller, a failed connection fails every caller of its
pipeline and the next calls still go, and a script Redis lost is loaded again."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from kvfleet.scriptbatch import ScriptBatch

ECHO = "return {KEYS[1], ARGV[1]}"
FAILS_ON_BAD = "if KEYS[1] == 'bad' then return redis.error_reply('ERR bad key') end return KEYS[1]"


class Gated(redis.Redis):
    """A client whose lone calls wait at `gate` first: the batch's first leader is on the
    wire for as long as the test likes, so the others queue behind it."""

    gate: threading.Event

    def execute_command(self, *args, **options):
        if args and args[0] == "EVALSHA":
            self.gate.wait(10)
        return super().execute_command(*args, **options)


@pytest.fixture
def gated(redis_url) -> Gated:
    """A gated client, its gate closed."""
    client = Gated.from_url(redis_url)
    client.gate = threading.Event()
    return client


def _queued(batch: ScriptBatch) -> int:
    with batch._lock:
        return len(batch._queued)


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def _behind_one(pool: ThreadPoolExecutor, batch: ScriptBatch, script, first: tuple, rest: list[tuple]):
    """The `first` call on the wire alone (held at the client's gate), then each of `rest`
    queued behind it; the futures of both, the gate still closed."""
    sent = batch.pipelines
    first_call = pool.submit(batch.run, script, *first)
    _wait_for(lambda: batch.pipelines == sent + 1)
    queued = [pool.submit(batch.run, script, *args) for args in rest]
    _wait_for(lambda: _queued(batch) == len(rest))
    return first_call, queued


def test_calls_that_queue_behind_a_pipeline_share_the_next_and_each_gets_its_own_reply(gated):
    client = gated
    batch = ScriptBatch(client)
    echo = client.register_script(ECHO)
    with ThreadPoolExecutor(12) as pool:
        first, rest = _behind_one(pool, batch, echo, (["k0"], ["v0"]), [([f"k{i}"], [f"v{i}"]) for i in range(1, 12)])
        client.gate.set()
        replies = [first.result(10)] + [f.result(10) for f in rest]
    assert replies == [[f"k{i}".encode(), f"v{i}".encode()] for i in range(12)]
    assert (batch.pipelines, batch.calls) == (2, 12)


def test_a_lone_call_goes_alone_and_a_full_queue_goes_in_pipelines_of_max_batch(gated):
    client = gated
    client.gate.set()
    batch = ScriptBatch(client, max_batch=4)
    echo = client.register_script(ECHO)
    assert batch.run(echo, ["solo"], ["1"]) == [b"solo", b"1"]
    assert (batch.pipelines, batch.calls) == (1, 1)
    client.gate.clear()
    with ThreadPoolExecutor(10) as pool:
        first, rest = _behind_one(pool, batch, echo, (["k"], ["0"]), [(["k"], [str(i)]) for i in range(1, 10)])
        client.gate.set()
        assert [first.result(10)[1]] + [f.result(10)[1] for f in rest] == [str(i).encode() for i in range(10)]
    assert (batch.pipelines, batch.calls) == (2 + 3, 11)  # nine queued: 4 + 4 + 1


def test_a_script_error_fails_only_its_own_call(gated):
    client = gated
    batch = ScriptBatch(client)
    script = client.register_script(FAILS_ON_BAD)
    with ThreadPoolExecutor(4) as pool:
        first, rest = _behind_one(pool, batch, script, (["good0"],), [([key],) for key in ("good1", "bad", "good2")])
        client.gate.set()
        assert first.result(10) == b"good0"
        assert rest[0].result(10) == b"good1" and rest[2].result(10) == b"good2"
        with pytest.raises(redis.ResponseError, match="bad key"):
            rest[1].result(10)
    with pytest.raises(redis.ResponseError, match="bad key"):  # alone, the same
        batch.run(script, ["bad"])


def test_a_failed_connection_fails_every_caller_and_the_next_calls_still_go(redis_url):
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5)  # nothing listens on port 1
    batch = ScriptBatch(dead)
    echo = dead.register_script(ECHO)
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(batch.run, echo, ["k"], [str(i)]) for i in range(8)]
        for f in futures:
            with pytest.raises(redis.ConnectionError):
                f.result(30)
    assert batch.calls == 8 and not batch._sending and _queued(batch) == 0  # nobody left waiting
    batch.client = redis.Redis.from_url(redis_url)  # the connection is back
    assert batch.run(echo, ["k"], ["back"]) == [b"k", b"back"]


def test_a_script_redis_lost_is_loaded_again_alone_or_in_a_pipeline(gated):
    client = gated
    client.gate.set()
    batch = ScriptBatch(client)
    echo = client.register_script(ECHO)
    client.script_flush()
    assert batch.run(echo, ["a"], ["1"]) == [b"a", b"1"]
    client.script_flush()
    client.gate.clear()
    with ThreadPoolExecutor(3) as pool:
        first, rest = _behind_one(pool, batch, echo, (["a"], ["0"]), [(["b"], [str(i)]) for i in (1, 2)])
        client.script_flush()  # the pipeline's EVALSHA finds nothing
        client.gate.set()
        assert first.result(10) == [b"a", b"0"] and [f.result(10) for f in rest] == [[b"b", b"1"], [b"b", b"2"]]


def test_one_callers_several_calls_share_a_pipeline_and_each_error_stays_in_its_place(gated):
    client = gated
    client.gate.set()
    batch = ScriptBatch(client)
    script = client.register_script(FAILS_ON_BAD)
    replies = batch.run_all([(script, [key], []) for key in ("a", "bad", "b")])
    assert replies[0] == b"a" and replies[2] == b"b"
    assert isinstance(replies[1], redis.ResponseError) and "bad key" in str(replies[1])
    assert (batch.pipelines, batch.calls) == (1, 3)
    assert batch.run_all([]) == [] and batch.pipelines == 1


def test_several_calls_queued_behind_another_callers_pipeline_lead_the_next_ones(gated):
    # Queued behind a pipeline on the wire, one caller's calls (more than one pipeline
    # holds) go out in the pipelines after it: the caller is woken to lead each.
    client = gated
    batch = ScriptBatch(client, max_batch=4)
    echo = client.register_script(ECHO)
    with ThreadPoolExecutor(2) as pool:
        sent = batch.pipelines
        first = pool.submit(batch.run, echo, ["k"], ["first"])
        _wait_for(lambda: batch.pipelines == sent + 1)
        several = pool.submit(batch.run_all, [(echo, ["k"], [str(i)]) for i in range(10)])
        _wait_for(lambda: _queued(batch) == 10)
        client.gate.set()
        assert first.result(10) == [b"k", b"first"]
        assert several.result(10) == [[b"k", str(i).encode()] for i in range(10)]
    assert (batch.pipelines, batch.calls) == (1 + 3, 11) and not batch._sending  # 4 + 4 + 2
