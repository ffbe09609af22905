"""The contract every KV kernel meets, stated once: the paged layout, a batch's metadata,
and the signatures of the four operations.

The paged KV layout, shared by the engine, the kernels and the cold tier, is one pair
of tensors per layer:

    k_cache, v_cache: (num_blocks NB, block_size BS, num_kv_heads Hkv, head_dim D)

A token's *slot* is `block_id * BS + offset`; a sequence's *block table* lists its
block ids in order. Slot -1 means "do not store" (padding).

The mixed pool (FP16-K / INT8-V, EngineConfig.kv_cache_dtype "int8-v") keeps K as
above and V as int8 of the same shape, with one scale per (token, KV head) row:

    v_cache: (NB, BS, Hkv, D) int8,  v_scales: (NB, BS, Hkv) float16

A row is quantized when it is stored (symmetric: `v = q * scale`, see
`V_SCALE_MIN`), so appending a token never touches its block's other rows. The
16-bit scale costs 2 bytes per D values; at D = 32 an fp32 one would eat a third of
what INT8 saves.

kernels/reference.py implements each operation in plain torch, correct first; every
other implementation (Triton, the torch decode path, gather + SDPA) has the same
signature and is tested against it. kernels/ops.py picks one of each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

#: The dtype of the mixed pool's V scales: 16 bits a row (see the module docstring).
V_SCALE_DTYPE = torch.float16
#: Smallest V scale: fp16's smallest normal. Below it fp16 goes subnormal and a rounded
#: scale could be far from absmax / 127; a row whose absmax is under 127 * 2**-14
#: (0.0078) is quantized in steps of 2**-14 instead, an absolute error <= 3.1e-5.
V_SCALE_MIN = 2.0 ** -14


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
        *,
        v_scales: torch.Tensor | None = None,  # (NB, BS, Hkv) V_SCALE_DTYPE: v_cache is int8
    ) -> torch.Tensor:  # (T, Hq, D)
        """Causal attention of each sequence's new tokens over its whole cached context.
        Grouped-query attention: query head h reads KV head h // (Hq // Hkv).
        With `v_scales`, V is read as `v_cache * v_scales` (the mixed pool)."""
        ...


class StoreKVCache(Protocol):
    def __call__(
        self,
        key: torch.Tensor,  # (T, Hkv, D)
        value: torch.Tensor,  # (T, Hkv, D)
        k_cache: torch.Tensor,  # (NB, BS, Hkv, D)
        v_cache: torch.Tensor,  # (NB, BS, Hkv, D)
        slot_mapping: torch.Tensor,  # (T,) int, -1 = skip
        *,
        v_scales: torch.Tensor | None = None,  # (NB, BS, Hkv) V_SCALE_DTYPE: v_cache is int8
    ) -> None:
        """Scatter new K/V rows into the paged pool, in place, cast to the pool's dtype.
        With `v_scales` (the mixed pool), each V row is quantized as
        reference.quantize_v_row does: q into v_cache, its scale into v_scales."""
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
