"""The strongest fair baselines for paged attention: what a user without kvfleet's kernel
would pick. bench/kernels.py times them beside the Triton kernel; tests/test_bench_kernels.py
checks them against kernels.reference.paged_attention.

- `sdpa_contiguous`: torch's scaled_dot_product_attention over K/V that are already
  contiguous per sequence, `(B, Hkv, L, D)`: the layout of a cache that is not paged, so
  the gather happens here, once, outside the call that is timed. Decode (one query per
  sequence, at its last position) needs no mask: that query sees every key. Prefill over a
  cached prefix is bottom-right causal, `torch.nn.attention.bias.causal_lower_right`,
  which SDPA runs in its flash or memory-efficient kernel where they accept the inputs
  rather than as a materialised boolean mask (which rules out flash).
- `flex_paged`: `torch.nn.attention.flex_attention` reading the paged pool in place. K/V
  are the whole pool viewed as one sequence `(1, Hkv, NB*BS, D)` that every sequence of
  the batch shares; a block mask whose KV blocks are the pool's pages gives each sequence
  its own pages, and its mask_mod maps a physical slot to the sequence's logical
  position for causality. Nothing is copied.

Both need every sequence of a batch to have the same number of new tokens (queries are
`(B, Hq, q_len, D)`, no padding); `sdpa_contiguous` also needs equal contexts (K/V are
`(B, Hkv, L, D)`). bench/kernels.py's shapes are like that. Each `prepare` does its set-up
(the gather, the block mask) and returns a `Prepared`: one or more candidate calls, each
returning `(T, Hq, D)` like contract.PagedAttention, and what they run.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F

from kernels import reference
from kernels.contract import PagedBatch

@dataclass(frozen=True)
class Candidate:
    call: Callable[[], torch.Tensor]  # returns (T, Hq, D)
    # Entered once around the check and the timing, not per call: an SDPA backend choice
    # costs a context manager's Python per call that a user who sets it once does not pay.
    scope: Callable[[], ContextManager] = contextlib.nullcontext


@dataclass(frozen=True)
class Prepared:
    """Candidate calls for one baseline on one batch; the bench keeps the fastest."""

    candidates: dict[str, Candidate]
    note: str  # what the candidates are, for the bench's row
    skipped: dict[str, str] = field(default_factory=dict)  # candidate name -> why it cannot run here


def _equal(values: torch.Tensor, what: str) -> int:
    first = int(values[0])
    if not bool((values == first).all()):
        raise ValueError(f"{what} differ across the batch: this baseline needs them equal (no padding)")
    return first


def _q_len(q: torch.Tensor, batch: PagedBatch) -> int:
    q_len = _equal(batch.cu_seqlens_q[1:] - batch.cu_seqlens_q[:-1], "query lengths")
    if q_len * batch.num_seqs != q.shape[0]:
        raise ValueError(f"q has {q.shape[0]} rows for {batch.num_seqs} sequences of {q_len} new tokens")
    return q_len


def gather_contiguous(cache: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
    """Each sequence's context out of the pool, `(B, Hkv, L, D)` contiguous (equal contexts)."""
    ctx = _equal(batch.context_lens, "context lengths")
    per_seq = [reference.gather_kv(cache, table, ctx) for table in batch.block_tables]  # (L, Hkv, D) each
    return torch.stack(per_seq).transpose(1, 2).contiguous()  # (B, Hkv, L, D)


def _sdpa_backends() -> dict[str, object]:
    from torch.nn.attention import SDPBackend

    names = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
    return {n.lower().removesuffix("_attention"): getattr(SDPBackend, n) for n in names if hasattr(SDPBackend, n)}


def sdpa_contiguous(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
                    scale: float) -> Prepared:
    """SDPA over contiguous K/V: for decode each SDPA backend that runs, for prefill over a
    prefix `causal_lower_right` with `enable_gqa` and with K/V heads repeated."""
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    b, group = batch.num_seqs, hq // hkv
    q_len = _q_len(q, batch)
    k = gather_contiguous(k_cache, batch)  # (B, Hkv, L, D)
    v = gather_contiguous(v_cache, batch)  # (B, Hkv, L, D)
    ctx = k.shape[2]
    candidates: dict[str, Call] = {}
    skipped: dict[str, str] = {}

    if q_len == 1:
        from torch.nn.attention import sdpa_kernel

        # Query head h reads KV head h // G, so the G heads of a KV head are G query rows
        # of it: exact without a mask, and each K/V row is read once per KV head, not G times.
        qg = q.view(b, hkv, group, d)  # (B, Hq, D) -> (B, Hkv, G, D)

        def decode() -> torch.Tensor:
            o = F.scaled_dot_product_attention(qg, k, v, scale=scale)  # (B, Hkv, G, D)
            # reshape, not view: flash returns (B, G, Hkv, D) memory transposed.
            return o.reshape(t, hq, d)  # (B, Hkv, G, D) -> (T = B, Hq, D)

        for name, backend in _sdpa_backends().items():
            scope = functools.partial(sdpa_kernel, [backend])
            try:
                with scope():
                    decode()  # a backend that cannot take these inputs raises here
            except Exception as e:  # noqa: BLE001 - a backend that cannot run is a skip, said why
                skipped[name] = str(e).split(". ")[0][:100]
                continue
            candidates[name] = Candidate(decode, scope)
        note = "K/V contiguous (gathered outside the timed call); decode, no mask, GQA heads as query rows"
        return Prepared(candidates, note, skipped)

    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(q_len, ctx)  # query i sits at ctx - q_len + i
    qb = q.view(b, q_len, hq, d).transpose(1, 2)  # (T, Hq, D) -> (B, Hq, q_len, D)

    def prefill(kk: torch.Tensor, vv: torch.Tensor, gqa: bool) -> torch.Tensor:
        o = F.scaled_dot_product_attention(qb, kk, vv, attn_mask=bias, scale=scale, enable_gqa=gqa)  # (B, Hq, q_len, D)
        return o.transpose(1, 2).reshape(t, hq, d)  # (B, q_len, Hq, D) -> (T, Hq, D)

    # A contiguous cache with Hq heads (a user who repeats K/V heads once, outside the
    # call) lets the memory-efficient kernel run, which takes no enable_gqa; it reads G
    # times the K/V bytes the row's GB/s counts.
    kr, vr = (x.repeat_interleave(group, dim=1) for x in (k, v))  # (B, Hq, L, D)
    for name, args in (("gqa", (k, v, hq != hkv)), ("heads-repeated", (kr, vr, False))):
        if name == "heads-repeated" and hq == hkv:
            continue
        try:
            prefill(*args)
        except Exception as e:  # noqa: BLE001 - a variant that cannot run is a skip, said why
            skipped[name] = str(e).split(". ")[0][:100]
            continue
        candidates[name] = Candidate(functools.partial(prefill, *args))
    note = (f"K/V contiguous (gathered outside the timed call); causal_lower_right, "
            f"{_causal_backend(qb, k, v, hq != hkv)}")
    return Prepared(candidates, note, skipped)


