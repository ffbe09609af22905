"""Attention over the paged KV pool, for a flat batch of sequences.

The model sees one flat token batch per step: sequence b owns query rows
`[cu_seqlens_q[b], cu_seqlens_q[b+1])`, and `context_lens[b]` counts its tokens in the
cache after this step's tokens are stored. One call covers prefill, prefill over a
cached prefix, chunked prefill and decode (see kernels/reference.py for the contract).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import ops


@dataclass(frozen=True)
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor  # (B+1,) int32
    context_lens: torch.Tensor  # (B,) int32
    block_tables: torch.Tensor  # (B, max_blocks) int32
    slot_mapping: torch.Tensor  # (T,) int64; -1 = do not store
    #: cu_seqlens_q on the host, so the fast path slices without a device sync.
    query_starts: tuple[int, ...]
    #: True when every sequence's context is exactly its new tokens (a prefill with no
    #: cached prefix): attention then needs only this step's K/V, not the pool.
    fresh_prefill: bool


def paged_attention(
    q: torch.Tensor,  # (T, Hq, D), rotary applied
    k: torch.Tensor,  # (T, Hkv, D), rotary applied
    v: torch.Tensor,  # (T, Hkv, D)
    k_cache: torch.Tensor,  # (NB, BS, Hkv, D)
    v_cache: torch.Tensor,  # (NB, BS, Hkv, D)
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # (T, Hq, D)
    """Store this step's K/V in the pool, then attend each query over its sequence's context."""
    ops.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.fresh_prefill:
        return _causal_sdpa(q, k, v, meta.query_starts, scale)
    return ops.paged_attention(
        q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables, scale
    )


def _causal_sdpa(
    q: torch.Tensor,  # (T, Hq, D)
    k: torch.Tensor,  # (T, Hkv, D)
    v: torch.Tensor,  # (T, Hkv, D)
    starts: tuple[int, ...],
    scale: float,
) -> torch.Tensor:  # (T, Hq, D)
    """Fast path for prefills without a cached prefix: the new K/V are the whole context,
    so torch's fused SDPA reads them directly instead of gathering blocks from the pool.
    On CPU this is several times faster than the pool gather for long prompts."""
    out = torch.empty_like(q)
    for lo, hi in zip(starts[:-1], starts[1:]):
        qb = q[lo:hi].transpose(0, 1)  # (Hq, L, D)
        kb = k[lo:hi].transpose(0, 1)  # (Hkv, L, D)
        vb = v[lo:hi].transpose(0, 1)  # (Hkv, L, D)
        ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True)
        out[lo:hi] = ob.transpose(0, 1)  # (L, Hq, D)
    return out
