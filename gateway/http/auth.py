"""Client authentication: API keys for client routes, admin keys for admin routes.

- Client routes (the OpenAI API, pass-through, ``/guard/status``) are open while no ``--api-key`` is set;
  once one is, they take any client key or admin key.
- Admin routes (``POST /guard/restart``) take only an ``--admin-api-key``, and are refused while none is set.
- The keys file's keys (``--keys-file``) are client keys too, each naming its tenant; every other caller is
  the tenant ``default``. The file is re-read while the app runs, so its keys come from the app's tenants
  component rather than from the (frozen) settings.

Keys are compared in constant time: the presented key is checked against every accepted key with
``hmac.compare_digest`` on SHA-256 digests (equal lengths, so not even a key's length leaks), with no early exit.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from functools import lru_cache

from starlette.requests import Request

from gateway.config import Settings
from gateway.errors import AuthenticationFailed
from gateway.guard.parts import Parts
from gateway.guard.seams import TenantLimits
from gateway.tenants import DEFAULT_TENANT, Tenant


@dataclass(frozen=True, slots=True)
class Keyring:
    """Accepted keys as (digest, key) pairs; ``key`` is what a match returns (priorities are looked up by it)."""

    client: tuple[tuple[bytes, str], ...]
    admin: tuple[tuple[bytes, str], ...]


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request: ``key``, the ``--api-key``/``--admin-api-key`` it presented (None for a keys-file key
    and on an open route), and its tenant (the keys file's, else ``default``)."""

    key: str | None
    tenant: Tenant | None = None

    @property
    def tenant_name(self) -> str:
        return self.tenant.name if self.tenant is not None else DEFAULT_TENANT


def authenticate(settings: Settings, request: Request, *, admin: bool = False) -> str | None:
    """The key the request presented when the route needs one (None on an open route); 401 otherwise."""
    return identify(settings, request, admin=admin).key


def identify(settings: Settings, request: Request, *, admin: bool = False) -> Caller:
    """The caller, when the route needs a key (an anonymous caller on an open route); 401 otherwise."""
    ring = keyring(tuple(settings.key_priorities()), tuple(settings.admin_api_key))
    tenants = None if admin else tenants_of(request)
    file_keys = tenants is not None and tenants.directory.has_keys
    if admin:
        if not ring.admin:
            raise AuthenticationFailed("This endpoint needs an admin key (--admin-api-key), and none is configured.")
        accepted = ring.admin
    elif not ring.client and not file_keys:
        return Caller(None, unnamed(tenants))  # no client keys: client routes are open, admin key or not
    else:
        accepted = ring.client + ring.admin
    token = presented_key(request)
    if not token:
        raise AuthenticationFailed(
            "Missing admin key: send 'Authorization: Bearer <admin key>'." if admin
            else "Missing API key: send 'Authorization: Bearer <key>'."
        )
    digest = token_digest(token)
    found = match_digest(digest, accepted)
    tenant = tenants.identify(digest) if tenants is not None else None
    if found is None and tenant is None:
        raise AuthenticationFailed("Incorrect admin key provided." if admin else "Incorrect API key provided.")
    return Caller(None, tenant) if tenant is not None else Caller(found, unnamed(tenants))


def unnamed(tenants: TenantLimits | None) -> Tenant | None:
    """The tenant of callers the keys file does not name: ``default`` (limited when the file lists it)."""
    return tenants.tenant(DEFAULT_TENANT) if tenants is not None else None


def tenants_of(request: Request) -> TenantLimits | None:
    """The app's tenants component (a worker's reads the keys file too), once the app has started (None before,
    and without an app)."""
    app = request.scope.get("app")
    parts = getattr(getattr(app, "state", None), "parts", None)
    return parts.tenants if isinstance(parts, Parts) else None


def presented_key(request: Request) -> str:
    """The bearer token, else the ``x-api-key`` header; empty when there is none."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return token.strip()
    return request.headers.get("x-api-key", "").strip()


def match(token: str, accepted: tuple[tuple[bytes, str], ...]) -> str | None:
    """The accepted key equal to ``token``, comparing with every one of them whatever the outcome."""
    return match_digest(token_digest(token), accepted)


def token_digest(token: str) -> bytes:
    # Starlette decodes header bytes as latin-1: encoding back gives the bytes the client sent.
    return hashlib.sha256(token.encode("latin-1", "replace")).digest()


def match_digest(digest: bytes, accepted: tuple[tuple[bytes, str], ...]) -> str | None:
    found: str | None = None
    for key_digest, key in accepted:
        if hmac.compare_digest(digest, key_digest):
            found = key
    return found


@lru_cache(maxsize=8)
def keyring(client_keys: tuple[str, ...], admin_keys: tuple[str, ...]) -> Keyring:
    """Digests of the configured keys, computed once per configuration rather than per request."""
    return Keyring(
        client=tuple((_digest(k), k) for k in client_keys if k),
        admin=tuple((_digest(k), k) for k in admin_keys if k),
    )


def _digest(key: str) -> bytes:
    # A client sends a configured key as UTF-8 bytes.
    return hashlib.sha256(key.encode("utf-8")).digest()