def _causal_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> str:
    """Which kernel causal_lower_right's dispatch picks for enable_gqa inputs (it tries flash,
    then memory-efficient, then materialises the mask), as torch decides it."""
    if not q.is_cuda:
        return "a materialised mask on CPU (flash and efficient are CUDA checks)"
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    try:
        params = SDPAParams(q, k, v, None, 0.0, False, gqa)
    except TypeError:  # an older torch without enable_gqa in SDPAParams
        params = SDPAParams(q, k, v, None, 0.0, False)
    if can_use_flash_attention(params):
        return "gqa: flash"
    if can_use_efficient_attention(params):
        return "gqa: memory-efficient"
    return "gqa: a materialised mask"


def flex_available() -> str | None:
    """None when torch has flex_attention, else why not."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__} has no flex_attention ({e})"
    return None


@functools.cache
def _compiled_flex() -> Callable:
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    # One compilation per shape, and no more than that: dynamic=False keeps batch and heads
    # static, which flex's decode kernel needs (a dynamic batch falls back to the general
    # kernel); past dynamo's recompile limit it would run the unfused eager path silently,
    # so the limit is raised for the bench's shapes and hitting it is an error.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    return torch.compile(flex_attention, dynamic=False)


def physical_to_logical(batch: PagedBatch, num_blocks: int, block_size: int) -> torch.Tensor:
    """`(B, NB)` int32: page p's index in sequence b's block table, -1 where b does not own p.

    Only the pages that hold a sequence's context count: a table's stale or padding
    entries past them must not claim a page another sequence owns."""
    b, width = batch.block_tables.shape
    dev = batch.block_tables.device
    used = (batch.context_lens.long() + block_size - 1) // block_size  # (B,)
    logical = torch.arange(width, device=dev).expand(b, width)  # (B, width)
    # Unused entries are sent to a spare column NB, dropped afterwards.
    pages = torch.where(logical < used[:, None], batch.block_tables.long(), num_blocks)  # (B, width)
    out = torch.full((b, num_blocks + 1), -1, dtype=torch.int32, device=dev)
    out.scatter_(1, pages, logical.to(torch.int32))
    return out[:, :num_blocks]  # (B, NB)


def flex_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
               scale: float, *, compiled: bool = True) -> Prepared:
    """flex_attention over the pool in place, one block mask of the pool's pages.

    `compiled=False` runs flex's eager path, which materialises the scores over the whole
    pool: for checking on small shapes, not for timing."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    t, hq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    b = batch.num_seqs
    q_len = _q_len(q, batch)
    p2l = physical_to_logical(batch, nb, bs)  # (B, NB)
    start = (batch.context_lens - q_len).to(torch.int32)  # (B,): position of each sequence's first query

    def mask_mod(bi, h, q_idx, kv_idx):
        logical = p2l[bi, kv_idx // bs]  # the page's place in sequence bi, or -1
        pos = logical * bs + kv_idx % bs  # the key's position in sequence bi
        return (logical >= 0) & (pos <= start[bi] + q_idx)

    # KV blocks of one page each, so a sequence's blocks are exactly its pages; one mask
    # for every head (H=None), which flex's GQA decode kernel requires.
    block_mask = create_block_mask(mask_mod, b, None, q_len, nb * bs, device=q.device, BLOCK_SIZE=(128, bs))
    kp = k_cache.view(1, nb * bs, hkv, d).transpose(1, 2)  # (NB, BS, Hkv, D) -> (1, Hkv, NB*BS, D), a view
    vp = v_cache.view(1, nb * bs, hkv, d).transpose(1, 2)  # (1, Hkv, NB*BS, D)
    qb = q.view(b, q_len, hq, d).transpose(1, 2)  # (T, Hq, D) -> (B, Hq, q_len, D)
    flex = _compiled_flex() if compiled else flex_attention

    def call() -> torch.Tensor:
        o = flex(qb, kp, vp, block_mask=block_mask, scale=scale, enable_gqa=hq != hkv)  # (B, Hq, q_len, D)
        return o.transpose(1, 2).reshape(t, hq, d)  # (B, q_len, Hq, D) -> (T, Hq, D)

    mode = "compiled" if compiled else "eager (unfused: scores over the whole pool)"
    note = (f"paged: the pool read in place, a block mask of {bs}-token pages (so KV tiles of {bs}), "
            f"built outside the timed call; {mode}")
    return Prepared({"compiled" if compiled else "eager": Candidate(call)}, note)
