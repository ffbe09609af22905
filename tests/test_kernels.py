"""Triton kernels against the torch reference, under the Triton interpreter on CPU.

TRITON_INTERPRET=1 must be in the environment before a kernel module is imported (the
triton.jit decorator reads it), and setting it in this process would also switch the
engine tests' kernels (kernels.ops.select("auto", ...)) to the slow interpreter. So the interpreted tests run in a
child pytest of this same file started with TRITON_INTERPRET=1:
`test_triton_kernels_under_interpreter` starts it, and the class TestUnderInterpreter
is collected only there (its `__test__` flag). Run the child's tests alone with
`TRITON_INTERPRET=1 pytest tests/test_kernels.py`.

Tolerances (max abs error vs the reference, which computes in fp32):
  store_kvcache            exact (a copy)
  quantize_int8            exact int8 values and fp32 scales (on CUDA too: bench/kernels.py)
  dequantize_int8          exact; bf16 output within 1 bf16 ulp, because the
                           interpreter rounds fp32->bf16 toward zero where the GPU
                           rounds to nearest even
  paged attention fp32     1e-5 (same math, different summation order)
  paged attention fp16     5e-3 (probabilities go through fp16 for the P @ V dot)
  gather + SDPA fp32/bf16  1e-5 / 2e-2
  torch decode path        1e-5 / 2e-2 (fp32 / bf16), as gather + SDPA
bf16 paged attention is checked on the GPU by bench/kernels.py: the interpreter
multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584, not supported).
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels import gather_sdpa, native, ops, reference, torch_attention
from kernels.contract import PagedBatch
from tests.interpreter import run_under_interpreter

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# (q_lens, context_lens) per batch, for block_size 4: contexts at 1, BS-1, BS, BS+1 and
# several blocks; decode, full prefill, prefill over a prefix, an empty query run.
DECODE = ([1, 1, 1, 1, 1], [1, 3, 4, 5, 14])
PREFILL = ([1, 4], [1, 4])
MIXED = ([1, 3, 0, 6, 2], [4, 3, 2, 13, 9])
BLOCK_SIZE = 4


def make_batch(
    q_lens: list[int], ctxs: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype,
    *, block_size: int = BLOCK_SIZE, seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PagedBatch]:
    """A shuffled paged pool holding each sequence's context; unused slots are NaN."""
    g = torch.Generator().manual_seed(seed)
    per_seq = max((c + block_size - 1) // block_size for c in ctxs) + 1  # one spare column
    nb = len(ctxs) * per_seq + 3
    tables = torch.randperm(nb, generator=g)[: len(ctxs) * per_seq].view(len(ctxs), per_seq)
    k_cache = torch.full((nb, block_size, hkv, d), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    for b, c in enumerate(ctxs):
        pos = torch.arange(c)
        slots = tables[b, pos // block_size] * block_size + pos % block_size  # (c,)
        kv = torch.randn(2, c, hkv, d, generator=g).to(dtype)
        reference.store_kvcache(kv[0], kv[1], k_cache, v_cache, slots)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    return q, k_cache, v_cache, PagedBatch(cu, torch.tensor(ctxs, dtype=torch.int32), tables.int())


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# --------------------------------------------------------------------------- parent side


def test_triton_kernels_under_interpreter() -> None:
    run_under_interpreter(__file__, timeout_s=300)


test_triton_kernels_under_interpreter.__test__ = not INTERPRET  # type: ignore[attr-defined]


@pytest.mark.parametrize("impl", [gather_sdpa, torch_attention], ids=["gather_sdpa", "torch_decode"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("batch", [DECODE, PREFILL, MIXED])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 2)])
def test_torch_attention_paths_match_reference(impl, batch, hq, hkv, dtype, tol) -> None:
    # torch_attention takes its grouped decode path on DECODE; the NaN in unused pool
    # slots would show any read past a sequence's context.
    q, kc, vc, paged = make_batch(*batch, hq, hkv, 32, dtype)
    want = reference.paged_attention(q, kc, vc, paged, 32**-0.5)
    got = impl.paged_attention(q, kc, vc, paged, 32**-0.5)
    assert max_err(got, want) <= tol


@pytest.mark.parametrize("case", [
    ([20], [20]),  # a whole prompt: is_causal
    ([6], [40]),  # a chunk over a cached prefix: the bottom-right mask
    ([1], [33]),  # one row over a cached prefix: no mask
    ([1, 1], [3, 17]),  # single rows only (paged_attention would take them to decode)
])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_torch_prefill_matches_reference_in_each_mask_case(case, dtype, tol) -> None:
    # Beside each case, a sequence with no query rows this step (skipped); block size
    # 16, as the engine's, and contexts past one block, NaN in every unused slot.
    q_lens, ctxs = [0, *case[0]], [2, *case[1]]
    q, kc, vc, paged = make_batch(q_lens, ctxs, 8, 2, 32, dtype, block_size=16)
    want = reference.paged_attention(q, kc, vc, paged, 32**-0.5)
    assert max_err(torch_attention.prefill(q, kc, vc, paged, 32**-0.5), want) <= tol


def test_torch_decode_matches_reference_past_a_block() -> None:
    # Contexts of many 16-token blocks, shuffled in the pool, NaN in every unused slot.
    ctxs = [1, 15, 16, 17, 100, 255, 256, 257]
    q, kc, vc, paged = make_batch([1] * len(ctxs), ctxs, 8, 2, 64, torch.float32, block_size=16)
    want = reference.paged_attention(q, kc, vc, paged, 64**-0.5)
    assert max_err(torch_attention.decode(q, kc, vc, paged, 64**-0.5), want) <= 1e-5


def test_select_torch_and_sdpa() -> None:
    kernels = ops.select("torch", "sdpa")
    assert (kernels.backend, kernels.attention) == ("torch", "sdpa")
    assert kernels.paged_attention is gather_sdpa.paged_attention
    assert kernels.store_kvcache is reference.store_kvcache
    q, kc, vc, paged = make_batch(*MIXED, 4, 2, 16, torch.float32)
    got = kernels.paged_attention(q, kc, vc, paged, 0.25)
    assert max_err(got, reference.paged_attention(q, kc, vc, paged, 0.25)) <= 1e-5
    assert ops.select("torch", "paged").paged_attention is torch_attention.paged_attention


def test_select_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="auto.*triton.*torch"):
        ops.select("cuda", "paged")
    with pytest.raises(ValueError, match="paged.*sdpa"):
        ops.select("auto", "flash")


def test_select_forced_triton_fails_clearly_without_gpu(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="cannot run here: no CUDA device"):
        ops.select("triton", "paged")
    assert ops.select("auto", "paged").backend == ("native" if native.library() is not None else "torch")


def test_kernels_are_immutable() -> None:
    kernels = ops.select("torch", "paged")
    with pytest.raises(AttributeError):
        kernels.paged_attention = gather_sdpa.paged_attention  # type: ignore[misc]


# ---------------------------------------------------------------------------- child side


@pytest.fixture(scope="module")
def interpreter_runs_loops() -> None:
    """Fail every test with the cause when this interpreter cannot run the kernels.

    triton <= 3.6 under numpy >= 2.4 cannot take a loop bound that is not a
    constexpr (triton-lang/triton#9171), which paged attention needs.
    """
    import triton
    import triton.language as tl

    @triton.jit
    def count_steps(out_ptr, n):
        steps = 0
        for _ in range(0, n):
            steps += 1
        tl.store(out_ptr, steps)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        count_steps[(1,)](out, 3)
    except Exception as e:
        import numpy

        raise RuntimeError(
            f"the interpreter of triton {triton.__version__} with numpy {numpy.__version__} "
            "cannot run loops with runtime bounds (triton-lang/triton#9171); "
            "use a newer triton (3.9 works) or numpy < 2.4"
        ) from e
    assert out.item() == 3


@pytest.mark.usefixtures("interpreter_runs_loops")
class TestUnderInterpreter:
    __test__ = INTERPRET

    @pytest.mark.parametrize("d", [16, 32, 64, 24])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
    def test_store_kvcache(self, d: int, dtype: torch.dtype) -> None:
        from kernels.store_kvcache import store_kvcache

        hkv, t = 2, 7
        # K and V as strided views into one fused qkv tensor, as the model makes them.
        qkv = torch.randn(t, 3 * hkv, d).to(dtype)
        key, value = qkv[:, hkv : 2 * hkv], qkv[:, 2 * hkv :]
        slots = torch.tensor([0, 5, -1, 15, 3, -1, 8])  # padding and a block boundary
        got = [torch.zeros(4, BLOCK_SIZE, hkv, d, dtype=dtype) for _ in range(2)]
        want = [c.clone() for c in got]
        store_kvcache(key, value, *got, slots.int())
        reference.store_kvcache(key, value, *want, slots)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[0].view(-1, hkv, d).ne(0).any(-1).any(-1).sum() == 5  # the -1 rows skipped

    def test_store_kvcache_casts_to_cache_dtype(self) -> None:
        from kernels.store_kvcache import store_kvcache

        kv = torch.randn(2, 3, 2, 16)
        got = [torch.zeros(2, BLOCK_SIZE, 2, 16, dtype=torch.float16) for _ in range(2)]
        want = [c.clone() for c in got]
        store_kvcache(kv[0], kv[1], *got, torch.tensor([1, 2, 6]))
        reference.store_kvcache(kv[0], kv[1], *want, torch.tensor([1, 2, 6]))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    @pytest.mark.parametrize("shape", [(5, 3, 16), (7, 2, 24), (1, 64), (33, 4, 128), (0, 2, 32)])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
    def test_quant_int8(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        from kernels.quant_int8 import dequantize_int8, quantize_int8

        x = (torch.randn(shape) * 3).to(dtype)
        if x.numel():
            x.view(-1, shape[-1])[0] = 0  # an all-zero row keeps a positive scale
        q, scale = quantize_int8(x)
        q_ref, scale_ref = reference.quantize_int8(x)
        assert q.shape == x.shape and scale.shape == x.shape[:-1]
        assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
        for out in (torch.float32, torch.float16, torch.bfloat16):
            got, want = dequantize_int8(q, scale, out), reference.dequantize_int8(q, scale, out)
            rtol = 2**-7 if out == torch.bfloat16 else 0.0  # 1 bf16 ulp: see module docstring
            torch.testing.assert_close(got, want, rtol=rtol, atol=0.0)

    def test_quant_int8_rounds_half_to_even(self) -> None:
        from kernels.quant_int8 import quantize_int8

        x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 3.5, 126.5]])  # scale exactly 1
        q, _ = quantize_int8(x)
        assert q.tolist() == [[127, 0, 2, 2, -2, 0, 4, 126]] == reference.quantize_int8(x)[0].tolist()

    def test_head_dim_over_256_is_a_clear_error(self) -> None:
        from kernels.quant_int8 import quantize_int8

        with pytest.raises(ValueError, match="head_dim must be in 1..256"):
            quantize_int8(torch.zeros(2, 320))

    @pytest.mark.parametrize("batch", [DECODE, PREFILL, MIXED], ids=["decode", "prefill", "mixed"])
    @pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 2), (6, 2), (4, 1)])
    def test_paged_attention_gqa(self, batch, hq: int, hkv: int) -> None:
        self._check(batch, hq, hkv, 32, torch.float32, 1e-5)

    @pytest.mark.parametrize("d", [16, 64, 24])
    @pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 5e-3)])
    def test_paged_attention_head_dims(self, d: int, dtype: torch.dtype, tol: float) -> None:
        self._check(MIXED, 8, 2, d, dtype, tol)

    @pytest.mark.parametrize("block_m,block_n", [(1, 16), (2, 16), (4, 32)])
    def test_paged_attention_tiles(self, block_m: int, block_n: int) -> None:
        # Small tiles: query runs span several tiles, and one key step spans several pages.
        batch = ([3, 9, 1], [3, 21, 17])
        self._check(batch, 4, 2, 16, torch.float32, 1e-5, block_m=block_m, block_n=block_n)

    @pytest.mark.parametrize("num_splits", [2, 3, 8])
    @pytest.mark.parametrize(
        "batch", [([1, 1, 1, 1], [1, 16, 40, 70]), ([1, 3, 0, 5], [40, 3, 2, 70])],
        ids=["decode", "mixed"],
    )
    def test_paged_attention_split_kv(self, batch, num_splits: int) -> None:
        # 2, 3 and 5 splits (of 48, 32, 16 keys) over the 70-token context; the shorter
        # sequences leave some splits partial or empty.
        self._check(batch, 8, 2, 16, torch.float32, 1e-5, block_n=16, num_splits=num_splits)
        self._check(batch, 8, 2, 16, torch.float16, 5e-3, block_n=16, num_splits=num_splits)

    def test_paged_attention_block_size_16(self) -> None:
        batch = ([1, 1, 1, 1, 5], [1, 15, 16, 17, 40])
        q, kc, vc, paged = make_batch(*batch, 8, 2, 32, torch.float32, block_size=16)
        self._compare(q, kc, vc, paged, 1e-5)

    def test_select_auto_runs_triton(self) -> None:
        from kernels import paged_attention, quant_int8

        kernels = ops.select("auto", "paged")
        assert kernels.backend == "triton" and kernels.attention == "paged"
        assert kernels.paged_attention is paged_attention.paged_attention
        assert kernels.quantize_int8 is quant_int8.quantize_int8

    def _check(self, batch, hq, hkv, d, dtype, tol, **tiles) -> None:
        q, kc, vc, paged = make_batch(*batch, hq, hkv, d, dtype)
        self._compare(q, kc, vc, paged, tol, **tiles)

    @staticmethod
    def _compare(q, kc, vc, paged, tol, **tiles) -> None:
        from kernels.paged_attention import paged_attention

        scale = q.shape[-1] ** -0.5
        got = paged_attention(q, kc, vc, paged, scale, **tiles)
        want = reference.paged_attention(q, kc, vc, paged, scale)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert max_err(got, want) <= tol
