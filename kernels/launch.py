"""Small helpers the Triton wrappers share: where a kernel can run, and block sizes."""

from __future__ import annotations

import os

import torch
import triton

MAX_HEAD_DIM = 256  # one head row lives in registers; past 256 that spills


def interpreting() -> bool:
    """True when TRITON_INTERPRET=1: kernels run on CPU tensors, in numpy."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(*tensors: torch.Tensor) -> None:
    """Fail with a message that says what to change, instead of a pointer fault."""
    if interpreting():
        return
    for t in tensors:
        if not t.is_cuda:
            raise ValueError(
                f"Triton kernels need CUDA tensors (got {t.device}); use the torch backend "
                "(KVFLEET_KERNELS=torch) or set TRITON_INTERPRET=1 before importing triton"
            )


def head_block(head_dim: int) -> int:
    """head_dim rounded up to a power of two (tl.arange needs one); the tail is masked.

    At least 16, because tl.dot wants every dimension >= 16.
    """
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
    return max(16, triton.next_power_of_2(head_dim))


def check_mixed_pool(k_cache: torch.Tensor, v_cache: torch.Tensor, v_scales: torch.Tensor) -> None:
    """The mixed pool's layout, which the kernels index without strides of their own:
    int8 V shaped like K, contiguous fp16 scales with one per (block, slot, KV head)."""
    check_device(v_scales)
    if v_cache.dtype != torch.int8 or v_scales.dtype != torch.float16:
        raise ValueError(f"a mixed pool has int8 V and float16 scales, got {v_cache.dtype} and {v_scales.dtype}")
    if not k_cache.is_contiguous() or v_scales.shape != k_cache.shape[:3] or not v_scales.is_contiguous():
        raise ValueError(f"v_scales must be contiguous (NB, BS, Hkv) = {tuple(k_cache.shape[:3])} beside "
                         f"contiguous caches, got {tuple(v_scales.shape)}")
