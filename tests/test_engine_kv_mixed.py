"""The engine on a mixed KV pool (EngineConfig.kv_cache_dtype "int8-v"): its accounting,
what stays exact (K, batching, the prefix cache) and what INT8 V costs the model."""

from __future__ import annotations

import pytest
import torch

from kernels.contract import V_SCALE_DTYPE
from kernels.reference import dequantize_v
from kvfleet.modelinfo import PACKAGED_DIR
from kvfleet.settings import EngineConfig, Settings
from tests.test_engine import prompts, run_together
from workers.engine import Engine
from workers.engine.model_runner import kv_bytes_per_block
from workers.model import LoadedModel, load_model

MIXED = "int8-v"


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("builtin:tiny", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def english16() -> LoadedModel:
    # The checkpoint's own dtype: a 16-bit pool is the baseline the mixed one is measured against.
    return load_model("builtin:english", device="cpu", dtype="float16")


def test_block_bytes_count_int8_values_and_fp16_scales(english16):
    c = english16.config  # 4 layers, 2 KV heads, head_dim 32
    rows = c.num_hidden_layers * c.num_key_value_heads * 16  # (layer, KV head, token) rows of a block
    assert kv_bytes_per_block(english16, 16) == rows * (64 + 64)
    assert kv_bytes_per_block(english16, 16, MIXED) == rows * (64 + 32 + 2)


def test_same_memory_holds_more_blocks_laid_out_as_the_kernels_expect(english16):
    budget = 8 * 2**20
    with Engine(english16, EngineConfig(kv_memory_bytes=budget)) as full, \
            Engine(english16, EngineConfig(kv_memory_bytes=budget, kv_cache_dtype=MIXED)) as mixed:
        full_blocks, mixed_blocks = full.block_manager.num_blocks, mixed.block_manager.num_blocks
        assert full_blocks == budget // kv_bytes_per_block(english16, 16)
        assert mixed_blocks == budget // kv_bytes_per_block(english16, 16, MIXED)
        assert mixed.stats().capacity_tokens == mixed_blocks * 16 > 1.3 * full.stats().capacity_tokens
        assert full.v_scales is None
        shape = (mixed_blocks, 16, 2, 32)
        for (k, v), s in zip(mixed.kv_cache, mixed.v_scales, strict=True):
            assert (k.shape, k.dtype, v.shape, v.dtype) == (shape, torch.float16, shape, torch.int8)
            assert s.shape == shape[:3] and s.dtype == V_SCALE_DTYPE
        held = sum(k.nbytes + v.nbytes for k, v in mixed.kv_cache) + sum(s.nbytes for s in mixed.v_scales)
        assert held <= budget


def test_keys_stay_exact_and_values_within_half_a_step(english16):
    # Layer 0's K and V come from the embeddings alone, so both pools store the same
    # rows there: K bit for bit, V as int8 within half a step of the 16-bit value.
    prompt = english16.tokenizer.encode((PACKAGED_DIR / "english" / "heldout.txt").read_text(encoding="utf-8")[:300])
    config = EngineConfig(num_blocks=64)
    with Engine(english16, config) as full, Engine(english16, EngineConfig(num_blocks=64, kv_cache_dtype=MIXED)) as mixed:
        full.generate("a", prompt, 1)
        mixed.generate("a", prompt, 1)
        blocks = mixed.block_manager.cached_block_ids(mixed.block_manager.prefix_hashes(prompt))
        assert blocks == full.block_manager.cached_block_ids(full.block_manager.prefix_hashes(prompt))
        assert blocks, "the prompt fills at least one block"
        (k16, v16), (k8, v8), s8 = full.kv_cache[0], mixed.kv_cache[0], mixed.v_scales[0]
        assert torch.equal(k8[blocks], k16[blocks])
        back = dequantize_v(v8[blocks], s8[blocks], torch.float32)  # (n, BS, Hkv, D)
        assert ((back - v16[blocks].float()).abs() <= s8[blocks].float().unsqueeze(-1) * 0.5 + 1e-3).all()


def test_mixed_greedy_is_the_same_batched_alone_and_through_the_prefix_cache(tiny):
    batch = prompts(8, tiny.config.vocab_size, seed=5)
    config = EngineConfig(num_blocks=256, max_num_batched_tokens=64, kv_cache_dtype=MIXED)
    with Engine(tiny, config) as alone_engine:
        alone = [alone_engine.generate(f"a{i}", p, 16).tokens for i, p in enumerate(batch)]
    with Engine(tiny, config) as engine:
        together = run_together(engine, batch, 16)
        again = engine.generate("again", batch[0], 16)  # its prompt's full blocks are cached
    assert together == alone
    assert again.tokens == alone[0] and again.cached_tokens == len(batch[0]) // 16 * 16 > 0


def test_mixed_output_follows_the_16_bit_pool(english16):
    # Not exact (V is rounded), but the next-token choices of a real text mostly agree.
    text = (PACKAGED_DIR / "english" / "heldout.txt").read_text(encoding="utf-8")
    prompt = english16.tokenizer.encode(text[:400])
    with Engine(english16, EngineConfig(num_blocks=64)) as full, \
            Engine(english16, EngineConfig(num_blocks=64, kv_cache_dtype=MIXED)) as mixed:
        a = full.generate("a", prompt, 24, ignore_eos=True).tokens
        b = mixed.generate("a", prompt, 24, ignore_eos=True).tokens
    assert len(b) == 24 and a[:4] == b[:4]


def test_an_unknown_kv_cache_dtype_names_the_valid_ones():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of model, int8-v"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="KVFLEET_KV_CACHE_DTYPE='fp8' must be one of model, int8-v"):
        Settings.from_env({"KVFLEET_KV_CACHE_DTYPE": "fp8"})


def test_mixed_kv_with_the_cold_tier_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="KVFLEET_COLD_TIER=0"):
        Settings.from_env({"KVFLEET_KV_CACHE_DTYPE": "int8-v"})  # the cold tier is on by default
    settings = Settings.from_env({"KVFLEET_KV_CACHE_DTYPE": "int8-v", "KVFLEET_COLD_TIER": "0"})
    assert settings.engine.kv_cache_dtype == MIXED and not settings.cold_tier.enabled
