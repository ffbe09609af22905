"""Plain-torch references for kvfleet's KV kernels: the contract the Triton kernels meet.

The paged KV layout (one pair of tensors per layer), shared by the engine, the kernels
and the cold tier:

    k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim)

A token's *slot* is `block_id * block_size + offset`; a sequence's *block table* lists
its block ids in order. Slot -1 means "do not store" (padding).

These functions are correct first and fast second; each Triton kernel in this package
has the same signature and is tested against the function here.
"""

from __future__ import annotations

import torch


def store_kvcache(
    key: torch.Tensor,  # (T, Hkv, D)
    value: torch.Tensor,  # (T, Hkv, D)
    k_cache: torch.Tensor,  # (NB, BS, Hkv, D)
    v_cache: torch.Tensor,  # (NB, BS, Hkv, D)
    slot_mapping: torch.Tensor,  # (T,) int, -1 = skip
) -> None:
    """Scatter new K/V rows into the paged pool, in place."""
    nb, bs, hkv, d = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(nb * bs, hkv, d)[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(nb * bs, hkv, d)[slots] = value[keep].to(v_cache.dtype)


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


def paged_attention(
    q: torch.Tensor,  # (T, Hq, D): the new tokens of B sequences, concatenated
    k_cache: torch.Tensor,  # (NB, BS, Hkv, D), already holding the new tokens' K
    v_cache: torch.Tensor,  # (NB, BS, Hkv, D), already holding the new tokens' V
    cu_seqlens_q: torch.Tensor,  # (B+1,) int: q rows of sequence b are [cu[b], cu[b+1])
    context_lens: torch.Tensor,  # (B,) int: tokens in cache per sequence, new ones included
    block_tables: torch.Tensor,  # (B, max_blocks) int
    scale: float,
) -> torch.Tensor:  # (T, Hq, D)
    """Causal attention of each sequence's new tokens over its whole cached context.

    Covers prefill (q_len = context_len), prefill over a cached prefix
    (q_len < context_len) and decode (q_len = 1) in one definition: query row i of
    sequence b sits at position context_len[b] - q_len[b] + i and sees positions <= it.
    Grouped-query attention: query head h reads KV head h // (Hq // Hkv).
    """
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for b in range(len(lens)):
        q_lo, q_hi = cu[b], cu[b + 1]
        q_len, ctx = q_hi - q_lo, lens[b]
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[b], ctx)  # (ctx, Hkv, D)
        v = gather_kv(v_cache, block_tables[b], ctx)
        k = k.repeat_interleave(group, dim=1).transpose(0, 1).float()  # (Hq, ctx, D)
        v = v.repeat_interleave(group, dim=1).transpose(0, 1).float()  # (Hq, ctx, D)
        qb = q[q_lo:q_hi].transpose(0, 1).float()  # (Hq, q_len, D)
        scores = torch.matmul(qb, k.transpose(1, 2)) * scale  # (Hq, q_len, ctx)
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device).unsqueeze(1)  # (q_len, 1)
        k_pos = torch.arange(ctx, device=q.device).unsqueeze(0)  # (1, ctx)
        scores.masked_fill_(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_lo:q_hi] = torch.matmul(probs, v).transpose(0, 1).to(q.dtype)  # (q_len, Hq, D)
    return out


def quantize_int8(
    x: torch.Tensor,  # (..., D) float
) -> tuple[torch.Tensor, torch.Tensor]:  # (..., D) int8, (...,) float32
    """Symmetric INT8 with one scale per row of D values (per token and head).

    A per-row scale keeps one outlier token from flattening a whole block's precision;
    it costs 4 bytes per D values (3% at D=128).
    """
    xf = x.float()
    absmax = xf.abs().amax(dim=-1)  # (...,)
    # Times the reciprocal, not / 127: torch divides by a scalar exactly on CPU but as
    # a multiply by its reciprocal on CUDA, so the division gave device-dependent scales.
    scale = (absmax * (1.0 / 127.0)).clamp_min(1e-8)  # an all-zero row keeps scale > 0
    q = torch.round(xf / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(
    q: torch.Tensor,  # (..., D) int8
    scale: torch.Tensor,  # (...,) float32
    dtype: torch.dtype,
) -> torch.Tensor:  # (..., D) dtype
    return (q.float() * scale.unsqueeze(-1)).to(dtype)
