"""The C decode kernel (kernels/csrc/paged_decode.c): built on first use, called by ctypes.

`paged_attention` is contract.PagedAttention: a decode batch of fp32 CPU tensors goes
to the C kernel, everything else (prefill, other dtypes and devices, the mixed INT8-V
pool, a pool that is not one contiguous tensor) to the torch path
(kernels/torch_attention.py), which gives the same results. kernels/ops.py selects it
(backend "native", and "auto" on a CPU where the kernel builds).

Measured (`python -m bench.engine_step`, builtin:bench, 32 sequences, one core): the
step's attention read K/V at 4.1 GB/s through torch's per-sequence ops against the
core's 14 GB/s copy ceiling; this kernel reads each context once, in order, prefetching
ahead across blocks, and a decode layer takes about 1.1 ms where torch took 1.8, the
whole engine 15% more tokens/s on the static benchmark (docs/engine.md).

Why a C file and not a torch extension: it needs no torch headers, so it builds in well
under a second with the system's `cc` (a torch C++ extension takes about a minute),
and ctypes releases the GIL for the call, so the worker's other threads run while the
engine's attention does.

The library is built once per machine and source into `~/.cache/kvfleet/native` (or
`$KVFLEET_HOME/native`), named by a hash of the source, the compiler, the flags
(`-march=native`: the host's vector units) and the CPU's flags, written to a temporary
name and renamed, so processes that build at once never load a half-written file. A
failed build is logged once and not retried in the process.

C reads what it is given without bounds checks, so `decode` checks the batch first
(block ids inside the pool, contexts inside their tables): a bad batch is a ValueError,
as in torch, never a read outside the pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

from kernels import torch_attention
from kernels.contract import PagedBatch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC")
#: Linked in a second command, without -ffast-math: linked with it, GCC adds
#: crtfastmath.o, whose constructor sets flush-to-zero and denormals-are-zero in the
#: CPU's control register when the library loads, for the whole process (every float
#: op of Python, numpy and torch; a property-based test caught it: 5e-324 * 1.0 gave 0.0).
LINK = ("-shared",)

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_tried = False


def cache_dir() -> Path:
    home = os.environ.get("KVFLEET_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "kvfleet") / "native"


def _compiler() -> Optional[str]:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu() -> str:
    """What -march=native compiles for: a library built for another CPU (a shared home
    directory, a copied cache) could use instructions this one lacks."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {flags}"


def build(out_dir: Optional[Path] = None) -> Path:
    """The shared library's path, compiling it if this machine has not yet. Raises
    RuntimeError (with the compiler's message) when it cannot be built."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH; install one (Debian: apt-get install gcc) "
                           "or run the torch kernels (KVFLEET_KERNELS=torch)")
    try:
        source = SOURCE.read_bytes()
    except OSError as exc:
        raise RuntimeError(f"the kernel's source is missing ({exc}); reinstall kvfleet with its package data "
                           "or run the torch kernels (KVFLEET_KERNELS=torch)") from exc
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    except OSError as exc:
        raise RuntimeError(f"the C compiler {cc!r} cannot be run ({exc}); install one (Debian: apt-get install gcc) "
                           "or run the torch kernels (KVFLEET_KERNELS=torch)") from exc
    key = hashlib.sha256(source + repr((version, FLAGS, LINK, _cpu())).encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    path = out_dir / f"paged_decode-{key}.so"
    if path.exists():
        return path
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        obj = tmp + ".o"
        for argv in ([cc, *FLAGS, "-c", "-o", obj, str(SOURCE)], [cc, *LINK, "-o", tmp, obj, "-lm"]):
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{cc} failed to build {SOURCE.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)  # atomic: a concurrent builder's rename just wins or loses
    finally:
        for leftover in (tmp, tmp + ".o"):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return path


def library() -> Optional[ctypes.CDLL]:
    """The loaded kernel, or None where it cannot be built (logged once a process)."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                _lib = load(build())
            except (OSError, RuntimeError) as exc:
                log.warning("native decode kernel unavailable, using the torch path: %s", exc)
            _tried = True
    return _lib


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    fn = lib.kvfleet_paged_decode_f32
    fn.restype = None
    # q, k_pool, v_pool, tables, W, ctxs, B, Hq, Hkv, D, BS, out, scratch
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 5 + \
        [ctypes.c_void_p] * 2
    return lib


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
                    scale: float, *, v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """contract.PagedAttention: the C kernel where it applies, else kernels.torch_attention."""
    if q.shape[0] == batch.num_seqs:  # one query row per sequence: a decode
        out = decode(q, k_cache, v_cache, batch, scale, v_scales=v_scales)
        if out is not None:
            return out
    return torch_attention.paged_attention(q, k_cache, v_cache, batch, scale, v_scales=v_scales)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch, scale: float, *,
           v_scales: torch.Tensor | None = None) -> torch.Tensor | None:
    """contract.PagedAttention for a decode batch (one query row per sequence), or None
    where this kernel does not apply (see the module docstring)."""
    if q.shape[0] == 0:
        return None
    if v_scales is not None or q.device.type != "cpu" or not (
            q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
            and k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    lib = library()
    if lib is None:
        return None
    b, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    qs = (q * scale).contiguous()  # (B, Hq, D), a new tensor: the caller's q is left as it was
    tables = batch.block_tables.to(torch.int32).contiguous()  # (B, W)
    ctxs = batch.context_lens.to(torch.int32).contiguous()  # (B,)
    (min_ctx, max_ctx), (min_id, max_id) = (tuple(int(x) for x in torch.aminmax(t)) for t in (ctxs, tables))
    if min_ctx < 1 or max_ctx > tables.shape[1] * bs or min_id < 0 or max_id >= k_cache.shape[0]:
        raise ValueError(f"decode batch out of bounds: contexts {min_ctx}..{max_ctx} for tables of "
                         f"{tables.shape[1]} blocks of {bs}, block ids {min_id}..{max_id} in a pool of {k_cache.shape[0]}")
    out = torch.empty_like(qs)
    scratch = torch.empty(hq * max_ctx, dtype=torch.float32)  # (Hq * max ctx,)
    lib.kvfleet_paged_decode_f32(qs.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                                 tables.shape[1], ctxs.data_ptr(), b, hq, hkv, d, bs, out.data_ptr(),
                                 scratch.data_ptr())
    return out
