"""Tenant configuration: parsing, the API-key map, and the errors that say what to fix."""

from __future__ import annotations

import json

import pytest

from kvfleet.settings import Settings
from kvfleet.tenancy import Tenancy, Tier

CONFIG = {"tenants": [
    {"name": "acme", "tier": "gold", "tokens_per_minute": 600_000, "share": 0.25, "api_keys": ["ak-acme-0001"]},
    {"name": "globex", "tier": "silver", "tokens_per_minute": 60_000, "api_keys": ["ak-globex-01", "ak-globex-02"]},
    {"name": "initech", "tier": "bronze", "tokens_per_minute": 6_000, "burst_tokens": 1_000},
]}


def tenancy(**env: str) -> Tenancy:
    return Tenancy.from_settings(Settings.from_env({f"KVFLEET_{k}": v for k, v in env.items()}))


def test_parses_tiers_quotas_and_keys():
    t = tenancy(TENANTS=json.dumps(CONFIG))
    assert t.configured and t.get("acme").tier is Tier.GOLD and t.get("acme").share == 0.25
    assert t.keys == {"ak-acme-0001": "acme", "ak-globex-01": "globex", "ak-globex-02": "globex"}
    assert t.get("globex").bucket_tokens == 60_000  # default bucket: one minute's worth
    assert t.get("initech").bucket_tokens == 1_000 and t.get("initech").refill_per_s == 100.0
    assert t.get("nobody") is None


def test_reads_a_file_named_with_at(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(CONFIG))
    assert "initech" in tenancy(TENANTS=f"@{path}").tenants
    with pytest.raises(ValueError, match="no such file"):
        tenancy(TENANTS=f"@{tmp_path}/missing.json")


def test_without_tenants_any_name_is_an_open_tenant():
    dev = tenancy()
    assert not dev.configured and not dev.keys
    anyone = dev.get("anyone")
    assert anyone.tier is Tier.SILVER and anyone.share == 1.0 and not list(dev.tenants)


def test_older_api_keys_join_the_tenants_own():
    t = tenancy(TENANTS=json.dumps(CONFIG), API_KEYS="ak-acme-0002:acme")
    assert t.keys["ak-acme-0002"] == "acme" and t.keys["ak-acme-0001"] == "acme"
    assert tenancy(API_KEYS="k1:anyone").keys == {"k1": "anyone"}  # development: any name


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
        Tenancy.from_json(raw)


def test_a_hard_limit_is_read_and_may_not_be_below_the_share():
    ok = {"tenants": [{"name": "acme", "tier": "silver", "tokens_per_minute": 1000, "share": 0.2, "limit": 0.5}]}
    assert Tenancy.from_json(json.dumps(ok)).tenants["acme"].limit == 0.5
    bad = {"tenants": [{"name": "acme", "tier": "bronze", "tokens_per_minute": 1000, "share": 0.3, "limit": 0.1}]}
    with pytest.raises(ValueError, match="limit of 0.1 below its share of 0.3"):
        Tenancy.from_json(json.dumps(bad))
