"""Tenants isolated in the KV cache, through the real fleet: tenant B sending tenant A's
exact prompt gets no cache hit (so neither `cached_tokens` nor its latency tells B
anything), while tenants that share a configured namespace do share cached prefixes."""

from __future__ import annotations

import json

import httpx
import pytest

from kvfleet.settings import Settings
from kvfleet.tenancy import Tenancy, cache_salt
from tests.fleet import running_fleet

TENANTS = {"tenants": [
    {"name": "acme", "tier": "silver", "tokens_per_minute": 6_000_000},
    {"name": "globex", "tier": "silver", "tokens_per_minute": 6_000_000},
    {"name": "initech", "tier": "silver", "tokens_per_minute": 6_000_000, "cache_namespace": "public-prompts"},
    {"name": "hooli", "tier": "silver", "tokens_per_minute": 6_000_000, "cache_namespace": "public-prompts"},
]}
# 200 prompt tokens: 12 full blocks of 16 that a cache could serve.
PROMPT = [(i * 7) % 250 for i in range(200)]


def test_salts_follow_the_configured_namespace_never_the_name_alone():
    tenancy = Tenancy.from_settings(Settings.from_env({"KVFLEET_TENANTS": json.dumps(TENANTS)}))
    assert tenancy.cache_salt("acme") != tenancy.cache_salt("globex")
    assert tenancy.cache_salt("initech") == tenancy.cache_salt("hooli") == cache_salt("shared:public-prompts")
    # A namespace cannot be named so as to land in a tenant's own.
    assert cache_salt("shared:acme") != tenancy.cache_salt("acme")


@pytest.fixture(scope="module")
def fleet(local_infra, redis_url, cache_redis_url, tmp_path_factory):
    # No fleet-wide prefix single flight here: it prefills a long prefix before the job,
    # which would make every first request report it cached. The pool and the cold tier
    # alone then show in cached_tokens; the single flight keys on the same namespaced
    # hashes (prefix_hashes).
    with running_fleet(local_infra, redis_url, cache_redis_url, tmp_path_factory.mktemp("tenant-cache"),
                       extra_env={"KVFLEET_TENANTS": json.dumps(TENANTS),
                                  "KVFLEET_PREFIX_SINGLE_FLIGHT_MIN_BLOCKS": "1000"}) as fleet:
        yield fleet


def cached_tokens(fleet, tenant: str) -> int:
    r = httpx.post(f"{fleet.url}/v1/jobs?wait=60", headers={"X-Tenant-ID": tenant},
                   json={"prompt_tokens": PROMPT, "max_new_tokens": 2}, timeout=90)
    assert r.status_code in (200, 202), r.text
    job_id = r.json()["job_id"]
    result = httpx.get(f"{fleet.url}/v1/jobs/{job_id}?wait=60", headers={"X-Tenant-ID": tenant}, timeout=90).json()
    assert result["status"] == "done", result
    return result["usage"]["cached_tokens"]


def test_another_tenant_never_hits_a_tenants_cached_prompt(fleet):
    assert cached_tokens(fleet, "acme") == 0
    assert cached_tokens(fleet, "globex") == 0  # A's exact prompt: no hit for B, in either tier
    assert cached_tokens(fleet, "acme") == 192  # A's own: its 12 full blocks
    assert cached_tokens(fleet, "globex") == 192  # and B's own copy, now that B computed it


def test_tenants_in_a_shared_namespace_share(fleet):
    assert cached_tokens(fleet, "initech") == 0
    assert cached_tokens(fleet, "hooli") == 192
