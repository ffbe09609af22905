"""The engine end to end with a real model: batching, prefix cache, preemption, hooks, errors."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import pytest
import torch
import transformers
from prometheus_client import REGISTRY

from kvfleet.contracts import Sampling
from tests.test_model import save_tiny_checkpoint
from workers.engine import (
    Engine, EngineConfig, EngineStopped, InvalidRequest, MissingBlock, PromptTooLong, RequestCancelled, StepFailed,
)
from workers.engine.loop import CpuWait
from workers.model import LoadedModel, load_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("builtin:tiny", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory) -> tuple[transformers.LlamaForCausalLM, LoadedModel]:
    path = tmp_path_factory.mktemp("ckpt")
    hf = save_tiny_checkpoint(path, tie=False)
    return hf, load_model(str(path), device="cpu", dtype="float32")


def prompts(n: int, vocab: int, seed: int, lo: int = 3, hi: int = 150) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab - 1) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_together(engine: Engine, batch: list[list[int]], max_new: int, **kw) -> list[list[int]]:
    handles = [engine.submit(f"b{i}", p, max_new, **kw) for i, p in enumerate(batch)]
    return [h.result(timeout=120).tokens for h in handles]


def test_batched_greedy_equals_alone_and_transformers(hf_checkpoint):
    hf, loaded = hf_checkpoint
    batch = prompts(16, loaded.config.vocab_size, seed=0)
    # A step budget below the longest prompts: chunked prefills share steps with decodes.
    config = EngineConfig(num_blocks=256, max_num_batched_tokens=64)
    with Engine(loaded, config) as alone_engine:
        alone = [alone_engine.generate(f"a{i}", p, 24).tokens for i, p in enumerate(batch)]
    with Engine(loaded, config) as engine:
        together = run_together(engine, batch, 24)
        stats = engine.stats()
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p):].tolist()
                    for p in batch]
    assert together == alone
    assert together == expected
    assert stats.max_batch_size == 16 and stats.prompt_tokens_cached == 0
    assert stats.tokens_computed == sum(len(p) for p in batch) + sum(len(t) - 1 for t in together)


def test_cached_prefix_gives_same_tokens_without_recomputing(tiny):
    first, rest = prompts(2, tiny.config.vocab_size, seed=1, lo=100, hi=100)
    second = first[:83] + rest[:30]  # shares 5 full blocks (80 tokens) with `first`
    config = EngineConfig(num_blocks=128)
    with Engine(tiny, config) as cold:
        cold_tokens = cold.generate("cold", second, 16).tokens
    with Engine(tiny, config) as warm:
        warm.generate("first", first, 16)
        before = warm.stats()
        hit = warm.generate("second", second, 16)
        after = warm.stats()
    assert hit.tokens == cold_tokens
    assert hit.cached_tokens == 80 and hit.prompt_tokens == 113
    assert after.tokens_computed - before.tokens_computed == (113 - 80) + (16 - 1)
    assert after.prompt_tokens_cached - before.prompt_tokens_cached == 80
    assert after.prefix_cache_hits - before.prefix_cache_hits == 5


def test_pool_too_small_for_all_preempts_and_finishes_all(tiny):
    batch = prompts(8, tiny.config.vocab_size, seed=2, lo=30, hi=50)
    with Engine(tiny, EngineConfig(num_blocks=64)) as roomy:
        alone = [roomy.generate(f"a{i}", p, 60).tokens for i, p in enumerate(batch)]
    # 8 sequences of up to 110 tokens need ~56 blocks at their peak; the pool has 14.
    with Engine(tiny, EngineConfig(num_blocks=14, max_model_len=224)) as tight:
        together = run_together(tight, batch, 60, ignore_eos=True)
        stats = tight.stats()
    assert [t[:len(a)] for t, a in zip(together, alone)] == alone  # alone may stop at EOS earlier
    assert all(len(t) == 60 for t in together)
    assert stats.preemptions > 0 and stats.blocks_used == 0


def test_seeded_sampling_same_alone_and_in_a_batch(tiny):
    batch = prompts(8, tiny.config.vocab_size, seed=3)
    seeded = Sampling(temperature=0.8, top_k=50, top_p=0.9, seed=42)
    with Engine(tiny, EngineConfig(num_blocks=256, max_num_batched_tokens=128)) as engine:
        alone = engine.generate("alone", batch[0], 32, seeded, ignore_eos=True).tokens
        handles = [engine.submit("seeded", batch[0], 32, seeded, ignore_eos=True)] + [
            engine.submit(f"o{i}", p, 32, Sampling(temperature=1.0, seed=i) if i % 2 else Sampling())
            for i, p in enumerate(batch[1:])
        ]
        in_batch = handles[0].result(timeout=60).tokens
        [h.result(timeout=60) for h in handles[1:]]
        unseeded = [engine.generate(f"u{i}", batch[0], 32, Sampling(temperature=1.0), ignore_eos=True).tokens
                    for i in range(2)]
    assert in_batch == alone
    assert unseeded[0] != unseeded[1]  # no seed: a fresh random seed per request


def test_cancel_frees_blocks_and_engine_keeps_serving(tiny):
    with Engine(tiny, EngineConfig(num_blocks=128)) as engine:
        handle = engine.submit("long", [5, 6, 7], 1000, ignore_eos=True)
        assert handle.cancel()
        with pytest.raises(RequestCancelled):
            handle.result(timeout=30)
        assert not engine.cancel("long") and not engine.cancel("unknown")
        assert engine.generate("next", [5, 6, 7], 4).finish_reason in ("length", "eos")
        stats = engine.stats()
    assert stats.running == 0 and stats.blocks_used == 0


def test_requests_the_model_cannot_take_fail_at_submit(tiny):
    with Engine(tiny, EngineConfig(num_blocks=128)) as engine:
        with pytest.raises(PromptTooLong, match="context of 1024"):
            engine.submit("long", [5] * 1025, 1)
        with pytest.raises(PromptTooLong, match="at most 24 new tokens"):
            engine.submit("long", [5] * 1000, 25)
        with pytest.raises(ValueError):  # PromptTooLong is a ValueError for callers that check that
            engine.generate("long", [5] * 1000, 25)
        with pytest.raises(InvalidRequest, match="ids in 0..257"):
            engine.submit("oov", [5, 258], 4)
        with pytest.raises(InvalidRequest, match="empty"):
            engine.submit("empty", [], 4)
        engine.submit("dup", [5], 8)
        with pytest.raises(InvalidRequest, match="already"):
            engine.submit("dup", [5], 8)
    with pytest.raises(ValueError, match="power of two"):
        EngineConfig(block_size=12)
    with pytest.raises(ValueError, match="cannot hold one request"):
        Engine(tiny, EngineConfig(num_blocks=8))


class DictColdTier:
    """A minimal outside tier: evicted blocks' K/V copied into a dict, filled back on admission."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.store: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.evicted: list[tuple[str, tuple[int, ...], str | None, int]] = []
        self.fail_next_admit = False

    def on_evict(self, block_hash, token_ids, parent_hash, block_id) -> None:
        self.evicted.append((block_hash, token_ids, parent_hash, block_id))
        self.store[block_hash] = [(k[block_id].clone(), v[block_id].clone()) for k, v in self.engine.kv_cache]

    def on_admit(self, missing: list[MissingBlock]) -> int:
        if self.fail_next_admit:
            self.fail_next_admit = False
            raise ConnectionError("cold tier down")
        filled = 0
        for m in missing:
            if m.block_hash not in self.store:
                break
            for (k, v), (sk, sv) in zip(self.engine.kv_cache, self.store[m.block_hash]):
                k[m.block_id], v[m.block_id] = sk, sv
            filled += 1
        return filled


