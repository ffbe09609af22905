"""The contract every KV kernel meets, stated once: the paged layout, a batch's metadata,
and the signatures of the four operations.

The paged KV layout, shared by the engine, the kernels and the cold tier, is one pair
of tensors per layer:

    k_cache, v_cache: (num_blocks NB, block_size BS, num_kv_heads Hkv, head_dim D)

A token's *slot* is `block_id * BS + offset`; a sequence's *block table* lists its
block ids in order. Slot -1 means "do not store" (padding).

kernels/reference.py implements each operation in plain torch, correct first; every
other implementation (Triton, the torch decode path, gather + SDPA) has the same
signature and is tested against it. kernels/ops.py picks one of each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class PagedBatch:
    """B sequences whose new tokens are the T rows of a query, and where their context is.

    Query row i of sequence b sits at position `context_lens[b] - q_len[b] + i` and sees
    the positions <= it: prefill (q_len = context_len), prefill over a cached prefix
    (q_len < context_len) and decode (q_len = 1) are one definition.
    """

    cu_seqlens_q: torch.Tensor  # (B+1,) int: q rows of sequence b are [cu[b], cu[b+1])
    context_lens: torch.Tensor  # (B,) int: tokens in cache per sequence, new ones included
    block_tables: torch.Tensor  # (B, max_blocks) int: each sequence's block ids, in order

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    def seqs(self, first: int, last: int) -> "PagedBatch":
        """Sequences [first, last), their query rows renumbered from 0 (the caller slices q)."""
        cu = self.cu_seqlens_q[first:last + 1]  # (last - first + 1,)
        return PagedBatch(cu - cu[0], self.context_lens[first:last], self.block_tables[first:last])


class PagedAttention(Protocol):
    def __call__(
        self,
        q: torch.Tensor,  # (T, Hq, D): the new tokens of the batch's sequences, concatenated
        k_cache: torch.Tensor,  # (NB, BS, Hkv, D), already holding the new tokens' K
        v_cache: torch.Tensor,  # (NB, BS, Hkv, D), already holding the new tokens' V
        batch: PagedBatch,
        scale: float,  # softmax scale, usually D ** -0.5
    ) -> torch.Tensor:  # (T, Hq, D)
        """Causal attention of each sequence's new tokens over its whole cached context.
        Grouped-query attention: query head h reads KV head h // (Hq // Hkv)."""
        ...


class StoreKVCache(Protocol):
    def __call__(
        self,
        key: torch.Tensor,  # (T, Hkv, D)
        value: torch.Tensor,  # (T, Hkv, D)
        k_cache: torch.Tensor,  # (NB, BS, Hkv, D)
        v_cache: torch.Tensor,  # (NB, BS, Hkv, D)
        slot_mapping: torch.Tensor,  # (T,) int, -1 = skip
    ) -> None:
        """Scatter new K/V rows into the paged pool, in place, cast to the pool's dtype."""
        ...


class QuantizeInt8(Protocol):
    def __call__(
        self,
        x: torch.Tensor,  # (..., D) float
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (..., D) int8, (...,) float32
        """Symmetric INT8 with one fp32 scale per row of D values (per token and head)."""
        ...


class DequantizeInt8(Protocol):
    def __call__(
        self,
        q: torch.Tensor,  # (..., D) int8
        scale: torch.Tensor,  # (...,) float32
        dtype: torch.dtype,
    ) -> torch.Tensor:  # (..., D) dtype
        ...
