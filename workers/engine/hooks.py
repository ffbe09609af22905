"""Where an outside KV tier (the Redis cold tier) plugs into the block pool.

The block manager calls these from the engine's step thread, between model steps, so
the pool's tensors are not being written while a hook reads or fills them. A hook
reaches the tensors through `Engine.kv_cache` (per layer, `(k, v)` each of shape
`(num_blocks, block_size, num_kv_heads, head_dim)`); block `block_id` is
`k[block_id]` / `v[block_id]` in every layer.

A hook must not raise for a tier that is down or a blob that fails validation: a miss
(return 0) or a skipped copy only costs recomputation. An exception fails the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


@dataclass(frozen=True)
class MissingBlock:
    """A full prompt block the pool does not hold, in the order of the sequence."""

    block_hash: str
    parent_hash: str | None  # None for a sequence's first block
    token_ids: tuple[int, ...]
    block_id: int  # the pool block allocated for it; fill it here to skip its prefill


class BlockHooks(Protocol):
    def on_evict(self, block_hash: str, token_ids: tuple[int, ...], parent_hash: str | None, block_id: int) -> None:
        """A free cached block is about to be reused for other tokens: its K/V still sit
        in `block_id` and are gone once this returns. Copy them out here to keep them."""
        ...

    def on_admit(self, missing: Sequence[MissingBlock]) -> int:
        """A new sequence's full blocks from the first one the pool lacks. Fill
        `missing[:n]` (all layers, K and V) from the outside tier and return n; the
        engine then skips computing those tokens. Only a leading run counts: a filled
        block after an unfilled one is recomputed anyway."""
        ...


class NoBlockHooks:
    """The default: nothing outside the pool."""

    def on_evict(self, block_hash: str, token_ids: tuple[int, ...], parent_hash: str | None, block_id: int) -> None:
        return None

    def on_admit(self, missing: Sequence[MissingBlock]) -> int:
        return 0
