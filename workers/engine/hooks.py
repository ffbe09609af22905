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
    """Hooks that lend may also have `lend_ahead`, an int: how many blocks the pool
    keeps free or on loan by evicting the least recently used ahead of need (0 when
    absent)."""

    def on_evict(self, block_hash: str, token_ids: tuple[int, ...], parent_hash: str | None,
                 block_id: int) -> bool | None:
        """A free cached block is about to be reused for other tokens: its K/V still sit
        in `block_id`. Copy them out here to keep them, and return a false value: the
        block is reused at once. Or return True to go on reading it from another thread
        (a spill sent straight from the pool, no copy): the pool then lends it, reusing
        it only after `BlockManager.give_back(block_id)`, or after `reclaim` when it has
        nothing else free."""
        ...

    def reclaim(self, block_id: int) -> bool:
        """Only for hooks that lend (on_evict returned True): the pool needs `block_id`
        now. Stop reading it (copy what is still needed, or wait for a read under way)
        and return True: it is the pool's again and must not be given back. False: it
        was given back already."""
        ...

    def on_admit(self, missing: Sequence[MissingBlock]) -> int:
        """A new sequence's full blocks from the first one the pool lacks. Fill
        `missing[:n]` (all layers, K and V) from the outside tier and return n; the
        engine then skips computing those tokens. Only a leading run counts: a filled
        block after an unfilled one is recomputed anyway."""
        ...


class NoBlockHooks:
    """The default: nothing outside the pool."""

    lend_ahead = 0

    def on_evict(self, block_hash: str, token_ids: tuple[int, ...], parent_hash: str | None, block_id: int) -> None:
        return None

    def reclaim(self, block_id: int) -> bool:
        raise AssertionError("NoBlockHooks lends no block")

    def on_admit(self, missing: Sequence[MissingBlock]) -> int:
        return 0
