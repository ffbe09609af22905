"""Tenant configuration: parsing, the API-key map, and the errors that say what to fix."""

from __future__ import annotations

import json

import pytest

from scheduler.tenants import DEFAULT_TENANT, TenantDirectory, Tier

CONFIG = {"tenants": [
    {"name": "acme", "tier": "gold", "tokens_per_minute": 600_000, "share": 0.25, "api_keys": ["ak-acme-0001"]},
    {"name": "globex", "tier": "silver", "tokens_per_minute": 60_000, "api_keys": ["ak-globex-01", "ak-globex-02"]},
    {"name": "initech", "tier": "bronze", "tokens_per_minute": 6_000, "burst_tokens": 1_000},
]}


def test_parses_tiers_quotas_and_keys():
    d = TenantDirectory.from_json(json.dumps(CONFIG))
    assert d["acme"].tier is Tier.GOLD and d["acme"].share == 0.25
    assert d.for_api_key("ak-globex-02").name == "globex" and d.for_api_key("nope") is None
    assert d["globex"].bucket_tokens == 60_000  # default bucket: one minute's worth
    assert d["initech"].bucket_tokens == 1_000 and d["initech"].refill_per_s == 100.0
    assert d.requires_api_keys


def test_reads_a_file_named_with_at(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(CONFIG))
    assert "initech" in TenantDirectory.from_env({"KVFLEET_TENANTS": f"@{path}"})
    with pytest.raises(ValueError, match="no such file"):
        TenantDirectory.from_env({"KVFLEET_TENANTS": f"@{tmp_path}/missing.json"})


def test_default_is_one_open_tenant():
    d = TenantDirectory.from_env({})
    assert list(d.tenants) == [DEFAULT_TENANT] and not d.requires_api_keys


def _with(**changes) -> str:
    tenants = [dict(t) for t in CONFIG["tenants"]]
    tenants[1].update(changes)
    return json.dumps({"tenants": tenants})


@pytest.mark.parametrize("raw, message", [
    (_with(api_keys=["ak-acme-0001"]), "API key ak-a… is given to both 'acme' and 'globex'"),
    (_with(name="acme"), "tenant 'acme' is listed twice"),
    (_with(tier="platinum"), r"Invalid enum value 'platinum' - at `\$.tenants\[1\].tier`"),
    (_with(tokens_per_minute=0), r"Expected `int` >= 1 - at `\$.tenants\[1\].tokens_per_minute`"),
    (_with(tier="gold", share=0.6), "gold tenants reserve 85% of the budget"),
    (_with(quota=5), r"Object contains unknown field `quota` - at `\$.tenants\[1\]`"),
    ('{"tenants": []}', "configure at least one tenant"),
])
def test_bad_configuration_says_what_to_fix(raw, message):
    with pytest.raises(ValueError, match=message):
        TenantDirectory.from_json(raw)
