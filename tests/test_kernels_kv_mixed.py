"""The mixed pool's kernels (FP16-K / INT8-V, kernels/contract.py): each implementation
against the torch reference, the Triton ones under the interpreter in a child pytest
(as tests/test_kernels.py does, for the same reason: TRITON_INTERPRET=1 must be set
before a kernel module is imported).

Tolerances (max abs error vs the reference):
  store_kvcache with v_scales   exact: the same int8 values and fp16 scales
  paged attention fp32 / fp16   1e-5 / 5e-3, as on a 16-bit pool
  torch decode, gather + SDPA   1e-5 (fp32), 2e-2 (bf16)
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels import gather_sdpa, reference, torch_attention
from kernels.contract import V_SCALE_DTYPE, V_SCALE_MIN, PagedBatch
from tests.interpreter import run_under_interpreter
from tests.test_kernels import DECODE, MIXED, PREFILL, interpreter_runs_loops, max_err  # noqa: F401 (a fixture)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
BLOCK_SIZE = 4


def make_mixed_batch(
    q_lens: list[int], ctxs: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype,
    *, block_size: int = BLOCK_SIZE, seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PagedBatch]:
    """A shuffled mixed pool (K in `dtype`, V int8 with fp16 scales) holding each
    sequence's context. Unused K slots are NaN and unused scales too, so a read past a
    context shows; unused int8 V slots are 127."""
    g = torch.Generator().manual_seed(seed)
    per_seq = max((c + block_size - 1) // block_size for c in ctxs) + 1  # one spare column
    nb = len(ctxs) * per_seq + 3
    tables = torch.randperm(nb, generator=g)[: len(ctxs) * per_seq].view(len(ctxs), per_seq)
    k_cache = torch.full((nb, block_size, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full((nb, block_size, hkv, d), 127, dtype=torch.int8)
    v_scales = torch.full((nb, block_size, hkv), float("nan"), dtype=V_SCALE_DTYPE)
    for b, c in enumerate(ctxs):
        pos = torch.arange(c)
        slots = tables[b, pos // block_size] * block_size + pos % block_size  # (c,)
        kv = torch.randn(2, c, hkv, d, generator=g).to(dtype)
        reference.store_kvcache(kv[0], kv[1], k_cache, v_cache, slots, v_scales=v_scales)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    return q, k_cache, v_cache, v_scales, PagedBatch(cu, torch.tensor(ctxs, dtype=torch.int32), tables.int())


# --------------------------------------------------------------------------- parent side


def test_triton_mixed_kernels_under_interpreter() -> None:
    run_under_interpreter(__file__, timeout_s=600)


test_triton_mixed_kernels_under_interpreter.__test__ = not INTERPRET  # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_v_row_is_within_half_a_step(dtype: torch.dtype) -> None:
    x = (torch.randn(50, 2, 32) * 3).to(dtype)
    x[0, 0] = 0  # an all-zero row
    x[1, 0] = 1e-4  # a row under 127 * V_SCALE_MIN: the smallest scale
    q, scale = reference.quantize_v_row(x)
    assert q.dtype == torch.int8 and scale.dtype == V_SCALE_DTYPE and scale.shape == x.shape[:-1]
    assert scale.float().min().item() >= V_SCALE_MIN and q.abs().max().item() <= 127
    assert q[0, 0].eq(0).all() and scale[1, 0].item() == V_SCALE_MIN
    back = reference.dequantize_v(q, scale, torch.float32)
    step = scale.float().unsqueeze(-1)  # (50, 2, 1)
    # Half a step, plus what the clamp at 127 can cost when the fp16 scale rounded down.
    assert ((back - x.float()).abs() <= step * 0.5 + x.float().abs() * 2**-11 + 1e-7).all()


def test_reference_store_quantizes_v_and_skips_padding() -> None:
    hkv, d = 2, 16
    kv = torch.randn(2, 5, hkv, d)
    slots = torch.tensor([0, 5, -1, 15, 3])
    k_cache = torch.zeros(4, BLOCK_SIZE, hkv, d, dtype=torch.float16)
    v_cache = torch.zeros(4, BLOCK_SIZE, hkv, d, dtype=torch.int8)
    v_scales = torch.zeros(4, BLOCK_SIZE, hkv, dtype=V_SCALE_DTYPE)
    reference.store_kvcache(kv[0], kv[1], k_cache, v_cache, slots, v_scales=v_scales)
    keep = slots >= 0
    q, scale = reference.quantize_v_row(kv[1][keep])
    assert torch.equal(v_cache.view(-1, hkv, d)[slots[keep]], q)
    assert torch.equal(v_scales.view(-1, hkv)[slots[keep]], scale)
    assert torch.equal(k_cache.view(-1, hkv, d)[slots[keep]], kv[0][keep].half())
    assert v_scales.view(-1, hkv).ne(0).any(-1).sum() == 4  # the -1 row wrote nothing


@pytest.mark.parametrize("batch", [DECODE, PREFILL, MIXED], ids=["decode", "prefill", "mixed"])
def test_reference_mixed_attention_is_attention_over_the_dequantized_values(batch) -> None:
    # Exact: the mixed reference is the 16-bit one over V = q * scale.
    q, kc, vc, vs, paged = make_mixed_batch(*batch, 8, 2, 32, torch.float32)
    got = reference.paged_attention(q, kc, vc, paged, 32**-0.5, v_scales=vs)
    want = reference.paged_attention(q, kc, reference.dequantize_v(vc, vs, torch.float32), paged, 32**-0.5)
    assert torch.equal(got, want)


@pytest.mark.parametrize("impl", [gather_sdpa, torch_attention], ids=["gather_sdpa", "torch_decode"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("batch", [DECODE, PREFILL, MIXED], ids=["decode", "prefill", "mixed"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_torch_attention_paths_read_the_mixed_pool(impl, batch, hq, hkv, dtype, tol) -> None:
    q, kc, vc, vs, paged = make_mixed_batch(*batch, hq, hkv, 32, dtype)
    want = reference.paged_attention(q, kc, vc, paged, 32**-0.5, v_scales=vs)
    got = impl.paged_attention(q, kc, vc, paged, 32**-0.5, v_scales=vs)
    assert max_err(got, want) <= tol


def test_mixed_attention_is_close_to_full_precision() -> None:
    # What INT8 V costs one attention output: about a step's worth, far from a wrong answer.
    g = torch.Generator().manual_seed(1)
    hkv, d, ctx = 2, 32, 40
    kv = torch.randn(2, ctx, hkv, d, generator=g)
    slots = torch.arange(ctx)
    pools = {}
    for mixed in (False, True):
        kc = torch.zeros(ctx // BLOCK_SIZE, BLOCK_SIZE, hkv, d)
        vc = torch.zeros_like(kc, dtype=torch.int8) if mixed else torch.zeros_like(kc)
        vs = torch.zeros(kc.shape[:3], dtype=V_SCALE_DTYPE) if mixed else None
        reference.store_kvcache(kv[0], kv[1], kc, vc, slots, v_scales=vs)
        pools[mixed] = (kc, vc, vs)
    q = torch.randn(ctx, 8, d, generator=g)
    paged = PagedBatch(torch.tensor([0, ctx], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32),
                       torch.arange(ctx // BLOCK_SIZE, dtype=torch.int32)[None])
    full = reference.paged_attention(q, *pools[False][:2], paged, d**-0.5)
    mixed = reference.paged_attention(q, *pools[True][:2], paged, d**-0.5, v_scales=pools[True][2])
    assert 0 < max_err(full, mixed) < 0.02


# --------------------------------------------------------------------------- child side


@pytest.mark.usefixtures("interpreter_runs_loops")
class TestUnderInterpreter:
    __test__ = INTERPRET

    @pytest.mark.parametrize("d", [16, 24, 32])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
    def test_store_kvcache_mixed(self, d: int, dtype: torch.dtype) -> None:
        from kernels.store_kvcache import store_kvcache

        hkv, t = 2, 7
        # K and V as strided views into one fused qkv tensor, as the model makes them.
        qkv = (torch.randn(t, 3 * hkv, d) * 3).to(dtype)
        qkv[1, 2 * hkv:] = 0  # all-zero V rows
        qkv[4, 2 * hkv] = 1e-4  # a row under 127 * V_SCALE_MIN
        key, value = qkv[:, hkv: 2 * hkv], qkv[:, 2 * hkv:]
        slots = torch.tensor([0, 5, -1, 15, 3, -1, 8])  # padding and a block boundary
        pools = []
        for _ in range(2):
            pools.append((torch.zeros(4, BLOCK_SIZE, hkv, d, dtype=dtype),
                          torch.zeros(4, BLOCK_SIZE, hkv, d, dtype=torch.int8),
                          torch.zeros(4, BLOCK_SIZE, hkv, dtype=V_SCALE_DTYPE)))
        got, want = pools
        store_kvcache(key, value, got[0], got[1], slots.int(), v_scales=got[2])
        reference.store_kvcache(key, value, want[0], want[1], slots, v_scales=want[2])
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        assert got[2].view(-1, hkv).ne(0).any(-1).sum() == 5  # the -1 rows wrote no scale

    def test_store_kvcache_rejects_a_wrong_mixed_layout(self) -> None:
        from kernels.store_kvcache import store_kvcache

        kv = torch.randn(2, 3, 2, 16)
        k_cache = torch.zeros(2, BLOCK_SIZE, 2, 16)
        with pytest.raises(ValueError, match="int8 V and float16 scales"):
            store_kvcache(kv[0], kv[1], k_cache, torch.zeros_like(k_cache), torch.tensor([1, 2, 6]),
                          v_scales=torch.zeros(2, BLOCK_SIZE, 2, dtype=V_SCALE_DTYPE))

    @pytest.mark.parametrize("batch", [DECODE, PREFILL, MIXED], ids=["decode", "prefill", "mixed"])
    @pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (6, 2), (4, 1)])
    def test_paged_attention_mixed_gqa(self, batch, hq: int, hkv: int) -> None:
        self._check(batch, hq, hkv, 32, torch.float32, 1e-5)

    @pytest.mark.parametrize("d", [16, 24, 32])
    @pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 5e-3)])
    def test_paged_attention_mixed_head_dims(self, d: int, dtype: torch.dtype, tol: float) -> None:
        self._check(MIXED, 8, 2, d, dtype, tol)

    @pytest.mark.parametrize("num_splits", [2, 3])
    def test_paged_attention_mixed_split_kv(self, num_splits: int) -> None:
        batch = ([1, 1, 1, 1], [1, 16, 40, 70])
        self._check(batch, 8, 2, 16, torch.float32, 1e-5, block_n=16, num_splits=num_splits)
        self._check(batch, 8, 2, 16, torch.float16, 5e-3, block_n=16, num_splits=num_splits)

    def test_paged_attention_mixed_block_size_16(self) -> None:
        from kernels.paged_attention import paged_attention

        q, kc, vc, vs, paged = make_mixed_batch([1, 1, 1, 5], [15, 16, 17, 40], 8, 2, 32, torch.float32,
                                                block_size=16)
        want = reference.paged_attention(q, kc, vc, paged, 32**-0.5, v_scales=vs)
        assert max_err(paged_attention(q, kc, vc, paged, 32**-0.5, v_scales=vs), want) <= 1e-5

    def test_engine_on_the_mixed_pool_decodes_the_same_with_triton_and_torch(self) -> None:
        # The whole path: the model runner's int8 pool, Triton storing and attending over it
        # (prefills, decodes, a prefix-cache hit), against the torch backend on the same pool.
        from workers.engine import Engine, EngineConfig
        from workers.model import load_model

        tiny = load_model("builtin:tiny", device="cpu", dtype="float32")
        batch = [list(range(5 + i, 40 + 3 * i)) for i in range(3)]
        out = {}
        for backend in ("triton", "torch"):
            config = EngineConfig(num_blocks=64, kernels=backend, kv_cache_dtype="int8-v", max_model_len=256)
            with Engine(tiny, config) as engine:
                assert engine.kernels.backend == backend and engine.v_scales is not None
                handles = [engine.submit(f"r{i}", p, 6) for i, p in enumerate(batch)]
                tokens = [h.result(timeout=300).tokens for h in handles]
                again = engine.generate("again", batch[2], 6)  # its first blocks come from the cache
                assert again.cached_tokens > 0
                out[backend] = tokens + [again.tokens]
        assert out["triton"] == out["torch"]

    @staticmethod
    def _check(batch, hq, hkv, d, dtype, tol, **tiles) -> None:
        from kernels.paged_attention import paged_attention

        q, kc, vc, vs, paged = make_mixed_batch(*batch, hq, hkv, d, dtype)
        scale = d ** -0.5
        got = paged_attention(q, kc, vc, paged, scale, v_scales=vs, **tiles)
        want = reference.paged_attention(q, kc, vc, paged, scale, v_scales=vs)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert max_err(got, want) <= tol
