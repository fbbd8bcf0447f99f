"""What each path is: the canonical form of a request's path, and the one table of routes.

A request is routed by its canonical path only, decided once before anything else looks at it, and the
upstream is sent the table's own path, never the client's. Forms the upstream's HTTP client or framework
would read differently from the gateway (percent-encoded dots or separators, backslashes, control
characters) are refused rather than guessed at; dot segments and repeated slashes are normalised, so
``/v1/./chat/completions`` is the guarded chat route and can never reach vLLM unguarded.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from gateway.config import GENERATING_ROUTES
from gateway.errors import MethodNotAllowed, NotFound
from gateway.guard.endpoints.table import ENDPOINTS

# Far above any route's length (the longest is 30 bytes), far below what a path could cost to handle.
MAX_PATH_BYTES = 1024

# Encoded '/', '\' and '.': decoded, they would change the path's segments after the gateway read them.
_ENCODED_SEPARATOR = re.compile(rb"%(?:2f|5c|2e)", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

RouteKind = Literal["guarded", "gateway", "passthrough"]


@dataclass(frozen=True, slots=True)
class Route:
    """One canonical path. ``name``: the guarded request's kind (director.guarded), or the gateway's own
    handler; for pass-through routes the path itself. ``query``: the gateway's own handler reads the query
    string (pass-through routes always forward it)."""

    path: str
    method: str
    kind: RouteKind
    name: str
    query: bool = False


# Every route on which vLLM counts tokens against the context, served only through the guard: path -> route name
# (the guard's one table of endpoints, ``guard/endpoints/table.py``).
GUARDED_ROUTES: dict[str, str] = {path: e.name for e in ENDPOINTS for path in e.paths}

GATEWAY_ROUTES: tuple[Route, ...] = (
    Route("/v1/models", "GET", "gateway", "models"),
    Route("/health", "GET", "gateway", "health"),
    Route("/metrics", "GET", "gateway", "metrics"),
    Route("/guard/status", "GET", "gateway", "status"),
    Route("/guard/restart", "POST", "gateway", "restart", query=True),
    Route("/guard/usage", "GET", "gateway", "usage"),
    Route("/guard/ui", "GET", "gateway", "ui"),
    Route("/guard/ui/data", "GET", "gateway", "ui_data", query=True),
)

# vLLM's public API that generates nothing: forwarded with auth.
PUBLIC_ROUTES: dict[str, str] = {"/tokenize": "POST", "/detokenize": "POST", "/version": "GET"}


def canonical_path(raw_path: bytes | None, path: str) -> str:
    """The canonical form of a request path, or ``NotFound`` for a form that is refused.

    ``raw_path`` is the path as sent (still percent-encoded; ASGI's ``raw_path``), ``path`` the server's
    decoded reading of it.
    """
    raw = raw_path if raw_path is not None else path.encode("utf-8", "surrogatepass")
    if len(raw) > MAX_PATH_BYTES or len(path) > MAX_PATH_BYTES:
        raise NotFound(f"The request path is {max(len(raw), len(path))} bytes long; the limit is {MAX_PATH_BYTES}.")
    if _ENCODED_SEPARATOR.search(raw) is not None:
        raise NotFound("The request path holds a percent-encoded '/', '\\' or '.'; send the path itself.")
    if "%" in path:
        raise NotFound("The request path holds a percent sign after decoding (double encoding).")
    if "\\" in path or _CONTROL.search(path) is not None:
        raise NotFound("The request path holds a backslash or a control character.")
    if not path.startswith("/"):
        raise NotFound(f"The request path must start with '/'; got {_shown(path)}.")
    segments: list[str] = []
    for segment in path.split("/"):
        if segment in ("", "."):
            continue  # repeated, leading and trailing slashes, and "/./"
        if segment == "..":
            if not segments:
                raise NotFound(f"The request path {_shown(path)} climbs above the root.")
            segments.pop()
            continue
        segments.append(segment)
    return "/" + "/".join(segments)


class RouteTable:
    """Every path the gateway answers, by canonical path. ``passthrough_routes``: the generating routes
    (from ``GENERATING_ROUTES``) named to be forwarded unguarded; the others are 404."""

    def __init__(self, passthrough_routes: Iterable[str] = ()) -> None:
        routes = [Route(path, "POST", "guarded", name) for path, name in GUARDED_ROUTES.items()]
        routes += GATEWAY_ROUTES
        routes += [Route(path, method, "passthrough", path) for path, method in PUBLIC_ROUTES.items()]
        for path in passthrough_routes:
            if path not in GENERATING_ROUTES:
                raise ValueError(f"{path!r} is not a vLLM generating route; choose from {GENERATING_ROUTES}")
            routes.append(Route(path, "POST", "passthrough", path))
        self._routes = {r.path: r for r in routes}
        # The paths as they arrive in the common case, undecoded and already canonical.
        self._raw = {r.path.encode(): r for r in routes}

    def routes(self) -> list[Route]:
        return list(self._routes.values())

    def resolve(self, method: str, raw_path: bytes | None, path: str) -> Route:
        """The route a request goes to; ``NotFound`` (404) or ``MethodNotAllowed`` (405, with ``Allow``)."""
        # Sent exactly as a table path: nothing to decode or normalise.
        route = self._raw.get(raw_path) if raw_path is not None else self._routes.get(path)
        if route is None:
            canonical = canonical_path(raw_path, path)
            route = self._routes.get(canonical)
            if route is None:
                raise NotFound(self._unknown(method, canonical))
        if method != route.method:
            raise MethodNotAllowed(
                f"Method {method} is not allowed on {route.path}; use {route.method}.",
                allowed=route.method,
            )
        return route

    @staticmethod
    def _unknown(method: str, canonical: str) -> str:
        if canonical in GENERATING_ROUTES:
            return (
                f"{canonical} generates outside the gateway's guard and is not served; start the gateway "
                f"with --passthrough-route {canonical} to forward it unguarded."
            )
        return f"Unknown path: {method} {_shown(canonical)}"


def _shown(path: str) -> str:
    return path if len(path) <= 100 else path[:100] + "..."
