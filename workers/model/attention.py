"""Attention over the paged KV pool, for a flat batch of sequences.

The model sees one flat token batch per step: sequence b owns query rows
`[cu_seqlens_q[b], cu_seqlens_q[b+1])`, and `context_lens[b]` counts its tokens in the
cache after this step's tokens are stored. One call covers prefill, prefill over a
cached prefix, chunked prefill and decode (kernels/contract.py states the contract).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.contract import PagedBatch
from kernels.ops import Kernels


@dataclass(frozen=True)
class AttentionMetadata:
    """What every layer's attention needs of one step, besides the tensors it attends over."""

    batch: PagedBatch  # (B+1,) cu_seqlens_q, (B,) context_lens, (B, max_blocks) block_tables; int32
    slot_mapping: torch.Tensor  # (T,) int64; -1 = do not store
    #: cu_seqlens_q on the host, so slicing needs no device sync.
    query_starts: tuple[int, ...]
    #: The first sequences have one query row each (decodes); prefills follow.
    num_decode_seqs: int
    #: The engine's choice of implementations (EngineConfig.kernels / .attention).
    kernels: Kernels

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
    v_scales: torch.Tensor | None = None,  # (NB, BS, Hkv) fp16: the mixed pool, v_cache int8
) -> torch.Tensor:  # (T, Hq, D)
    """Store this step's K/V in the pool, then attend each query over its sequence's context.

    Decodes and prefills go to separate calls: an implementation that pads queries to
    the batch's longest (kernels.gather_sdpa) would otherwise pad every decode row of a
    mixed batch to the length of its longest prefill chunk.
    """
    kernels = meta.kernels
    kernels.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, v_scales=v_scales)
    d, b = meta.num_decode_seqs, meta.num_seqs
    if d in (0, b):
        return kernels.paged_attention(q, k_cache, v_cache, meta.batch, scale, v_scales=v_scales)
    split = meta.query_starts[d]  # decodes are rows [0, split), prefills [split, T)
    out = torch.empty_like(q)  # (T, Hq, D)
    out[:split] = kernels.paged_attention(q[:split], k_cache, v_cache, meta.batch.seqs(0, d), scale,
                                          v_scales=v_scales)
    out[split:] = kernels.paged_attention(q[split:], k_cache, v_cache, meta.batch.seqs(d, b), scale,
                                          v_scales=v_scales)
    return out
