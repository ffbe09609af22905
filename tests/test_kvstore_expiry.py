"""kvstore.expiry: jitter bounds and spread, physical TTL, the XFetch decision."""

from __future__ import annotations

import math

import pytest

from kvstore.expiry import jittered, physical_ttl_ms, xfetch_due


def test_jitter_stays_within_bounds_and_spreads():
    ttls = [jittered(100.0, 0.1) for _ in range(1000)]
    assert all(90.0 <= t <= 110.0 for t in ttls)
    assert max(ttls) - min(ttls) > 15.0  # spread over most of the ±10% window
    assert jittered(100.0, 0.1, rand=lambda: 0.0) == pytest.approx(90.0)
    assert jittered(100.0, 0.0) == 100.0


def test_jitter_rejects_nonsense():
    with pytest.raises(ValueError):
        jittered(10.0, 1.5)


def test_physical_ttl_adds_grace():
    assert physical_ttl_ms(10.0, 5.0) == 15_000
    assert physical_ttl_ms(0.0, 0.0) == 1  # Redis refuses PX 0


def test_xfetch_is_off_without_beta_or_build_time():
    assert not xfetch_due(now=99.9, expires_at=100.0, build_s=10.0, beta=0.0, rand=lambda: 0.999)
    assert not xfetch_due(now=99.9, expires_at=100.0, build_s=0.0, beta=1.0, rand=lambda: 0.999)


def test_xfetch_fires_closer_to_expiry_and_for_slower_builds():
    # u = 1 - rand; the gap bridged is -δ·β·ln(u).
    u_half = lambda: 0.5  # noqa: E731 - ln(0.5)·δ ≈ 0.69·δ
    assert xfetch_due(now=99.5, expires_at=100.0, build_s=1.0, beta=1.0, rand=u_half)
    assert not xfetch_due(now=90.0, expires_at=100.0, build_s=1.0, beta=1.0, rand=u_half)
    assert xfetch_due(now=90.0, expires_at=100.0, build_s=20.0, beta=1.0, rand=u_half)
    # rand() == 0.0 means u = 1, ln(1) = 0: never early, and no math domain error.
    assert not xfetch_due(now=99.99, expires_at=100.0, build_s=1.0, beta=1.0, rand=lambda: 0.0)


def test_xfetch_probability_matches_the_formula():
    # P(due) = P(-ln u >= gap/(δβ)) = exp(-gap/(δβ)).
    n = 20_000
    hits = sum(xfetch_due(now=99.0, expires_at=100.0, build_s=1.0, beta=1.0) for _ in range(n))
    assert hits / n == pytest.approx(math.exp(-1.0), abs=0.02)
