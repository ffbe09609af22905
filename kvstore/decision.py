"""Load a prefix's blocks from the cold tier, or recompute them: whichever is sooner.

Both costs come from live measurements in this process:

    load(n blocks)      = a + b · n · blob_bytes     a, b fitted on this tier's own fetches
                                                     (round trip + validation, bytes/s)
    recompute(n blocks) = n · block_size / prefill   tokens/s of this worker's prefill:
                                                     the engine's step-cost slope, or a
                                                     setting (KVFLEET_COLD_PREFILL_TOKENS_PER_S)

A fetch that has not been measured yet falls back to a prior bandwidth, and a prefill
rate that is not known yet means "load" (what the tier did before it decided anything).
On a CPU, or for a small model, loading wins by far; an 8B model on a GPU holds about
128 KiB of KV per token and prefills thousands of tokens per second, so over a tier of
about 1 GB/s it recomputes. Decisions are counted in `kvfleet_kv_cold_decisions_total`.
"""

from __future__ import annotations

from typing import Callable, Optional

from kvfleet.linear_fit import LinearFit
from kvstore import metrics

#: Bytes/s assumed before this process measured a fetch: loopback Redis here moves about
#: 0.5 GB/s through redis-py (docs/kvstore.md); the first fetches replace it.
PRIOR_BYTES_PER_S = 0.5e9
PRIOR_OVERHEAD_S = 0.0005


class FetchDecision:
    def __init__(self, *, blob_bytes: int, block_tokens: int,
                 prefill_tokens_per_s: Callable[[], Optional[float]]) -> None:
        self.blob_bytes = blob_bytes
        self.block_tokens = block_tokens
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self._fetches = LinearFit(half_life=64, min_samples=4)

    def observe_fetch(self, nbytes: int, seconds: float) -> None:
        self._fetches.observe(nbytes, seconds)

    def load_seconds(self, blocks: int) -> float:
        fit = self._fetches.fit()
        a, b = fit if fit is not None and fit[1] > 0 else (PRIOR_OVERHEAD_S, 1.0 / PRIOR_BYTES_PER_S)
        return max(0.0, a) + b * blocks * self.blob_bytes

    def recompute_seconds(self, blocks: int) -> Optional[float]:
        rate = self.prefill_tokens_per_s()
        return None if not rate or rate <= 0 else blocks * self.block_tokens / rate

    def should_load(self, blocks: int) -> bool:
        load = self.prefers_load(blocks)
        metrics.KV_DECISIONS.labels("load" if load else "recompute").inc()
        return load

    def prefers_load(self, blocks: int) -> bool:
        """`should_load`'s answer, uncounted (a caller that counts the decision later)."""
        recompute = self.recompute_seconds(blocks)
        return recompute is None or self.load_seconds(blocks) <= recompute
