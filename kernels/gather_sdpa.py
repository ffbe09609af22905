"""Paged attention the other way round: gather K/V into contiguous memory, then SDPA.

contract.PagedAttention, as kernels.reference.paged_attention. It copies every sequence's context
out of the pool (what reference.gather_kv does, batched and padded to the longest
context) and hands one batched call to torch's scaled_dot_product_attention,
which brings its own tuned kernels. The copy costs a read and a write of the whole
context; on shapes where SDPA's kernels beat the paged kernel by more than that, this
path wins. bench/kernels.py measures where.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.contract import PagedBatch


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
                    scale: float, *, v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """contract.PagedAttention, through one padded, batched SDPA call."""
    t, hq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    cu_seqlens_q, context_lens, block_tables = batch.cu_seqlens_q, batch.context_lens, batch.block_tables
    b = batch.num_seqs
    if t == 0 or b == 0:
        return torch.empty_like(q)
    dev = q.device
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()  # (B,)
    ctx = context_lens.long()  # (B,)
    # One host sync for the padded sizes.
    max_q, max_ctx = (int(x) for x in torch.stack([q_lens.max(), ctx.max()]).tolist())
    # Gather: every key position -> its slot, then (B, L, Hkv, D) contiguous K and V.
    # Positions past a sequence's context read position 0's slot instead of the tail of
    # the last page: that tail may be uninitialised (NaN), and a masked NaN still
    # poisons the softmax. The clamp keeps a stale table of an empty sequence in range.
    pos = torch.arange(max_ctx, device=dev)  # (L,)
    pos = torch.where(pos[None, :] < ctx[:, None], pos[None, :], 0)  # (B, L)
    blocks = block_tables.long().gather(1, pos // bs).clamp(0, nb - 1)  # (B, L)
    slots = blocks * bs + pos % bs  # (B, L)
    k = k_cache.view(nb * bs, hkv, d)[slots].transpose(1, 2)  # (B, Hkv, L, D)
    v = v_cache.view(nb * bs, hkv, d)[slots]  # (B, L, Hkv, D)
    if v_scales is not None:  # the mixed pool: int8 rows times their scales, in q's dtype for SDPA
        v = (v.float() * v_scales.view(nb * bs, hkv)[slots].float().unsqueeze(-1)).to(q.dtype)  # (B, L, Hkv, D)
    v = v.transpose(1, 2)  # (B, Hkv, L, D)

    # Scatter the packed queries into a padded batch: token j of sequence s -> [s, j].
    seq = torch.repeat_interleave(torch.arange(b, device=dev), q_lens, output_size=t)  # (T,)
    row = torch.arange(t, device=dev) - cu_seqlens_q.long()[seq]  # (T,)
    q_pad = q.new_zeros(b, max_q, hq, d)  # (B, max_q, Hq, D)
    q_pad[seq, row] = q
    q_pad = q_pad.transpose(1, 2)  # (B, Hq, max_q, D)

    # Query i of sequence s sits at position ctx - q_len + i and sees keys <= it
    # (bottom-right causal). Padded query rows see key 0 so their softmax is not NaN.
    q_pos = ctx[:, None] - q_lens[:, None] + torch.arange(max_q, device=dev)  # (B, max_q)
    k_pos = torch.arange(max_ctx, device=dev)  # (L,)
    mask = k_pos[None, None, :] <= q_pos[:, :, None].clamp_min(0)  # (B, max_q, L)
    o = F.scaled_dot_product_attention(
        q_pad, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=hq != hkv
    )  # (B, Hq, max_q, D)
    return o.transpose(1, 2)[seq, row]  # (T, Hq, D)
