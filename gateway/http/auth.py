"""Client authentication: API keys for client routes, admin keys for admin routes.

- Client routes (the OpenAI API, pass-through, ``/guard/status``) are open while no ``--api-key`` is set;
  once one is, they take any client key or admin key.
- Admin routes (``POST /guard/restart``) take only an ``--admin-api-key``, and are refused while none is set.

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


@dataclass(frozen=True, slots=True)
class Keyring:
    """Accepted keys as (digest, key) pairs; ``key`` is what a match returns (priorities are looked up by it)."""

    client: tuple[tuple[bytes, str], ...]
    admin: tuple[tuple[bytes, str], ...]


def authenticate(settings: Settings, request: Request, *, admin: bool = False) -> str | None:
    """The key the request presented when the route needs one (None on an open route); 401 otherwise."""
    ring = keyring(tuple(settings.key_priorities()), tuple(settings.admin_api_key))
    if admin:
        if not ring.admin:
            raise AuthenticationFailed("This endpoint needs an admin key (--admin-api-key), and none is configured.")
        accepted = ring.admin
    elif not ring.client:
        return None  # no client keys: client routes are open, whether or not an admin key is set
    else:
        accepted = ring.client + ring.admin
    token = presented_key(request)
    if not token:
        raise AuthenticationFailed(
            "Missing admin key: send 'Authorization: Bearer <admin key>'." if admin
            else "Missing API key: send 'Authorization: Bearer <key>'."
        )
    found = match(token, accepted)
    if found is None:
        raise AuthenticationFailed("Incorrect admin key provided." if admin else "Incorrect API key provided.")
    return found


def presented_key(request: Request) -> str:
    """The bearer token, else the ``x-api-key`` header; empty when there is none."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return token.strip()
    return request.headers.get("x-api-key", "").strip()


def match(token: str, accepted: tuple[tuple[bytes, str], ...]) -> str | None:
    """The accepted key equal to ``token``, comparing with every one of them whatever the outcome."""
    # Starlette decodes header bytes as latin-1: encoding back gives the bytes the client sent.
    digest = hashlib.sha256(token.encode("latin-1", "replace")).digest()
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
