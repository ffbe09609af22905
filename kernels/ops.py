"""The KV kernels a caller holds: `select(backend, attention)` returns an immutable
`Kernels`, one implementation of each operation of kernels/contract.py.

The choice is made once, by whoever builds the engine (EngineConfig.kernels and
.attention), and travels as an object; nothing here is global or read per call.

    backend "auto"    Triton where it can run: on CUDA tensors when triton imports and
                      a GPU is present, or on any tensor when TRITON_INTERPRET=1; the
                      torch reference for everything else (e.g. CPU tensors of the
                      cold tier on a GPU machine). Without Triton (a CPU machine):
                      "native" where its C kernel builds, else "torch".
    backend "triton"  Triton for every call; ValueError now if it cannot run.
    backend "native"  "torch", with decode attention in C (kernels/native.py): fp32
                      CPU pools; ValueError now if the kernel cannot be built.
    backend "torch"   The torch reference for every call (its attention through
                      kernels/torch_attention.py's faster paths).

    attention "paged" the backend's paged attention.
    attention "sdpa"  gather K/V into contiguous memory and call torch's
                      scaled_dot_product_attention (kernels.gather_sdpa), on any backend.

TRITON_INTERPRET is Triton's own switch (its jit decorator reads it). The only other
environment this package reads is where kernels/native.py keeps its built library
(KVFLEET_HOME, as everything kvfleet builds or downloads, and CC, the compiler).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import torch

from kernels import gather_sdpa, native, reference, torch_attention
from kernels.contract import DequantizeInt8, PagedAttention, QuantizeInt8, StoreKVCache

BACKENDS = ("auto", "triton", "native", "torch")
ATTENTIONS = ("paged", "sdpa")


@dataclass(frozen=True)
class Kernels:
    #: What runs: "triton", "native" or "torch" (under "auto" on a GPU, CPU tensors use torch).
    backend: str
    #: "paged" or "sdpa".
    attention: str
    store_kvcache: StoreKVCache
    paged_attention: PagedAttention
    quantize_int8: QuantizeInt8
    dequantize_int8: DequantizeInt8


def select(backend: str, attention: str) -> Kernels:
    """The kernels for `backend` ("auto", "triton", "native", "torch") and `attention` ("paged", "sdpa").

    ValueError for an unknown name, or for "triton" where Triton cannot run.
    """
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    name, ops = _backend(backend)
    store_kvcache, paged_attention, quantize_int8, dequantize_int8 = ops
    if attention == "sdpa":
        paged_attention = gather_sdpa.paged_attention
    return Kernels(name, attention, store_kvcache, paged_attention, quantize_int8, dequantize_int8)


_TORCH = (
    reference.store_kvcache,
    torch_attention.paged_attention,  # the reference, with a faster decode path
    reference.quantize_int8,
    reference.dequantize_int8,
)


_NATIVE = (reference.store_kvcache, native.paged_attention, reference.quantize_int8, reference.dequantize_int8)


def _backend(name: str) -> tuple[str, tuple[Callable, ...]]:
    if name == "torch":
        return "torch", _TORCH
    if name == "native":
        try:
            native.build()
        except RuntimeError as exc:
            raise ValueError(f"kernel backend 'native' cannot run here: {exc}") from exc
        return "native", _NATIVE
    why = _triton_unavailable()
    if name == "triton":
        if why:
            raise ValueError(f"kernel backend 'triton' cannot run here: {why}; use auto or torch (KVFLEET_KERNELS)")
        return "triton", _triton()
    if why:  # auto, without Triton: the C decode kernel where this machine builds it
        return ("native", _NATIVE) if native.library() is not None else ("torch", _TORCH)
    if _interpreting():
        return "triton", _triton()  # the interpreter runs CPU tensors too
    return "triton", tuple(_on_cuda(fast, slow) for fast, slow in zip(_triton(), _TORCH))


def _triton() -> tuple[Callable, ...]:
    # Imported here, not at the top: importing the kernel modules decorates them with
    # triton.jit, which fixes interpreter-or-GPU for the life of the process.
    from kernels import paged_attention as pa
    from kernels import quant_int8, store_kvcache as sk

    return sk.store_kvcache, pa.paged_attention, quant_int8.quantize_int8, quant_int8.dequantize_int8


def _on_cuda(fast: Callable, slow: Callable) -> Callable:
    """fast for CUDA tensors, slow otherwise: auto mode on a GPU machine."""

    def call(x: torch.Tensor, *args, **kwargs):
        return (fast if x.is_cuda else slow)(x, *args, **kwargs)

    return call


def _interpreting() -> bool:
    # kernels.launch.interpreting() says the same, but importing it imports triton.
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _triton_unavailable() -> str | None:
    """Why Triton cannot run here, or None when it can."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if _interpreting() or torch.cuda.is_available():
        return None
    return "no CUDA device and TRITON_INTERPRET is not 1"
