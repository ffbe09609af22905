"""The KV kernels the engine calls, dispatched to Triton or to the torch reference.

The four functions have the signatures of kernels.reference (the contract). Which code
runs behind them is decided once, at import or on set_backend(), never per call:

    KVFLEET_KERNELS=auto    Triton where it can run: on CUDA tensors when triton imports
                            and a GPU is present, or on any tensor when TRITON_INTERPRET=1;
                            the torch reference for everything else (e.g. CPU tensors
                            of the cold tier on a GPU machine). The default.
    KVFLEET_KERNELS=triton  Triton for every call; ValueError now if it cannot run.
    KVFLEET_KERNELS=torch   The torch reference for every call.

Attention has a second, independent choice (KVFLEET_ATTENTION or set_attention()):
"paged" runs the backend's paged attention, "sdpa" gathers K/V into contiguous memory
and calls torch's scaled_dot_product_attention (kernels.gather_sdpa), on any backend.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import torch

from kernels import gather_sdpa, reference, torch_attention

BACKENDS = ("auto", "triton", "torch")
ATTENTIONS = ("paged", "sdpa")


@dataclass(frozen=True)
class _Impl:
    name: str
    store_kvcache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    quantize_int8: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    dequantize_int8: Callable[..., torch.Tensor]


_TORCH = _Impl(
    "torch",
    reference.store_kvcache,
    torch_attention.paged_attention,  # the reference, with a faster decode path
    reference.quantize_int8,
    reference.dequantize_int8,
)


def _triton_impl() -> _Impl:
    # Imported here, not at the top: importing the kernel modules decorates them with
    # triton.jit, which fixes interpreter-or-GPU for the life of the process.
    from kernels import paged_attention as pa
    from kernels import quant_int8, store_kvcache as sk

    return _Impl(
        "triton", sk.store_kvcache, pa.paged_attention,
        quant_int8.quantize_int8, quant_int8.dequantize_int8,
    )


def _on_cuda(fast: Callable, slow: Callable) -> Callable:
    """fast for CUDA tensors, slow otherwise: auto mode on a GPU machine."""

    def call(x: torch.Tensor, *args, **kwargs):
        return (fast if x.is_cuda else slow)(x, *args, **kwargs)

    return call


def _triton_unavailable() -> str | None:
    """Why Triton cannot run here, or None when it can."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or torch.cuda.is_available():
        return None
    return "no CUDA device and TRITON_INTERPRET is not 1"


def _resolve(name: str) -> _Impl:
    if name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {name!r}")
    if name == "torch":
        return _TORCH
    why = _triton_unavailable()
    if name == "triton":
        if why:
            raise ValueError(f"KVFLEET_KERNELS=triton cannot run here: {why}; use auto or torch")
        return _triton_impl()
    if why:  # auto
        return _TORCH
    tri = _triton_impl()
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return tri  # the interpreter runs CPU tensors too
    return _Impl(
        "triton",
        *(_on_cuda(getattr(tri, f), getattr(_TORCH, f))
          for f in ("store_kvcache", "paged_attention", "quantize_int8", "dequantize_int8")),
    )


def _attention(name: str, impl: _Impl) -> Callable[..., torch.Tensor]:
    if name not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {name!r}")
    return gather_sdpa.paged_attention if name == "sdpa" else impl.paged_attention


_impl: _Impl = _resolve(os.environ.get("KVFLEET_KERNELS", "auto"))
_attention_name: str = os.environ.get("KVFLEET_ATTENTION", "paged")
_attend = _attention(_attention_name, _impl)


def set_backend(name: str) -> None:
    """Switch to "auto", "triton" or "torch"; ValueError if "triton" cannot run here."""
    global _impl, _attend
    _impl = _resolve(name)
    _attend = _attention(_attention_name, _impl)


def backend() -> str:
    """The active backend, "triton" or "torch" (under auto, CPU tensors still use torch)."""
    return _impl.name


def set_attention(name: str) -> None:
    """Switch paged_attention between "paged" (the backend's kernel) and "sdpa"."""
    global _attention_name, _attend
    _attend = _attention(name, _impl)
    _attention_name = name


def attention() -> str:
    """The active attention path, "paged" or "sdpa"."""
    return _attention_name


def store_kvcache(
    key: torch.Tensor,  # (T, Hkv, D)
    value: torch.Tensor,  # (T, Hkv, D)
    k_cache: torch.Tensor,  # (NB, BS, Hkv, D)
    v_cache: torch.Tensor,  # (NB, BS, Hkv, D)
    slot_mapping: torch.Tensor,  # (T,) int, -1 = skip
) -> None:
    """Scatter new K/V rows into the paged pool, in place."""
    _impl.store_kvcache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,  # (T, Hq, D)
    k_cache: torch.Tensor,  # (NB, BS, Hkv, D)
    v_cache: torch.Tensor,  # (NB, BS, Hkv, D)
    cu_seqlens_q: torch.Tensor,  # (B+1,) int
    context_lens: torch.Tensor,  # (B,) int
    block_tables: torch.Tensor,  # (B, max_blocks) int
    scale: float,
) -> torch.Tensor:  # (T, Hq, D)
    """Causal attention of each sequence's new tokens over its cached context."""
    return _attend(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)


def quantize_int8(
    x: torch.Tensor,  # (..., D) float
) -> tuple[torch.Tensor, torch.Tensor]:  # (..., D) int8, (...,) float32
    """Symmetric INT8 with one fp32 scale per row of D values."""
    return _impl.quantize_int8(x)


def dequantize_int8(
    q: torch.Tensor,  # (..., D) int8
    scale: torch.Tensor,  # (...,) float32
    dtype: torch.dtype,
) -> torch.Tensor:  # (..., D) dtype
    return _impl.dequantize_int8(q, scale, dtype)
