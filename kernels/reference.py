"""Plain-torch references for kvfleet's KV kernels: kernels/contract.py in code.

These functions are correct first and fast second; every other implementation in this
package has the same signature (the layout and the signatures are in kernels/contract.py)
and is tested against the function here.
"""

from __future__ import annotations

import torch

from kernels.contract import V_SCALE_DTYPE, V_SCALE_MIN, PagedBatch


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, *, v_scales: torch.Tensor | None = None) -> None:
    """contract.StoreKVCache."""
    nb, bs, hkv, d = k_cache.shape
    keep = slot_mapping >= 0  # (T,)
    slots = slot_mapping[keep].long()  # (T',)
    k_cache.view(nb * bs, hkv, d)[slots] = key[keep].to(k_cache.dtype)  # (NB*BS, Hkv, D)[T'] = (T', Hkv, D)
    if v_scales is None:
        v_cache.view(nb * bs, hkv, d)[slots] = value[keep].to(v_cache.dtype)
        return
    q, scale = quantize_v_row(value[keep])  # (T', Hkv, D) int8, (T', Hkv) fp16
    v_cache.view(nb * bs, hkv, d)[slots] = q
    v_scales.view(nb * bs, hkv)[slots] = scale  # (NB*BS, Hkv)[T'] = (T', Hkv)


def quantize_v_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mixed pool's V: (..., D) float -> (..., D) int8 and (...,) V_SCALE_DTYPE.

    As quantize_int8, but the scale is rounded to 16 bits first and the values are
    divided by the rounded scale, so `q * scale` is what was stored, to half a step.
    """
    xf = x.float()
    absmax = xf.abs().amax(dim=-1)  # (...,)
    scale = (absmax * (1.0 / 127.0)).clamp_min(V_SCALE_MIN).to(V_SCALE_DTYPE)  # (...,)
    # A scale rounded down can put the absmax a hair past 127: the clamp takes it.
    q = torch.round(xf / scale.float().unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)  # (..., D) / (..., 1)
    return q, scale


def dequantize_v(v_cache: torch.Tensor, v_scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """V rows as `dtype`: (..., D) int8 times (...,) scales, or v_cache itself without scales."""
    if v_scales is None:
        return v_cache
    return (v_cache.float() * v_scales.float().unsqueeze(-1)).to(dtype)  # (..., D) * (..., 1)


def gather_kv(
    cache: torch.Tensor,  # (NB, BS, Hkv, D)
    block_table: torch.Tensor,  # (max_blocks,) int
    length: int,
) -> torch.Tensor:  # (length, Hkv, D)
    """The first `length` tokens of one sequence, contiguous."""
    bs = cache.shape[1]
    n_blocks = (length + bs - 1) // bs
    blocks = cache[block_table[:n_blocks].long()]  # (n_blocks, BS, Hkv, D)
    return blocks.reshape(n_blocks * bs, *cache.shape[2:])[:length]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
                    scale: float, *, v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """contract.PagedAttention: one sequence at a time, K/V expanded to every query head."""
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    out = torch.empty_like(q)  # (T, Hq, D)
    cu = batch.cu_seqlens_q.tolist()
    lens = batch.context_lens.tolist()
    for b in range(len(lens)):
        q_lo, q_hi = cu[b], cu[b + 1]
        q_len, ctx = q_hi - q_lo, lens[b]
        if q_len == 0:
            continue
        k = gather_kv(k_cache, batch.block_tables[b], ctx)  # (ctx, Hkv, D)
        v = gather_kv(v_cache, batch.block_tables[b], ctx)  # (ctx, Hkv, D)
        if v_scales is not None:  # the mixed pool: int8 rows times their scales
            v = dequantize_v(v, gather_kv(v_scales, batch.block_tables[b], ctx), torch.float32)  # (ctx, Hkv, D)
        k = k.repeat_interleave(group, dim=1).transpose(0, 1).float()  # (Hq, ctx, D)
        v = v.repeat_interleave(group, dim=1).transpose(0, 1).float()  # (Hq, ctx, D)
        qb = q[q_lo:q_hi].transpose(0, 1).float()  # (Hq, q_len, D)
        scores = torch.matmul(qb, k.transpose(1, 2)) * scale  # (Hq, q_len, ctx)
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device).unsqueeze(1)  # (q_len, 1)
        k_pos = torch.arange(ctx, device=q.device).unsqueeze(0)  # (1, ctx)
        scores.masked_fill_(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # (Hq, q_len, ctx)
        out[q_lo:q_hi] = torch.matmul(probs, v).transpose(0, 1).to(q.dtype)  # (q_len, Hq, D)
    return out


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """contract.QuantizeInt8.

    A per-row scale keeps one outlier token from flattening a whole block's precision;
    it costs 4 bytes per D values (3% at D=128).
    """
    xf = x.float()
    absmax = xf.abs().amax(dim=-1)  # (...,)
    # Times the reciprocal, not / 127: torch divides by a scalar exactly on CPU but as
    # a multiply by its reciprocal on CUDA, so the division gave device-dependent scales.
    scale = (absmax * (1.0 / 127.0)).clamp_min(1e-8)  # an all-zero row keeps scale > 0
    q = torch.round(xf / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)  # (..., D) / (..., 1)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """contract.DequantizeInt8."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)  # (..., D) * (..., 1)
