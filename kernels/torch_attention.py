"""The torch backend's paged attention: faster paths than the reference, same contract.

decode: a step with one query row per sequence, most of an engine's steps. The
reference expands K/V to every query head (`repeat_interleave`) and builds a causal
mask; for one query row neither is needed. Each sequence's query heads are grouped by
the KV head they read, `(Hkv, G, D)`, so one batched matmul per sequence covers all
heads without copying K/V G times, and its blocks are copied out of the pool with
`index_select`. A loop over sequences, not one padded batch: a sequence's K/V (a few
hundred KB) stay in the core's cache between the copy and the two matmuls, where a
padded batch of all of them (tens of MB, more than half of it padding at mixed
lengths) went to memory and back; every padded or chunked variant tried measured slower.

prefill: any other batch, one sequence at a time through torch's SDPA (its CPU kernel
reads grouped K/V as they are and skips the masked half of a causal prompt).

Measured on one shared CPU core (builtin:bench's heads: 8 query / 2 KV, head_dim 64;
min of 40 calls, load 3-5): decode of 32 sequences, contexts 17-512, 4.2 ms per layer
for the reference-style loop this replaced, 2.3 ms here; prefill of 13 whole prompts
of 16-256 tokens, 27.7 ms per layer for the reference, 17.8 ms here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.contract import PagedBatch


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
                    scale: float, *, v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """contract.PagedAttention: `decode` when every sequence has one query row, else `prefill`."""
    if q.shape[0] != batch.num_seqs:  # some sequence has several query rows: a prefill
        return prefill(q, k_cache, v_cache, batch, scale, v_scales=v_scales)
    return decode(q, k_cache, v_cache, batch, scale, v_scales=v_scales)


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
            scale: float, *, v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """contract.PagedAttention for any batch, one sequence at a time through torch's SDPA.

    Where the reference expands K/V to every query head and masks a full score matrix,
    SDPA's CPU kernel reads the grouped K/V as they are (`enable_gqa`) and skips the
    masked half of a causal prefill. The mask is needed only for a chunk over a cached
    prefix (1 < q_len < ctx: bottom-right causal); a whole prompt is `is_causal` (then
    top-left and bottom-right agree), and one query row sees its whole context.
    """
    hq, d = q.shape[1:]
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)  # (T, Hq, D)
    cu = batch.cu_seqlens_q.tolist()
    tables = batch.block_tables.long()  # (B, max_blocks)
    for b, ctx in enumerate(batch.context_lens.tolist()):
        lo, hi = cu[b], cu[b + 1]
        q_len = hi - lo
        if q_len == 0:
            continue
        ids = tables[b, :(ctx + bs - 1) // bs]
        k = k_cache.index_select(0, ids).view(-1, hkv, d)[:ctx].float()  # (n_blocks, BS, Hkv, D) -> (ctx, Hkv, D)
        v = v_cache.index_select(0, ids).view(-1, hkv, d)[:ctx].float()  # (ctx, Hkv, D)
        if v_scales is not None:  # the mixed pool: int8 rows times their scales
            v = v * v_scales.index_select(0, ids).view(-1, hkv, 1)[:ctx].float()  # (ctx, Hkv, D) * (ctx, Hkv, 1)
        mask = None
        if 1 < q_len < ctx:  # query i sits at position ctx - q_len + i and sees keys <= it
            mask = torch.ones(q_len, ctx, dtype=torch.bool, device=q.device).tril(ctx - q_len)  # (q_len, ctx)
        o = F.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1).float(), k.transpose(0, 1), v.transpose(0, 1),  # (Hq, q_len, D), (Hkv, ctx, D) x2
            attn_mask=mask, is_causal=1 < q_len == ctx, scale=scale, enable_gqa=hq != hkv,
        )  # (Hq, q_len, D)
        out[lo:hi] = o.transpose(0, 1).to(q.dtype)  # (q_len, Hq, D)
    return out


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
           scale: float, *, v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """contract.PagedAttention for a batch of one query row per sequence (B = T), at its last position.

    What a sequence costs here is mostly per-op overhead and reading its context (the
    copy itself is cheap: reading runs of blocks in place measured no faster in the
    engine, docs/engine.md), so the loop body is kept to the few ops that need its own sizes: the
    conversions, the scale and the table slicing are done once for the batch, and
    `index_select` gathers the blocks (a plain copy of whole blocks; advanced indexing,
    `k_cache[blocks]`, is about three times slower on the CPU).
    """
    hq, d = q.shape[1:]
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    ctxs = batch.context_lens.tolist()
    n_blocks = [(ctx + bs - 1) // bs for ctx in ctxs]
    # Each sequence's block ids as a view of its table row (unbind: one op for all rows;
    # a boolean mask and a split cost more than the views at small batches).
    tables = batch.block_tables.long()  # (B, max_blocks)
    blocks = [row[:n] for row, n in zip(tables.unbind(0), n_blocks)]  # [(n_blocks,)]
    # The scale folded into q once: (B, Hq, D) -> (B, Hkv, G, D), the heads that share a KV head together.
    qg = (q.float() * scale).view(-1, hkv, group, d)
    out = torch.empty(qg.shape, dtype=torch.float32, device=q.device)  # (B, Hkv, G, D)
    cast = k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32
    for ctx, ids, q_b, out_b in zip(ctxs, blocks, qg.unbind(0), out.unbind(0)):
        k = k_cache.index_select(0, ids)  # (n_blocks, BS, Hkv, D), contiguous: token t, head h at t*Hkv*D + h*D
        v = v_cache.index_select(0, ids)
        # The first ctx tokens, heads first, as views (one op each, where view, slice and
        # permute were three): K^T (Hkv, D, ctx) and V (Hkv, ctx, D).
        k = k.as_strided((hkv, d, ctx), (d, 1, hkv * d))
        v = v.as_strided((hkv, ctx, d), (d, hkv * d, 1))
        if cast:
            k, v = k.float(), v.float()
        if v_scales is not None:  # the mixed pool: int8 rows times their scales, (NB, BS, Hkv) -> (Hkv, ctx, 1)
            v = v * v_scales.index_select(0, ids).as_strided((hkv, ctx, 1), (1, hkv, 0)).float()
        # The only query is the last position, so every cached token is visible: no mask.
        probs = torch.softmax(torch.bmm(q_b, k), dim=-1)  # (Hkv, G, D) @ (Hkv, D, ctx) -> (Hkv, G, ctx)
        torch.bmm(probs, v, out=out_b)  # (Hkv, G, ctx) @ (Hkv, ctx, D) -> (Hkv, G, D)
    return out.view(-1, hq, d).to(q.dtype)  # (B, Hq, D)
