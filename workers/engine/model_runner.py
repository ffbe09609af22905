"""The device side of a step: owns the KV pool, turns a ScheduledBatch into tensors,
runs the model and samples one token per sequence that reached the end of its tokens
(with drafts: verifies them, workers/engine/spec.py, and samples after those it keeps)."""

from __future__ import annotations

import torch

from kernels.contract import V_SCALE_DTYPE, PagedBatch
from kernels.ops import Kernels
from workers.engine.scheduler import ScheduledBatch
from workers.engine.sequence import Sequence
from workers.engine.spec import verify
from workers.model.attention import AttentionMetadata
from workers.model.llama import KVCache, VScales
from workers.model.loader import LoadedModel


def kv_bytes_per_block(loaded: LoadedModel, block_size: int, kv_cache_dtype: str = "model") -> int:
    """K and V of every layer for `block_size` tokens (EngineConfig.kv_cache_dtype).

    "model": K and V in the model's dtype. "int8-v": K in the model's dtype, V one
    byte a value plus one fp16 scale per (token, KV head) row (kernels/contract.py):
    at head_dim 32 and a 16-bit model, 64 + 32 + 2 bytes a row against 128.
    """
    c = loaded.config
    k_row = c.head_dim * loaded.dtype.itemsize
    v_row = k_row if kv_cache_dtype == "model" else c.head_dim + V_SCALE_DTYPE.itemsize
    return c.num_hidden_layers * c.num_key_value_heads * (k_row + v_row) * block_size


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, kernels: Kernels, *,
                 kv_cache_dtype: str = "model") -> None:
        self.model = loaded.model
        self.device = loaded.device
        self.block_size = block_size
        self.kernels = kernels
        c = loaded.config
        shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)  # (NB, BS, Hkv, D)
        mixed = kv_cache_dtype == "int8-v"
        v_dtype = torch.int8 if mixed else loaded.dtype
        self.kv_cache: KVCache = [
            (torch.zeros(shape, device=loaded.device, dtype=loaded.dtype),
             torch.zeros(shape, device=loaded.device, dtype=v_dtype))
            for _ in range(c.num_hidden_layers)
        ]
        # The mixed pool: one scale per V row, (NB, BS, Hkv) per layer. Zeros, not
        # garbage, so an unwritten slot's V reads as 0 rather than as NaN or inf.
        self.v_scales: VScales = [
            torch.zeros(shape[:3], device=loaded.device, dtype=V_SCALE_DTYPE) for _ in range(c.num_hidden_layers)
        ] if mixed else None

    def run(self, batch: ScheduledBatch) -> list[list[int]]:
        """The tokens of each sequence: [] for a prefill chunk that stops short of the
        sequence's last token (its logits predict nothing we need), else the drafts the
        model kept and one token of its own (one token when it had no drafts)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        context_lens: list[int] = []
        rows: list[int] = []  # flat rows whose logits are needed: each sampler's last 1 + len(drafts)
        samplers: list[tuple[Sequence, list[int]]] = []
        # Decodes (one new token) first, prefills after: attention takes them in two calls.
        # A sequence with drafts is a short chunk over its cache, like a prefill's.
        order = sorted(zip(batch.seqs, batch.num_new_tokens, batch.drafts), key=lambda item: item[1] != 1)
        for seq, n, drafts in order:
            lo, hi = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids += seq.token_ids[lo:hi - len(drafts)] + drafts
            positions += range(lo, hi)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(lo, hi)]
            starts.append(starts[-1] + n)
            context_lens.append(hi)
            if hi == seq.num_tokens + len(drafts):
                rows += range(starts[-1] - 1 - len(drafts), starts[-1])
                samplers.append((seq, drafts))

        width = max(len(seq.block_table) for seq in batch.seqs)
        # Padding entries are never read (attention stops at context_len); 0 keeps any
        # over-read by a kernel inside the pool.
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq, _, _ in order]
        meta = AttentionMetadata(
            batch=PagedBatch(
                cu_seqlens_q=self._tensor(starts, torch.int32),  # (B+1,)
                context_lens=self._tensor(context_lens, torch.int32),  # (B,)
                block_tables=self._tensor(tables, torch.int32),  # (B, width)
            ),
            slot_mapping=self._tensor(slots, torch.int64),  # (T,)
            query_starts=tuple(starts),
            num_decode_seqs=sum(1 for _, n, _ in order if n == 1),
            kernels=self.kernels,
        )
        with torch.inference_mode():
            hidden = self.model(self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64),
                                meta, self.kv_cache, self.v_scales)  # (T, H)
            out: dict[int, list[int]] = {}
            if samplers:
                logits = self.model.compute_logits(hidden[rows])  # (R, V)
                out = self._sample(logits, samplers)
        return [out.get(id(seq), []) for seq in batch.seqs]

    def _sample(self, logits: torch.Tensor, samplers: list[tuple[Sequence, list[int]]]) -> dict[int, list[int]]:
        """`logits`: (R, V), 1 + len(drafts) consecutive rows per sampler. Keyed by id(seq)."""
        greedy = logits.argmax(dim=-1).tolist()  # one device sync for the whole batch
        host = logits.float().cpu() if any(seq.sampling.temperature > 0 for seq, _ in samplers) else None  # (R, V)
        out: dict[int, list[int]] = {}
        row = 0
        for seq, drafts in samplers:
            m = len(drafts) + 1
            mine = None if host is None or seq.sampling.temperature == 0 else host[row:row + m]  # (m, V)
            out[id(seq)] = verify(drafts, greedy[row:row + m], mine, seq.sampling, seq.generator)
            row += m
        return out

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)
