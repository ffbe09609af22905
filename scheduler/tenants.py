"""Tenants, their tiers and quotas, from configuration.

`KVFLEET_TENANTS` holds the configuration as JSON, or `@/path/to/tenants.json` to read
it from a file:

    {"tenants": [
      {"name": "acme",   "tier": "gold",   "tokens_per_minute": 2000000, "share": 0.25,
       "api_keys": ["ak-acme-1"]},
      {"name": "globex", "tier": "silver", "tokens_per_minute": 600000, "api_keys": ["ak-globex"]},
      {"name": "initech","tier": "bronze", "tokens_per_minute": 120000, "burst_tokens": 20000}
    ]}

Tiers (what `share` means for each is applied by `scheduler.policy`):
- gold:   `share` of the fleet's token budget is reserved for the tenant: others may
          never take it, so a gold job that fits in it is admitted at once.
- silver: the shared pool; the tenant may burst up to `share` of the budget.
- bronze: a hard limit of `share` of the budget, and shed first under overload.

`tokens_per_minute` and `burst_tokens` size the tenant's token bucket (`scheduler.quota`),
charged once, by the API, when a job is submitted. An API key maps to exactly one tenant.
Without `KVFLEET_TENANTS` there is one silver tenant, `default`, with no practical quota:
development only.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path
from typing import Annotated, Mapping, Optional

import msgspec

from kvfleet.contracts import TenantId

ENV_VAR = "KVFLEET_TENANTS"
DEFAULT_TENANT = "default"


class Tier(str, enum.Enum):
    GOLD = "gold"
    SILVER = "silver"
    BRONZE = "bronze"


class Tenant(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: TenantId
    tier: Tier
    #: Refill rate of the tenant's token bucket (prompt + max_new_tokens per minute).
    tokens_per_minute: Annotated[int, msgspec.Meta(gt=0)]
    #: Bucket size: the most a tenant can submit at once after being idle.
    #: None = one minute's worth, so an idle tenant may spend a minute's quota at once.
    burst_tokens: Optional[Annotated[int, msgspec.Meta(gt=0)]] = None
    #: Fraction of the fleet budget (see the tiers above). None = the tier's default
    #: from `PolicyConfig`.
    share: Optional[Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]] = None
    api_keys: list[Annotated[str, msgspec.Meta(min_length=8)]] = []

    @property
    def bucket_tokens(self) -> int:
        return self.burst_tokens if self.burst_tokens is not None else self.tokens_per_minute

    @property
    def refill_per_s(self) -> float:
        return self.tokens_per_minute / 60.0


class _File(msgspec.Struct, forbid_unknown_fields=True):
    tenants: list[Tenant]


#: Gold reservations above this leave too little of the fleet for everyone else.
MAX_GOLD_RESERVED = 0.8


class TenantDirectory:
    """Every configured tenant by name, and the API key → tenant map."""

    def __init__(self, tenants: list[Tenant]) -> None:
        if not tenants:
            raise ValueError(f"{ENV_VAR}: configure at least one tenant")
        self.tenants: dict[str, Tenant] = {}
        self._by_key: dict[str, str] = {}
        for tenant in tenants:
            if tenant.name in self.tenants:
                raise ValueError(f"{ENV_VAR}: tenant {tenant.name!r} is listed twice")
            self.tenants[tenant.name] = tenant
            for key in tenant.api_keys:
                owner = self._by_key.setdefault(key, tenant.name)
                if owner != tenant.name:
                    raise ValueError(
                        f"{ENV_VAR}: API key {key[:4]}… is given to both {owner!r} and {tenant.name!r}; "
                        "a key maps to exactly one tenant"
                    )
        reserved = sum(t.share or 0.0 for t in tenants if t.tier is Tier.GOLD)
        if reserved > MAX_GOLD_RESERVED:
            raise ValueError(
                f"{ENV_VAR}: gold tenants reserve {reserved:.0%} of the budget in total; "
                f"keep it at or under {MAX_GOLD_RESERVED:.0%} so other tenants can run"
            )

    def __getitem__(self, name: str) -> Tenant:
        try:
            return self.tenants[name]
        except KeyError:
            raise KeyError(f"unknown tenant {name!r}; configured: {sorted(self.tenants)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self.tenants

    def for_api_key(self, api_key: str) -> Optional[Tenant]:
        """The tenant owning this key, or None (the API answers 401)."""
        name = self._by_key.get(api_key)
        return self.tenants[name] if name is not None else None

    @property
    def requires_api_keys(self) -> bool:
        return bool(self._by_key)

    @classmethod
    def from_json(cls, raw: str | bytes) -> "TenantDirectory":
        try:
            parsed = msgspec.json.decode(raw, type=_File)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            raise ValueError(f"{ENV_VAR}: {exc}") from None
        return cls(parsed.tenants)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "TenantDirectory":
        env = os.environ if env is None else env
        raw = env.get(ENV_VAR, "").strip()
        if not raw:
            return cls.default()
        if raw.startswith("@"):
            path = Path(raw[1:])
            if not path.is_file():
                raise ValueError(f"{ENV_VAR}={raw!r}: no such file")
            raw = path.read_text()
        return cls.from_json(raw)

    @classmethod
    def default(cls) -> "TenantDirectory":
        # 10^9 tokens per minute: no practical limit, for a development fleet.
        return cls([Tenant(name=DEFAULT_TENANT, tier=Tier.SILVER, tokens_per_minute=10**9)])
