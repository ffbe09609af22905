"""Tenants, their tiers and quotas, and the API keys that name them, from `Settings`.

`Settings.tenants` (`KVFLEET_TENANTS`) holds the configuration as JSON, or
`@/path/to/tenants.json` to read it from a file:

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
- bronze: `share` of the budget while others have work, and shed first under overload.
Beyond its share a silver or bronze tenant borrows only what nobody else waits for
(`PolicyConfig.borrow_idle`), admitted last; `limit`, when set, is a hard cap for any tier.

`tokens_per_minute` and `burst_tokens` size the tenant's token bucket (kvfleet/quota.py),
charged once, by the API, when a job is submitted.

API keys come from each tenant's `api_keys` and from the older `KVFLEET_API_KEYS`
(`key:tenant`, `Settings.api.api_keys`), joined into one map here: a key maps to exactly
one tenant. Without `KVFLEET_TENANTS` (development) any tenant name is accepted, as a
silver tenant with no quota that may use the whole fleet.
"""

from __future__ import annotations

import enum
import hashlib
from pathlib import Path
from typing import Annotated, Iterator, Mapping, Optional

import msgspec

from kvfleet.contracts import TenantId
from kvfleet.settings import Settings

ENV_VAR = "KVFLEET_TENANTS"
#: Gold reservations above this leave too little of the fleet for everyone else.
MAX_GOLD_RESERVED = 0.8
#: A development tenant: no practical quota (10^9 tokens a minute), the whole fleet.
_DEV_TOKENS_PER_MINUTE = 10**9


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
    #: Hard cap, fraction of the fleet budget: never exceeded, idle fleet or not (a
    #: contract's ceiling). None: none beyond what the tier's share and borrowing allow.
    limit: Optional[Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]] = None
    api_keys: list[Annotated[str, msgspec.Meta(min_length=8)]] = []
    #: Whose KV cache this tenant shares. None: its own alone (the default: a cache hit,
    #: its latency or `cached_tokens` would tell one tenant what another sent). Tenants
    #: naming the same namespace share their cached prefixes, e.g. a public system prompt.
    cache_namespace: Optional[Annotated[str, msgspec.Meta(min_length=1, max_length=64)]] = None
    #: May this tenant's requests that ask for it (`sampling.cache`) be answered from the
    #: exact-match result cache (workers/result_cache.py)? Off by default: a cached
    #: answer is not a fresh sample, and it is shared within the cache namespace.
    result_cache: bool = False

    @property
    def bucket_tokens(self) -> int:
        return self.burst_tokens if self.burst_tokens is not None else self.tokens_per_minute

    @property
    def refill_per_s(self) -> float:
        return self.tokens_per_minute / 60.0


class _File(msgspec.Struct, forbid_unknown_fields=True):
    tenants: list[Tenant]


class _AnyTenant(Mapping[str, Tenant]):
    """Development: every name is a silver tenant whose burst is the whole fleet.
    Iterating yields nobody, so the policy finds no gold reserves to set aside."""

    def __getitem__(self, name: str) -> Tenant:
        return Tenant(name=name, tier=Tier.SILVER, tokens_per_minute=_DEV_TOKENS_PER_MINUTE, share=1.0)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __bool__(self) -> bool:
        # Non-empty in spirit: `Policy` replaces a falsy tenants mapping with `{}`.
        return True


class Tenancy:
    """Every tenant by name (`tenants`) and the API key → tenant map (`keys`)."""

    def __init__(self, tenants: Optional[list[Tenant]], api_keys: Mapping[str, str] | None = None) -> None:
        """`tenants` None: development (no KVFLEET_TENANTS). `api_keys`: KVFLEET_API_KEYS."""
        self.configured = tenants is not None
        self.tenants: Mapping[str, Tenant] = self._by_name(tenants) if tenants is not None else _AnyTenant()
        self.keys: dict[str, str] = {}
        own = [(key, t.name, ENV_VAR) for t in (tenants or []) for key in t.api_keys]
        for key, name, source in own + [(k, n, "KVFLEET_API_KEYS") for k, n in (api_keys or {}).items()]:
            owner = self.keys.setdefault(key, name)
            if owner != name:
                raise ValueError(f"{source}: API key {key[:4]}… is given to both {owner!r} and {name!r}; "
                                 "a key maps to exactly one tenant")
            if self.configured and name not in self.tenants:
                raise ValueError(f"KVFLEET_API_KEYS gives a key to {name!r}, which {ENV_VAR} does not list")

    @staticmethod
    def _by_name(tenants: list[Tenant]) -> dict[str, Tenant]:
        if not tenants:
            raise ValueError(f"{ENV_VAR}: configure at least one tenant")
        by_name: dict[str, Tenant] = {}
        for tenant in tenants:
            if tenant.name in by_name:
                raise ValueError(f"{ENV_VAR}: tenant {tenant.name!r} is listed twice")
            by_name[tenant.name] = tenant
            if tenant.limit is not None and tenant.share is not None and tenant.limit < tenant.share:
                raise ValueError(f"{ENV_VAR}: tenant {tenant.name!r} has a limit of {tenant.limit} below its "
                                 f"share of {tenant.share}; a hard limit must be at least the share")
        reserved = sum(t.share or 0.0 for t in tenants if t.tier is Tier.GOLD)
        if reserved > MAX_GOLD_RESERVED:
            raise ValueError(
                f"{ENV_VAR}: gold tenants reserve {reserved:.0%} of the budget in total; "
                f"keep it at or under {MAX_GOLD_RESERVED:.0%} so other tenants can run"
            )
        return by_name

    @classmethod
    def from_json(cls, raw: str | bytes, api_keys: Mapping[str, str] | None = None) -> "Tenancy":
        try:
            parsed = msgspec.json.decode(raw, type=_File)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            raise ValueError(f"{ENV_VAR}: {exc}") from None
        return cls(parsed.tenants, api_keys)

    @classmethod
    def from_settings(cls, settings: Settings) -> "Tenancy":
        raw = settings.tenants.strip()
        if not raw:
            return cls(None, settings.api.api_keys)
        if raw.startswith("@"):
            path = Path(raw[1:])
            if not path.is_file():
                raise ValueError(f"{ENV_VAR}={raw!r}: no such file")
            raw = path.read_text()
        return cls.from_json(raw, settings.api.api_keys)

    def get(self, name: str) -> Optional[Tenant]:
        """The tenant, or None when tenants are configured and this one is not."""
        return self.tenants.get(name)

    def result_cache(self, name: str) -> bool:
        """The tenant allows cached results (its requests must still ask)."""
        tenant = self.tenants.get(name)
        return tenant is not None and tenant.result_cache

    def cache_salt(self, name: str) -> str:
        """The root of the tenant's KV block-hash chains (workers/engine/block_manager.py):
        its namespace's, derived here from the tenant the job belongs to and never from
        anything a client sends, so no request can reach another namespace's blocks, in
        the pool, the cold tier or the fleet-wide prefix single flight."""
        tenant = self.tenants.get(name)
        # Two name spaces, so that no configured namespace can equal a tenant's own.
        shared = tenant.cache_namespace if tenant is not None else None
        return cache_salt(f"shared:{shared}" if shared else f"tenant:{name}")


def cache_salt(namespace: str) -> str:
    """32 hex chars naming a KV-cache namespace; the same in every process."""
    return hashlib.blake2b(namespace.encode(), digest_size=16, person=b"kvfleet-kv-ns").hexdigest()
