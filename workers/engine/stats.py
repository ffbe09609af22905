"""What the engine reports about itself: one immutable snapshot, replaced after every step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    blocks_total: int
    blocks_used: int
    blocks_free: int  # empty or holding a free cache entry
    block_size: int
    capacity_tokens: int  # blocks_total * block_size
    tokens_in_use: int  # tokens of the running sequences
    prefix_cache_queries: int  # full prompt blocks looked up
    prefix_cache_hits: int  # ... found in the pool
    outside_cache_hits: int  # ... filled by the admission hook
    prompt_tokens_computed: int  # prefilled by the model (recomputation after preemption included)
    prompt_tokens_cached: int  # served from cache instead
    tokens_computed: int  # every token run through the model
    generated_tokens: int
    preemptions: int
    steps: int
    last_batch_size: int  # sequences in the last step
    max_batch_size: int  # most sequences in one step so far
    step_faults: int = 0  # steps that raised (the model, a hook), in all
    #: Steps that raised in a row, up to now (0 after a good step): a worker whose
    #: engine keeps faulting is unhealthy (workers/health.py).
    consecutive_step_faults: int = 0
    spec_draft_tokens: int = 0  # speculative drafts the model verified (workers/engine/spec.py)
    spec_accepted_tokens: int = 0  # ... and kept