def test_evicted_blocks_come_back_through_the_admission_hook(tiny):
    tier = DictColdTier()
    first, *others = prompts(4, tiny.config.vocab_size, seed=4, lo=100, hi=100)
    with Engine(tiny, EngineConfig(num_blocks=16, max_model_len=256), hooks=tier) as engine:
        tier.engine = engine
        original = engine.generate("first", first, 20)
        for i, p in enumerate(others):  # 3 x 8 blocks through a 16-block pool evicts `first`
            engine.generate(f"o{i}", p, 20)
        assert any(tokens == tuple(first[:16]) and parent is None for _, tokens, parent, _ in tier.evicted)
        again = engine.generate("again", first, 20)
        stats = engine.stats()
    assert again.tokens == original.tokens
    assert again.cached_tokens == 96 and stats.outside_cache_hits >= 1


def test_a_failing_step_fails_its_requests_and_the_engine_recovers(tiny):
    tier = DictColdTier()
    with Engine(tiny, EngineConfig(num_blocks=64), hooks=tier) as engine:
        tier.engine = engine
        tier.fail_next_admit = True
        with pytest.raises(StepFailed) as err:
            engine.generate("boom", list(range(3, 40)), 8)
        assert isinstance(err.value.__cause__, ConnectionError)
        assert engine.generate("fine", list(range(3, 40)), 8).finish_reason in ("length", "eos")
        assert engine.stats().blocks_used == 0


