"""The torch backend's paged attention: the reference, with a faster path for decode.

A decode step (one query row per sequence) is most of an engine's steps. The reference
expands K/V to every query head (`repeat_interleave`) and builds a causal mask; for
one query row neither is needed. Here each sequence's query heads are grouped by the KV
head they read, `(Hkv, G, D)`, so one batched matmul per sequence covers all heads
without copying K/V G times. Measured on one CPU core (32 sequences, context 100-400,
8 query / 2 KV heads, head_dim 64): 1.6 ms against the reference's 3.8 ms per layer.
Prefills keep the reference: their matmuls are large and the loop overhead is small.
"""

from __future__ import annotations

import torch

from kernels import reference
from kernels.contract import PagedBatch


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
                    scale: float, *, v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """contract.PagedAttention: `decode` when every sequence has one query row, else the reference."""
    if q.shape[0] != batch.num_seqs:  # some sequence has several query rows: a prefill
        return reference.paged_attention(q, k_cache, v_cache, batch, scale, v_scales=v_scales)
    return decode(q, k_cache, v_cache, batch, scale, v_scales=v_scales)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
           scale: float, *, v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """contract.PagedAttention for a batch of one query row per sequence (B = T), at its last position."""
    hq, d = q.shape[1:]
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    out = torch.empty_like(q)  # (B, Hq, D)
    for b, ctx in enumerate(batch.context_lens.tolist()):
        blocks = batch.block_tables[b, :(ctx + bs - 1) // bs].long()  # (n_blocks,)
        k = k_cache[blocks].view(-1, hkv, d)[:ctx].float()  # (n_blocks, BS, Hkv, D) -> (ctx, Hkv, D)
        v = v_cache[blocks].view(-1, hkv, d)[:ctx].float()  # (n_blocks, BS, Hkv, D) -> (ctx, Hkv, D)
        if v_scales is not None:  # the mixed pool: int8 rows times their scales
            v = v * v_scales[blocks].view(-1, hkv, 1)[:ctx].float()  # (ctx, Hkv, D) * (ctx, Hkv, 1)
        qg = q[b].view(hkv, group, d).float()  # (Hq, D) -> (Hkv, G, D): heads that share a KV head
        # The only query is the last position, so every cached token is visible: no mask.
        probs = torch.softmax(torch.bmm(qg, k.permute(1, 2, 0)) * scale, dim=-1)  # (Hkv, G, ctx)
        out[b] = torch.bmm(probs, v.transpose(0, 1)).view(hq, d).to(q.dtype)  # (Hkv, G, D) -> (Hq, D)
    return out
