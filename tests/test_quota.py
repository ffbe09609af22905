"""Token-bucket quotas on the real Redis: retry-after, refill, isolation, atomicity."""

from __future__ import annotations

import math
import threading

import pytest
import redis as redis_lib

from kvfleet.constants import Keys
from kvfleet.quota import Quotas, Take
from kvfleet.tenancy import Tenant, Tier

# 600 tokens per minute = 10 per second; a bucket of 100.
ACME = Tenant(name="acme", tier=Tier.SILVER, tokens_per_minute=600, burst_tokens=100)
GLOBEX = Tenant(name="globex", tier=Tier.BRONZE, tokens_per_minute=600, burst_tokens=100)


@pytest.fixture
def quotas(redis_client, prefix) -> Quotas:
    return Quotas(redis_client, Keys(prefix))


def test_retry_after_is_the_time_to_refill_the_deficit(quotas):
    assert quotas.try_take(ACME, 100, now=1_000.0) == Take(True, 0.0)
    denied = quotas.try_take(ACME, 50, now=1_000.0)
    assert not denied.allowed and denied.retry_after_s == pytest.approx(5.0)  # 50 tokens at 10/s
    # A denied take costs nothing: one second later the deficit is one second smaller.
    assert quotas.try_take(ACME, 50, now=1_001.0).retry_after_s == pytest.approx(4.0)
    assert quotas.try_take(ACME, 50, now=1_005.0).allowed  # exactly when it said
    assert not quotas.try_take(ACME, 1, now=1_005.0).allowed


def test_bucket_refills_only_up_to_its_size(quotas):
    assert quotas.try_take(ACME, 100, now=0.0).allowed
    assert quotas.try_take(ACME, 100, now=3_600.0).allowed  # an hour idle: full, not 36k
    assert quotas.try_take(ACME, 1, now=3_600.0).retry_after_s == pytest.approx(0.1)


def test_tenants_do_not_share_buckets(quotas):
    assert quotas.try_take(ACME, 100, now=0.0).allowed
    assert not quotas.try_take(ACME, 10, now=0.0).allowed
    assert quotas.try_take(GLOBEX, 100, now=0.0).allowed


def test_a_clock_behind_the_last_writer_does_not_refill_backwards(quotas):
    assert quotas.try_take(ACME, 100, now=1_000.0).allowed
    late = quotas.try_take(ACME, 10, now=990.0)  # an API replica 10 s behind
    assert not late.allowed and late.retry_after_s == pytest.approx(1.0)


def test_larger_than_the_bucket_can_never_pass(quotas):
    assert quotas.try_take(ACME, 101, now=0.0) == Take(False, math.inf)
    with pytest.raises(ValueError, match="tokens must be > 0"):
        quotas.try_take(ACME, 0)


def test_concurrent_takes_never_overdraw(redis_url, prefix):
    allowed = []
    start = threading.Event()

    def take() -> None:
        q = Quotas(redis_lib.Redis.from_url(redis_url), Keys(prefix))
        start.wait(10)
        allowed.extend(q.try_take(ACME, 1, now=0.0).allowed for _ in range(50))

    threads = [threading.Thread(target=take) for _ in range(6)]
    for t in threads:
        t.start()
    start.set()
    for t in threads:
        t.join()
    assert sum(allowed) == 100 and len(allowed) == 300


def test_redis_time_is_used_without_now(quotas, redis_client, prefix):
    assert quotas.try_take(ACME, 100).allowed
    assert 0 < redis_client.pttl(Keys(prefix).quota("acme")) <= 11_000  # refill time + 1 s
