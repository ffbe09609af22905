"""Expiry rules shared by the value cache and the KV cold tier.

- Logical expiry lives inside the value (an absolute wall-clock time); the Redis key's
  physical TTL is longer by a grace period, so a stale value is still there to be served
  while one caller rebuilds it.
- TTLs are jittered (±10% by default) so entries written together do not all expire in
  the same second and come back as one stampede.
- XFetch (Vattani, Chierichetti, Lowenstein, "Optimal Probabilistic Cache Stampede
  Prevention", VLDB 2015) refreshes a fresh entry early with a probability that rises as
  its expiry nears and with how long it takes to build, so a popular entry is usually
  rebuilt before anyone sees it stale.

Times are `time.time()` seconds: they cross processes and hosts, so hosts need NTP;
a skew of s seconds moves a logical expiry by s, while the physical TTL (counted by
Redis) stays exact.
"""

from __future__ import annotations

import math
import random
from typing import Callable

#: ±10%: enough to spread a batch written in one second over a 2·10% window of its TTL.
DEFAULT_JITTER = 0.1


def jittered(ttl_s: float, jitter: float = DEFAULT_JITTER, rand: Callable[[], float] = random.random) -> float:
    """`ttl_s` moved uniformly within ±`jitter` of itself."""
    if not 0 <= jitter < 1:
        raise ValueError(f"jitter must be in [0, 1), got {jitter}")
    return ttl_s * (1.0 + jitter * (2.0 * rand() - 1.0))


def physical_ttl_ms(logical_ttl_s: float, grace_s: float) -> int:
    """How long Redis keeps the key: the logical lifetime plus the stale-serving grace."""
    return max(1, int((logical_ttl_s + grace_s) * 1000))


def xfetch_due(
    now: float,
    expires_at: float,
    build_s: float,
    beta: float,
    rand: Callable[[], float] = random.random,
) -> bool:
    """True when a still-fresh entry should be rebuilt early: now − δ·β·ln(u) ≥ expiry.

    δ (`build_s`) is the measured build time stored with the value, u ~ U(0, 1].
    ln(u) ≤ 0, so the left side is `now` pushed forward by a random multiple of δ:
    β = 1 is the paper's optimum, β > 1 refreshes earlier, β = 0 turns it off.
    """
    if beta <= 0 or build_s <= 0:
        return False
    u = 1.0 - rand()  # (0, 1]: random() may return 0.0, and ln(0) is -inf
    return now - build_s * beta * math.log(u) >= expires_at
