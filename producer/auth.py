"""Who is asking: an API key maps to exactly one tenant.

Keys come from `KVFLEET_TENANTS` (each tenant's `api_keys`) and `KVFLEET_API_KEYS`
(`key:tenant`), joined by `kvfleet.tenancy.Tenancy`. With any key configured, every
request must carry one (`Authorization: Bearer <key>` or `X-API-Key`), and
`X-Tenant-ID`, if sent, must name the key's own tenant. Without keys, `X-Tenant-ID`
names the tenant; it must be a configured one when tenants are configured (any name
in development).
"""

from __future__ import annotations

import hmac
from typing import Mapping, Optional

from kvfleet.tenancy import Tenancy, Tenant
from producer.errors import Forbidden, Unauthorized


def resolve_tenant(tenancy: Tenancy, headers: Mapping[str, str], body_tenant: Optional[str] = None, *,
                   default_tenant: str = "default") -> Tenant:
    claimed = headers.get("x-tenant-id") or body_tenant
    if tenancy.keys:
        key = headers.get("x-api-key") or _bearer(headers.get("authorization", ""))
        if not key:
            raise Unauthorized("missing API key: send `Authorization: Bearer <key>` or `X-API-Key: <key>`")
        name = _lookup(tenancy.keys, key)
        if name is None:
            raise Unauthorized("unknown API key")
        if claimed and claimed != name:
            raise Forbidden(f"this API key belongs to another tenant than {claimed!r}")
    else:
        name = claimed or default_tenant
    tenant = tenancy.get(name)
    if tenant is None:
        raise Forbidden(f"unknown tenant {name!r}: send the X-Tenant-ID of a configured tenant")
    return tenant


def _bearer(value: str) -> str:
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _lookup(keys: Mapping[str, str], key: str) -> Optional[str]:
    # Constant-time comparison, so response timing does not leak key prefixes.
    found = None
    for candidate, tenant in keys.items():
        if hmac.compare_digest(candidate.encode(), key.encode()):
            found = tenant
    return found
