"""workers/prefix.py: what the prefix step costs a prompt nobody shares, counted on the
real Redis instances (the cache for blocks, the state for the flight's lock), as
workers/service.py wires them. A count of round trips, not a time: issue 16's short
jobs are mostly such prompts, and each round trip is a wait in the job's task thread
and CPU in the worker and in Redis."""

from __future__ import annotations

import threading

import pytest

from kvfleet.constants import Keys
from kvfleet.contracts import Sampling
from kvfleet.settings import ColdTierSettings
from kvstore.blob import Quant
from kvstore.coldtier import ColdTier, connect
from kvstore.hooks import ColdTierHooks
from workers.engine import Engine, EngineConfig
from workers.model.loader import load_model
from workers.prefix import PrefixSharing, PrefixSharingEngine
from tests.recording_redis import Recording

#: Round trips of the prefix step for a unique prompt of at least `min_blocks` blocks:
#: the cache's EXISTS run (present_run), then on the state instance the flight's claim
#: (SET NX and a read of the `:stored` record, one script) and, at the job's first token,
#: one script that counts the waiters and, finding none, releases the lock. Before issue
#: 16's cuts it was 5: the claim was a bare SET NX, followed by an EXISTS of the marker
#: under the lock; then 4, with the count and the release apart.
UNIQUE_PROMPT_ROUND_TRIPS = {"cache": 1, "state": 2}


def _prompt(seed: int, n: int = 200) -> list[int]:
    return [(i * 37 + seed * 101 + 11) % 250 for i in range(n)]  # 12 full blocks of 16


@pytest.fixture
def counted(cache_redis_url, redis_url, prefix):
    hooks = ColdTierHooks(prefetch_only=True)
    engine = Engine(load_model("builtin:tiny"), EngineConfig(num_blocks=128, max_model_len=512), hooks=hooks)
    cache = Recording.from_url(cache_redis_url)
    state = Recording.from_url(redis_url)
    cache.connection_pool.connection_kwargs.update(socket_timeout=1.0)  # as connect() does
    hooks.tier = ColdTier(cache, Keys(prefix), engine.block_manager.fingerprint, engine.kv_cache,
                          kernels=engine.kernels, quant=Quant.NONE, ttl_s=120, grace_s=60,
                          spill_max_bytes=ColdTierSettings().spill_max_bytes, lock_client=state)
    hooks.give_back = engine.block_manager.give_back
    sharing = PrefixSharingEngine(engine, PrefixSharing(engine, hooks.tier, min_blocks=4))
    try:
        yield sharing, {"cache": cache, "state": state}
    finally:
        engine.shutdown()
        hooks.tier.close()


def test_a_unique_prompt_costs_the_prefix_step_three_round_trips_and_no_thread(counted, monkeypatch):
    sharing, clients = counted
    sharing.generate("warm", _prompt(0), 1, Sampling())  # loads the scripts, starts the renewer thread
    before = {name: c.round_trips for name, c in clients.items()}
    started: list[str] = []
    start = threading.Thread.start

    def counting_start(thread):
        started.append(thread.name)
        return start(thread)

    monkeypatch.setattr(threading.Thread, "start", counting_start)
    out = sharing.generate("unique", _prompt(1), 1, Sampling())
    assert len(out.tokens) == 1
    assert {name: c.round_trips - before[name] for name, c in clients.items()} == UNIQUE_PROMPT_ROUND_TRIPS
    assert started == []  # the flight's lease is renewed by its one shared thread, when a build runs long
    tier, blocks = sharing.sharing.tier, sharing.engine.block_manager
    lock = tier._prefix_lock(blocks.prefix_hashes(_prompt(1)), 0)
    assert not clients["state"].exists(lock, f"{lock}:stored")  # released, and no record: it wrote nothing

