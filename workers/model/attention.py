"""Attention over the paged KV pool, for a flat batch of sequences.

The model sees one flat token batch per step: sequence b owns query rows
`[cu_seqlens_q[b], cu_seqlens_q[b+1])`, and `context_lens[b]` counts its tokens in the
cache after this step's tokens are stored. One call covers prefill, prefill over a
cached prefix, chunked prefill and decode (see kernels/reference.py for the contract).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import ops


@dataclass(frozen=True)
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor  # (B+1,) int32
    context_lens: torch.Tensor  # (B,) int32
    block_tables: torch.Tensor  # (B, max_blocks) int32
    slot_mapping: torch.Tensor  # (T,) int64; -1 = do not store
    #: cu_seqlens_q on the host, so slicing needs no device sync.
    query_starts: tuple[int, ...]
    #: The first sequences have one query row each (decodes); prefills follow.
    num_decode_seqs: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_starts) - 1


def paged_attention(
    q: torch.Tensor,  # (T, Hq, D), rotary applied
    k: torch.Tensor,  # (T, Hkv, D), rotary applied
    v: torch.Tensor,  # (T, Hkv, D)
    k_cache: torch.Tensor,  # (NB, BS, Hkv, D)
    v_cache: torch.Tensor,  # (NB, BS, Hkv, D)
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # (T, Hq, D)
    """Store this step's K/V in the pool, then attend each query over its sequence's context.

    Decodes and prefills go to separate calls: an implementation that pads queries to
    the batch's longest (kernels.gather_sdpa) would otherwise pad every decode row of a
    mixed batch to the length of its longest prefill chunk.
    """
    ops.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    d, b = meta.num_decode_seqs, meta.num_seqs
    if d in (0, b):
        return _paged(q, k_cache, v_cache, meta, 0, b, scale)
    split = meta.query_starts[d]
    out = torch.empty_like(q)
    out[:split] = _paged(q, k_cache, v_cache, meta, 0, d, scale)
    out[split:] = _paged(q, k_cache, v_cache, meta, d, b, scale)
    return out


def _paged(
    q: torch.Tensor,  # (T, Hq, D)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    first: int,
    last: int,
    scale: float,
) -> torch.Tensor:  # (rows of sequences [first, last), Hq, D)
    """kernels.ops.paged_attention over sequences [first, last), whose rows are contiguous."""
    lo, hi = meta.query_starts[first], meta.query_starts[last]
    return ops.paged_attention(
        q[lo:hi], k_cache, v_cache, meta.cu_seqlens_q[first:last + 1] - lo,
        meta.context_lens[first:last], meta.block_tables[first:last], scale,
    )
