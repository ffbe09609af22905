"""The cold tier as the engine's block hooks (workers.engine.hooks.BlockHooks).

    from kvstore.coldtier import ColdTier, connect

    hooks = ColdTierHooks()
    engine = Engine(..., hooks=hooks)  # the engine takes its hooks first, and owns the pool after
    hooks.tier = ColdTier(connect(settings.redis.cache_url), settings.redis.keys,
                          engine.block_manager.fingerprint, engine.kv_cache,
                          kernels=engine.kernels, ...)  # the rest: settings.cold_tier (workers/service.py)
    hooks.give_back = engine.block_manager.give_back  # spills then go straight from the pool
    ...
    hooks.tier.close()                 # at shutdown: drains the spill queue

The hooks run on the engine's step thread between model steps, so the pool is not
being written while they copy. With `give_back` set, an evicted block of a pool the
tier can send as it is (`ColdTier.can_lend`) is lent to the spill instead of copied,
and the engine reuses it once it is written. Neither raises for a tier that is down: a spill that
cannot be made is dropped and counted, a load that fails is a miss (0), and the engine
recomputes. kvstore does not import workers: the hooks are matched by shape.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Protocol, Sequence

import redis

from kvstore.coldtier import ColdTier

log = logging.getLogger(__name__)


class MissingBlockLike(Protocol):
    """What on_admit reads of workers.engine.hooks.MissingBlock."""

    block_hash: str
    block_id: int  # already allocated by the engine for this block


class ColdTierHooks:
    def __init__(self, tier: Optional[ColdTier] = None, *, prefetch_only: bool = False) -> None:
        #: None until the pool exists (see the module docstring): the hooks then do nothing.
        self.tier = tier
        #: Load nothing at admission: every job's task thread fetched its cold prefix
        #: into blocks the engine adopted before (ColdTier.fetch_into, workers/prefix.py),
        #: so the step thread never waits on Redis. The worker sets it.
        self.prefetch_only = prefetch_only
        #: The engine's BlockManager.give_back: set it to lend evicted blocks to spills.
        self.give_back: Optional[Callable[[int], None]] = None

    def on_evict(self, block_hash: str, token_ids: tuple[int, ...], parent_hash: Optional[str], block_id: int) -> bool:
        # token_ids and parent_hash are already folded into the chained block_hash,
        # which is all the cold tier keys on.
        if self.tier is None:
            return False
        if self.give_back is not None and self.tier.can_lend:
            return self.tier.lend(block_hash, block_id, self.give_back)  # sent from the pool, then given back
        self.tier.spill(block_hash, block_id)  # copies now, writes on the spill thread
        return False

    def reclaim(self, block_id: int) -> bool:
        return self.tier.reclaim(block_id)

    @property
    def lend_ahead(self) -> int:
        """Evicted blocks to keep on loan ahead of need: what the spill writers send at once."""
        lends = self.tier is not None and self.give_back is not None and self.tier.can_lend
        return self.tier.spill_in_flight if lends else 0

    def on_admit(self, missing: Sequence[MissingBlockLike]) -> int:
        if self.tier is None or self.prefetch_only:
            return 0
        hashes, block_ids = [m.block_hash for m in missing], (lambda n: [m.block_id for m in missing[:n]])
        try:
            return self.tier.load(hashes, block_ids)
        except redis.RedisError:
            log.warning("cold tier unavailable; prefilling instead", exc_info=True)
            return 0
