"""The engine's knobs, checked once when built."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    #: Tokens per KV block: the unit of allocation, sharing and cold-tier transfer.
    #: 16 keeps the waste of a half-filled last block small and a block's copy worth
    #: a round trip. A power of two, as the Triton kernels index blocks with shifts.
    block_size: int = 16
    #: KV pool size in blocks. When None, as many blocks as fit in `kv_memory_bytes`.
    num_blocks: int | None = None
    #: Memory for the KV pool (K and V of every layer), bytes.
    kv_memory_bytes: int = 256 * 2**20
    #: Sequences holding blocks at once: the largest decode batch.
    max_num_seqs: int = 64
    #: Tokens computed per step, prefill and decode together. Bounds one step's
    #: latency (a long prompt is prefilled in chunks of this) and its activation memory.
    max_num_batched_tokens: int = 2048
    #: Longest prompt + output, tokens. None: the model's context.
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (or None to size the pool by kv_memory_bytes), got {self.num_blocks}")
        for name in ("kv_memory_bytes", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (one prompt and one new token), got {self.max_model_len}")
