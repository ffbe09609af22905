"""Fleet-wide single flight for a shared prompt prefix that is in neither KV tier.

When many jobs with the same long prefix reach several workers at once, each worker
would prefill that prefix itself: the stampede the cold tier exists to prevent. Before a
job runs, `PrefixSharing.prepare()` checks whether its prefix is hot (in this worker's
pool) or cold (in Redis). If neither, exactly one worker of the fleet (the holder of
the prefix's rebuild lock, see kvstore.singleflight) prefills it and writes its blocks to
the cold tier; the others wait for that and then load the blocks through the engine's
admission hook like any cold hit.

Prefixes shorter than `min_blocks` full blocks skip all this: recomputing them costs
less than a lock round trip.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from kvfleet.contracts import Sampling
from kvstore.coldtier import ColdTier, PrefixSource
from workers.engine import Engine

log = logging.getLogger("kvfleet.worker")


class PrefixSharing:
    def __init__(self, engine: Engine, tier: ColdTier, *, min_blocks: int = 4) -> None:
        self.engine = engine
        self.tier = tier
        self.min_blocks = min_blocks

    def prepare(self, job_id: str, prompt: Sequence[int], cache_salt: str | None = None) -> PrefixSource | None:
        """Make the prompt's prefix loadable in its cache namespace; None when there was
        nothing to do. The single flight keys on the namespaced hashes, so it never
        tells a job that another tenant prefilled the same prompt."""
        blocks = self.engine.block_manager
        hashes = blocks.prefix_hashes(prompt, cache_salt)
        if len(hashes) < self.min_blocks:
            return None
        # A hint read off the step thread (see BlockManager.cached_block_ids): if it says
        # hot, the admission will find the blocks (or, if they were evicted just now,
        # recompute them; still correct).
        if len(blocks.cached_block_ids(hashes)) == len(hashes):
            return None
        source = self.tier.ensure_prefix(hashes, lambda: self._prefill_and_store(job_id, prompt, hashes, cache_salt))
        log.info("shared prefix", extra={"job_id": job_id, "blocks": len(hashes), "source": source.value})
        return source

    def _prefill_and_store(self, job_id: str, prompt: Sequence[int], hashes: list[str],
                           cache_salt: str | None) -> None:
        # One token of output is the cheapest request that computes every prompt block.
        self.engine.generate(f"{job_id}/prefix", prompt, 1, Sampling(), cache_salt=cache_salt)
        # Copy on the step thread, where no step can reuse a block mid-copy; write here.
        items = self.engine.call_soon(lambda: self._copy(hashes)).result()
        self.tier.write(items)

    def _copy(self, hashes: list[str]) -> list:
        held = self.engine.block_manager.cached_block_ids(hashes)  # exact here: we are on the step thread
        return self.tier.copy_out(hashes[:len(held)], held)


class PrefixSharingEngine:
    """The engine as the job runner sees it, with the shared-prefix step before each job."""

    def __init__(self, engine: Engine, sharing: PrefixSharing) -> None:
        self.engine = engine
        self.sharing = sharing

    def generate(self, request_id: str, prompt_tokens: Sequence[int], max_new_tokens: int, sampling: Sampling, *,
                 priority_rank: int = 1, stop: tuple[str, ...] = (), on_token: Callable[[int], None] | None = None,
                 cache_salt: str | None = None):
        try:
            self.sharing.prepare(request_id, prompt_tokens, cache_salt)
        except Exception:  # noqa: BLE001 - the cold tier is an optimisation: never fail a job for it
            log.warning("shared-prefix step failed; prefilling locally", extra={"job_id": request_id}, exc_info=True)
        return self.engine.generate(request_id, prompt_tokens, max_new_tokens, sampling,
                                    priority_rank=priority_rank, stop=stop, on_token=on_token, cache_salt=cache_salt)

    def cancel(self, request_id: str) -> bool:
        return self.engine.cancel(request_id)
