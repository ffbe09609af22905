"""The exact-match result cache (issue 14): a burst of identical, determined requests
runs the model once; stale entries are served while one request refreshes them; only
tenants that allow it, only requests that ask, only outputs that are determined, and
never across cache namespaces. Unit tests on the real Redis, then a real fleet.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import redis as redis_lib

from kvfleet.constants import Keys
from kvfleet.contracts import Completion, JobRequest, Priority, Sampling
from workers.result_cache import ResultCache, determined, outputs_fingerprint


def _job(job_id: str, **sampling) -> JobRequest:
    return JobRequest(job_id=job_id, tenant="acme", priority=Priority.NORMAL, model="m", max_new_tokens=4,
                      submitted_at=time.time(), prompt_tokens=[3, 4, 5], sampling=Sampling(cache=True, **sampling))


def _completion(text: str = "hi") -> Completion:
    now = time.time()
    return Completion(text=text, tokens=[1, 2], finish_reason="length", prompt_tokens=3, cached_tokens=0,
                      started_at=now, first_token_at=now, finished_at=now)


@pytest.fixture
def cache(cache_redis_url, redis_url, prefix):
    return ResultCache(redis_lib.Redis.from_url(cache_redis_url), Keys(prefix), "fp", ttl_s=60,
                       lock_client=redis_lib.Redis.from_url(redis_url))


def test_only_determined_outputs_qualify():
    assert determined(_job("a")) and determined(_job("b", temperature=0.8, seed=7))
    assert not determined(_job("c", temperature=0.8))


def test_workers_of_another_kv_pool_layout_never_serve_each_others_results(cache_redis_url, redis_url, prefix):
    """An int8-v pool's outputs may differ from a 16-bit pool's by a token."""
    def cache_for(kv_cache_dtype: str) -> ResultCache:
        return ResultCache(redis_lib.Redis.from_url(cache_redis_url), Keys(prefix),
                           outputs_fingerprint("fp", kv_cache_dtype), ttl_s=60, lock_client=redis_lib.Redis.from_url(redis_url))

    sixteen, mixed = cache_for("model"), cache_for("int8-v")
    job = _job("a")
    runs = []
    assert sixteen.get_or_run(job, "salt", lambda: runs.append(1) or _completion("16-bit"))[0].text == "16-bit"
    assert mixed.get_or_run(job, "salt", lambda: runs.append(1) or _completion("mixed"))[0].text == "mixed"
    assert runs == [1, 1]


def test_a_burst_of_identical_requests_runs_the_model_once(cache):
    runs, go = [], threading.Barrier(8)

    def run() -> Completion:
        runs.append(1)
        time.sleep(0.3)  # the model takes a while: the others arrive while it runs
        return _completion()

    def one(i: int):
        go.wait()
        return cache.get_or_run(_job(f"j{i}"), "salt", run)

    with ThreadPoolExecutor(8) as pool:
        out = list(pool.map(one, range(8)))
    assert len(runs) == 1
    assert {c.text for c, _ in out} == {"hi"} and sorted(hit for _, hit in out) == [False] + [True] * 7
    assert all(c.cached_tokens == 3 for c, hit in out if hit)


def test_the_key_separates_namespaces_and_everything_the_output_depends_on(cache):
    base = cache.key(_job("a"), "salt")
    assert cache.key(_job("b"), "salt") == base  # the job id is not part of it
    assert cache.key(_job("a"), "other-tenant") != base
    assert cache.key(msgspec.structs.replace(_job("a"), max_new_tokens=5), "salt") != base
    assert cache.key(msgspec.structs.replace(_job("a"), prompt_tokens=[3, 4, 6]), "salt") != base
    assert cache.key(_job("a", temperature=0.5, seed=1), "salt") != cache.key(_job("a", temperature=0.5, seed=2), "salt")
    assert cache.key(_job("a", seed=1), "salt") == base  # greedy: the seed changes nothing
    assert "3, 4, 5" not in base and "salt" not in base  # a digest: no prompt in clear


def test_a_stale_entry_is_served_while_one_request_refreshes_it(cache_redis_url, redis_url, prefix):
    cache = ResultCache(redis_lib.Redis.from_url(cache_redis_url), Keys(prefix), "fp", ttl_s=0.2, grace_s=60,
                        lock_client=redis_lib.Redis.from_url(redis_url))
    cache.get_or_run(_job("first"), "salt", lambda: _completion("old"))
    time.sleep(0.3)  # past the logical expiry (at most 0.22 s with jitter); the key lives on for the grace
    refreshing, release = threading.Event(), threading.Event()

    def slow_refresh() -> Completion:
        refreshing.set()
        release.wait(30)
        return _completion("new")

    with ThreadPoolExecutor(1) as pool:
        refresh = pool.submit(cache.get_or_run, _job("refresher"), "salt", slow_refresh)
        assert refreshing.wait(30)
        served, hit = cache.get_or_run(_job("meanwhile"), "salt", lambda: pytest.fail("must not run the model"))
        assert (served.text, hit) == ("old", True)  # stale, at once
        release.set()
        assert refresh.result(30)[0].text == "new"
    assert cache.get_or_run(_job("after"), "salt", lambda: pytest.fail("fresh now"))[0].text == "new"


TENANTS = {"tenants": [
    {"name": "acme", "tier": "silver", "tokens_per_minute": 10**9, "result_cache": True},
    {"name": "globex", "tier": "silver", "tokens_per_minute": 10**9},
]}


@pytest.mark.timeout(300)
def test_identical_jobs_through_the_fleet_run_the_model_once_for_a_tenant_that_allows_it(make_fleet):
    fleet = make_fleet(workers=1, extra_env={"KVFLEET_TENANTS": json.dumps(TENANTS)})
    body = {"prompt_tokens": [9, 8, 7, 6, 5], "max_new_tokens": 6, "sampling": {"cache": True}}

    def results(tenant: str, n: int) -> list[dict]:
        with ThreadPoolExecutor(n) as pool:
            jobs = list(pool.map(lambda _: fleet.submit(tenant=tenant, **body), range(n)))
        fleet.wait_for(lambda: all(fleet.state(j) == "done" for j in jobs), f"{tenant}'s jobs done", timeout=120)
        return [msgspec.json.decode(fleet.field(j, "result")) for j in jobs]

    allowed = results("acme", 6)
    assert sum(not r["from_cache"] for r in allowed) == 1  # one model run, five served
    assert len({r["text"] for r in allowed}) == 1
    refused = results("globex", 3)  # asks, but its tenant does not allow it
    assert not any(r["from_cache"] for r in refused)
    assert {r["text"] for r in refused} == {allowed[0]["text"]}  # same model, same greedy output
