"""The tenants the API and the scheduler must agree on, built once at each entry point.

`Tenancy` joins the two places tenants come from: `KVFLEET_TENANTS` (tiers, quotas and
API keys; `scheduler.tenants`) and the older `KVFLEET_API_KEYS` (`key:tenant`). Either
way an API key maps to exactly one tenant. With no `KVFLEET_TENANTS` (development),
any tenant name is accepted, as a silver tenant with no quota that may use the whole
fleet: the fleet behaves as before tenants existed.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Mapping, Optional

from scheduler.tenants import ENV_VAR, Tenant, TenantDirectory, Tier

#: A development tenant: no practical quota (10^9 tokens a minute), the whole fleet.
_DEV_TOKENS_PER_MINUTE = 10**9


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
    def __init__(self, directory: Optional[TenantDirectory], api_keys: Mapping[str, str] | None = None) -> None:
        """`directory` None: development (no KVFLEET_TENANTS). `api_keys`: KVFLEET_API_KEYS."""
        self.directory = directory
        self.tenants: Mapping[str, Tenant] = directory.tenants if directory is not None else _AnyTenant()
        self.keys: dict[str, str] = {}
        if directory is not None:
            for tenant in directory.tenants.values():
                self.keys.update((key, tenant.name) for key in tenant.api_keys)
        for key, name in (api_keys or {}).items():
            owner = self.keys.setdefault(key, name)
            if owner != name:
                raise ValueError(f"API key {key[:4]}… maps to {owner!r} in {ENV_VAR} and to {name!r} in "
                                 "KVFLEET_API_KEYS; a key maps to exactly one tenant")
            if directory is not None and name not in directory:
                raise ValueError(f"KVFLEET_API_KEYS gives a key to {name!r}, which {ENV_VAR} does not list")

    @classmethod
    def from_env(cls, env: Mapping[str, str], api_keys: Mapping[str, str] | None = None) -> "Tenancy":
        configured = bool(env.get(ENV_VAR, "").strip())
        return cls(TenantDirectory.from_env(env) if configured else None, api_keys)

    @property
    def configured(self) -> bool:
        return self.directory is not None

    def get(self, name: str) -> Optional[Tenant]:
        """The tenant, or None when tenants are configured and this one is not."""
        return self.tenants.get(name)
