"""Triton scatter of new K/V rows into the paged pool (contract.StoreKVCache).

One program writes one (token, kv head) row of D values to both caches: a row is the
unit the slot mapping addresses, and at D <= 256 it is one small vector load/store,
so there is nothing to tile.

The mixed pool (V_INT8): the program quantizes its V row as it stores it, one 16-bit
scale per row (kernels.reference.quantize_v_row, bit for bit), so no block's other
rows are read or rewritten when a token is appended.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.contract import V_SCALE_MIN
from kernels.launch import check_device, check_mixed_pool, head_block
from kernels.quant_int8 import INV_127, round_half_even


@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    v_scale_ptr,  # (NB, BS, Hkv) contiguous, fp16; unused unless V_INT8
    stride_kt, stride_kh,  # key (T, Hkv, D), last dim contiguous
    stride_vt, stride_vh,  # value (T, Hkv, D), last dim contiguous
    stride_cb, stride_cs, stride_ch,  # caches (NB, BS, Hkv, D), last dim contiguous
    block_size, head_dim,
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of two; the tail is masked
    V_INT8: tl.constexpr,  # the mixed pool: quantize V into int8 rows and their scales
    SCALE_MIN: tl.constexpr,  # contract.V_SCALE_MIN
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    # int64: slot * row stride passes 2**31 elements in a pool of a few GiB.
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)  # (D,)
    # Slot -1 is padding: the whole row is masked off (a row length of 0) rather than
    # branched around.
    mask = d < tl.where(slot >= 0, head_dim, 0)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + h * stride_ch + d  # (D,)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    if V_INT8:
        vf = v.to(tl.float32)
        # Masked lanes loaded 0, so they never raise the absmax. The scale is rounded
        # to fp16 first and the row divided by the rounded value, as the reference does.
        scale = tl.maximum(tl.max(tl.abs(vf), axis=0) * INV_127, SCALE_MIN).to(tl.float16)
        y = tl.math.div_rn(vf, scale.to(tl.float32))  # (D,)
        q = tl.minimum(tl.maximum(round_half_even(y), -127.0), 127.0)
        tl.store(v_cache_ptr + dst, q.to(tl.int8), mask=mask)
        row = slot * tl.num_programs(1) + h  # scales (NB * BS, Hkv), contiguous: one per (slot, KV head)
        tl.store(v_scale_ptr + row, scale, mask=slot >= 0)
    else:
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, *, v_scales: torch.Tensor | None = None) -> None:
    """contract.StoreKVCache."""
    check_device(key, value, k_cache, v_cache, slot_mapping)
    t, hkv, d = key.shape  # (T, Hkv, D)
    if t == 0:
        return
    if k_cache.stride() != v_cache.stride():
        raise ValueError("store_kvcache: k_cache and v_cache must share one layout")
    # Rows may be views into a fused qkv tensor (strided tokens and heads); only the
    # D values of one row must be contiguous for the vector load.
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    if k_cache.stride(-1) != 1:
        raise ValueError("store_kvcache: the caches' head_dim must be contiguous")
    if v_scales is not None:
        check_mixed_pool(k_cache, v_cache, v_scales)
    _store_kvcache_kernel[(t, hkv)](
        key, value, k_cache, v_cache, slot_mapping.contiguous(),
        v_cache if v_scales is None else v_scales,  # a placeholder pointer without scales
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], d,
        BLOCK_D=head_block(d), V_INT8=v_scales is not None, SCALE_MIN=V_SCALE_MIN,
    )