def test_shutdown_fails_requests_in_flight(tiny):
    engine = Engine(tiny, EngineConfig(num_blocks=128))
    handle = engine.submit("long", [5, 6, 7], 1000, ignore_eos=True)
    engine.shutdown(timeout=30)
    with pytest.raises(EngineStopped):
        handle.result(timeout=30)
    with pytest.raises(EngineStopped):
        engine.submit("late", [5], 4)


def test_higher_priority_is_served_first(tiny):
    with Engine(tiny, EngineConfig(num_blocks=128, max_num_seqs=1)) as engine:
        low = [engine.submit(f"low{i}", [5, 6, 7], 40, priority_rank=2, ignore_eos=True) for i in range(3)]
        high = engine.submit("high", [5, 6, 8], 40, priority_rank=0, ignore_eos=True)
        done = {h.request_id: h.result(timeout=60).finished_at for h in [*low, high]}
    # low0 may already hold the only slot; high must pass low1 and low2.
    assert done["high"] < done["low1"] < done["low2"]


def test_metrics_count_generated_tokens_and_prefix_hits(tiny):
    def value(name: str) -> float:
        return REGISTRY.get_sample_value(name) or 0.0

    tokens0, hits0 = value("kvfleet_engine_generated_tokens_total"), value("kvfleet_engine_prefix_cache_hits_total")
    ttft0 = value("kvfleet_engine_time_to_first_token_seconds_count")
    with Engine(tiny, EngineConfig(num_blocks=128)) as engine:
        prompt = list(range(3, 60))
        engine.generate("a", prompt, 10, ignore_eos=True)
        engine.generate("b", prompt, 10, ignore_eos=True)
    assert value("kvfleet_engine_generated_tokens_total") - tokens0 == 20
    assert value("kvfleet_engine_prefix_cache_hits_total") - hits0 == 3  # 57 tokens: 3 full blocks reused
    assert value("kvfleet_engine_time_to_first_token_seconds_count") - ttft0 == 2
    assert value("kvfleet_engine_kv_blocks_used") == 0


def test_metrics_time_the_steps_on_the_clock_and_on_the_step_thread(tiny):
    def value(name: str) -> float:
        return REGISTRY.get_sample_value(name) or 0.0

    wall0, cpu0 = value("kvfleet_engine_step_seconds_sum"), value("kvfleet_engine_step_cpu_seconds_total")
    with Engine(tiny, EngineConfig(num_blocks=128)) as engine:
        engine.generate("a", list(range(3, 60)), 10, ignore_eos=True)
    wall, cpu = value("kvfleet_engine_step_seconds_sum") - wall0, value("kvfleet_engine_step_cpu_seconds_total") - cpu0
    assert 0 < cpu
    # The step thread's CPU time over the same spans as the wall time: never more (one
    # thread, the clocks' resolutions apart).
    assert cpu <= wall + 0.001 * 10
    # Its waits for a core, within the steps' wall time too (the kernel counts in ns).
    waited = value("kvfleet_engine_step_cpu_wait_seconds_total")
    assert 0 <= waited <= value("kvfleet_engine_step_seconds_sum") + 0.001


@pytest.mark.skipif(not (hasattr(os, "sched_setaffinity") and os.path.exists("/proc/thread-self/schedstat")),
                    reason="Linux: per-thread CPU affinity and schedstat")
def test_cpu_wait_counts_the_time_a_thread_waits_for_a_core_another_process_holds():
    """What `kvfleet_engine_step_cpu_wait_seconds` adds up: this thread, pinned to one core
    beside a process that spins on it, is ready to run about half of the time it is not
    running; a wait for a lock would not count."""
    core = min(os.sched_getaffinity(0))
    spinner = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
    before_affinity = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {core})  # this thread only (Linux affinity is per thread)
        clock = CpuWait()
        start = clock.seconds()
        deadline = time.monotonic() + 60
        while clock.seconds() - start <= 0.01 and time.monotonic() < deadline:
            sum(range(10_000))  # stay ready to run
        assert clock.seconds() - start > 0.01
    finally:
        os.sched_setaffinity(0, before_affinity)
        spinner.kill()
        spinner.wait()
