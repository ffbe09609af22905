"""Who is asking: an API key maps to exactly one tenant.

With keys configured (`KVFLEET_API_KEYS`), every request must carry one
(`Authorization: Bearer <key>` or `X-API-Key`), and `X-Tenant-ID`, if sent, must name
the key's own tenant. Without keys (local development), `X-Tenant-ID` names the tenant.
"""

from __future__ import annotations

import hmac
from typing import Mapping, Optional

from kvfleet.settings import ApiSettings


class AuthError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def resolve_tenant(api: ApiSettings, headers: Mapping[str, str], body_tenant: Optional[str] = None) -> str:
    claimed = headers.get("x-tenant-id") or body_tenant
    if not api.api_keys:
        return claimed or api.default_tenant
    key = headers.get("x-api-key") or _bearer(headers.get("authorization", ""))
    if not key:
        raise AuthError(401, "missing API key: send `Authorization: Bearer <key>` or `X-API-Key: <key>`")
    tenant = _lookup(api.api_keys, key)
    if tenant is None:
        raise AuthError(401, "unknown API key")
    if claimed and claimed != tenant:
        raise AuthError(403, f"this API key belongs to another tenant than {claimed!r}")
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
