"""Triton paged attention: causal attention of new tokens over a paged KV cache.

contract.PagedAttention, as kernels.reference.paged_attention: one kernel covers decode
(q_len = 1), prefill (q_len = context_len) and prefill over a cached prefix, with
ragged lengths in one batch and grouped-query attention.

One program owns (sequence b, a tile of BLOCK_M of its query tokens, one KV head, one
split of the keys) and streams those keys through the block table BLOCK_N at a time
with an online softmax in fp32. GQA: the GROUP query heads that share a KV head are
stacked into the rows of one tile, row r = (token r // BLOCK_G, head r % BLOCK_G), so
each K/V tile is loaded once for the whole group instead of once per query head.

Split-KV (flash-decoding): a decode batch has only B * Hkv programs, too few to fill
the GPU when B is small, so the keys are cut into splits that run in parallel and a
second kernel merges their partial softmaxes. With one split the first kernel writes
the output directly.

The mixed pool (V_INT8, contract.py): V tiles load as int8 with one fp16 scale per
key row and are dequantized in registers, to K's dtype, before the P·V dot; the
pool is read at 3 bytes a K/V value pair instead of 4.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.contract import PagedBatch
from kernels.launch import check_device, check_mixed_pool, head_block

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)); exp2 is the native instruction
MIN_ROWS = 16  # tl.dot wants M >= 16: decode tiles pad their few rows up to this
PREFILL_ROWS = 64  # rows of (token, head) per tile when q_len > 1
KEYS_PER_STEP = 64  # BLOCK_N: several pages per step, so a 16-slot page is not a tiny dot
TARGET_PROGRAMS = 256  # split decode until about this many programs: ~2 per SM on an H100/H200
MIN_KEYS_PER_SPLIT = 256  # below this a split's merge costs more than its parallelism buys


@triton.jit
def _attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    v_scale_ptr,  # (NB, BS, Hkv) contiguous fp16; unused unless V_INT8
    part_ptr, stats_ptr,  # split partials: (T, Hq, S, D) and (T, Hq, S, 2) fp32
    cu_seqlens_ptr, context_lens_ptr, block_tables_ptr,
    scale_log2,  # softmax scale * log2(e)
    stride_qt, stride_qh,  # q and out (T, Hq, D), last dim contiguous
    stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch,  # caches (NB, BS, Hkv, D), last dim contiguous
    stride_bt,  # block_tables (B, max_blocks), contiguous
    num_q_heads, num_kv_heads, group, block_size, head_dim,
    num_splits, split_len,  # keys [split * split_len, (split + 1) * split_len)
    BLOCK_M: tl.constexpr,  # query tokens per tile
    BLOCK_G: tl.constexpr,  # query heads per KV head, rounded up to a power of two
    BLOCK_N: tl.constexpr,  # keys per step; divides split_len
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of two
    SPLIT: tl.constexpr,  # num_splits > 1: write partials, not the output
    IEEE_DOT: tl.constexpr,  # fp32 inputs: full-precision dots instead of TF32
    V_INT8: tl.constexpr,  # the mixed pool: V is int8 times a per-row scale
):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits

    q_lo = tl.load(cu_seqlens_ptr + b)
    q_len = tl.load(cu_seqlens_ptr + b + 1) - q_lo
    if tile * BLOCK_M >= q_len:  # the grid covers the longest sequence; this one is shorter
        return
    ctx = tl.load(context_lens_ptr + b)

    r = tl.arange(0, BLOCK_M * BLOCK_G)  # (R,) rows: (token, head in group)
    m = tile * BLOCK_M + r // BLOCK_G  # (R,) query index within the sequence
    g = r % BLOCK_G  # (R,) head within the group
    row_ok = (m < q_len) & (g < group)
    q_pos = ctx - q_len + m  # (R,) absolute position: sees keys at positions <= q_pos
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    io_mask = row_ok[:, None] & d_ok[None, :]  # (R, D)

    head = kvh * group + g  # (R,) query head
    token = (q_lo + m).to(tl.int64)  # (R,) row of q and out
    q_off = token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]  # (R, 1) + (R, 1) + (1, D)
    q = tl.load(q_ptr + q_off, mask=io_mask, other=0.0)  # (R, D)

    # Running max (log2 domain), normaliser and output of the online softmax, fp32.
    # The max starts finite so an all-masked (padding) row gives exp2(-inf) = 0, not NaN.
    m_i = tl.full([BLOCK_M * BLOCK_G], -1.0e30, tl.float32)  # (R,)
    l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)  # (R,)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)  # (R, D)

    # Causal: no row of this tile sees past its last query's position.
    last_m = tl.minimum((tile + 1) * BLOCK_M, q_len) - 1
    kv_end = tl.minimum(ctx, ctx - q_len + last_m + 1)
    kv_lo = split * split_len
    kv_hi = tl.minimum(kv_end, kv_lo + split_len)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # (N,) key positions
        n_ok = n < kv_hi
        # Page lookup per key: a step may span several pages of the block table.
        block = tl.load(table + n // block_size, mask=n_ok, other=0).to(tl.int64)  # (N,)
        kv_off = block * stride_cb + (n % block_size) * stride_cs + kvh * stride_ch  # (N,)
        kv_mask = n_ok[:, None] & d_ok[None, :]  # (N, D)
        k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # (N, D)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # (N, D)
        if V_INT8:
            scale_row = (block * block_size + n % block_size) * num_kv_heads + kvh  # (N,) slot * Hkv + head
            v_scale = tl.load(v_scale_ptr + scale_row, mask=n_ok, other=0.0).to(tl.float32)  # (N,)
            v = (v.to(tl.float32) * v_scale[:, None]).to(k.dtype)  # (N, D) * (N, 1)

        if IEEE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # (R, N)
        else:
            s = tl.dot(q, tl.trans(k))  # (R, N)
        s = s * scale_log2
        visible = n_ok[None, :] & (n[None, :] <= q_pos[:, None])  # (R, N)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # (R,)
        alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old max
        p = tl.exp2(s - m_new[:, None])  # (R, N)
        l_i = l_i * alpha + tl.sum(p, axis=1)  # (R,)
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")  # (R, D) + (R, N) @ (N, D)
        else:
            # p in the cache dtype (bf16/fp16) for the tensor-core dot; accumulate in fp32.
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)  # (R, D) + (R, N) @ (N, D)
        m_i = m_new

    if SPLIT:
        # Unnormalised partials; an empty split leaves l = 0, which the merge weighs as 0.
        row = (token[:, None] * num_q_heads + head[:, None]) * num_splits + split  # (R, 1)
        tl.store(part_ptr + row * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])  # (R, D)
        tl.store(stats_ptr + row * 2, m_i[:, None], mask=row_ok[:, None])  # (R, 1)
        tl.store(stats_ptr + row * 2 + 1, l_i[:, None], mask=row_ok[:, None])  # (R, 1)
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # (R, D) / (R, 1)
        o_off = token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]  # (R, D)
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _merge_splits_kernel(
    part_ptr, stats_ptr, out_ptr,  # (T, Hq, S, BLOCK_D), (T, Hq, S, 2) fp32; out (T, Hq, D)
    stride_ot, stride_oh,
    num_q_heads, head_dim, num_splits,
    BLOCK_S: tl.constexpr,  # num_splits rounded up to a power of two
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    row = (t.to(tl.int64) * num_q_heads + h) * num_splits + s  # (S,)
    m = tl.load(stats_ptr + row * 2, mask=s_ok, other=-1.0e30)  # (S,) log2-domain maxima
    l = tl.load(stats_ptr + row * 2 + 1, mask=s_ok, other=0.0)  # (S,)
    part = tl.load(part_ptr + row[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0)  # (S, D)
    # Bring every split to the common max, as the online softmax would have.
    w = tl.exp2(m - tl.max(m, axis=0))  # (S,)
    out = tl.sum(part * w[:, None], axis=0) / tl.sum(l * w, axis=0)  # (D,)
    o_off = t.to(tl.int64) * stride_ot + h * stride_oh + d  # (D,)
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=d < head_dim)


def _num_splits(programs: int, max_ctx: int, block_n: int) -> int:
    """Splits per (sequence, KV head): enough to fill the GPU, none for short contexts."""
    by_occupancy = triton.cdiv(TARGET_PROGRAMS, programs)
    by_length = max(1, max_ctx // max(MIN_KEYS_PER_SPLIT, block_n))
    return max(1, min(by_occupancy, by_length))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    scale: float,
    *,
    block_m: int | None = None,
    block_n: int = KEYS_PER_STEP,
    num_splits: int | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """contract.PagedAttention.

    Keyword-only tuning knobs, chosen automatically when None: block_m (query tokens
    per tile), block_n (keys per step, a power of two >= 16) and num_splits (split-KV
    for decode; prefill does not split).
    """
    cu_seqlens_q, context_lens, block_tables = batch.cu_seqlens_q, batch.context_lens, batch.block_tables
    check_device(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables)
    if v_scales is not None:
        check_mixed_pool(k_cache, v_cache, v_scales)
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share one layout with head_dim contiguous")
    out = torch.empty_like(q)  # (T, Hq, D)
    b = batch.num_seqs
    if t == 0 or b == 0:
        return out
    group = hq // hkv
    block_g = triton.next_power_of_2(group)
    block_d = head_block(d)
    # One host sync: the grid must cover the longest query run and the longest context.
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]  # (B,)
    max_q_len, max_ctx = (int(x) for x in torch.stack([q_lens.max(), context_lens.max()]).tolist())
    if block_m is None:
        block_m = max(1, (MIN_ROWS if max_q_len == 1 else PREFILL_ROWS) // block_g)
    if num_splits is None:
        num_splits = _num_splits(b * hkv, max_ctx, block_n) if max_q_len == 1 else 1
    # Every split but the last is a whole number of key steps.
    split_len = triton.cdiv(triton.cdiv(max(max_ctx, 1), num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_ctx, split_len)
    if num_splits > 1:
        part = torch.empty(t, hq, num_splits, block_d, dtype=torch.float32, device=q.device)
        stats = torch.empty(t, hq, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part = stats = out  # unused: SPLIT=False never touches them

    q = q if q.stride(-1) == 1 else q.contiguous()
    grid = (b, triton.cdiv(max_q_len, block_m), hkv * num_splits)
    _attention_kernel[grid](
        q, k_cache, v_cache, out, v_cache if v_scales is None else v_scales, part, stats,
        cu_seqlens_q.contiguous(), context_lens.contiguous(), block_tables.contiguous(),
        scale * LOG2E,
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.shape[1],
        hq, hkv, group, k_cache.shape[1], d,
        num_splits, split_len,
        BLOCK_M=block_m, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
        SPLIT=num_splits > 1, IEEE_DOT=q.dtype == torch.float32, V_INT8=v_scales is not None,
    )
    if num_splits > 1:
        _merge_splits_kernel[(t, hq)](
            part, stats, out, out.stride(0), out.stride(1), hq, d, num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        )
    return out
