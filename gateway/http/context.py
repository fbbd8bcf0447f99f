"""What the HTTP layer reads from a guarded request, once: its id, its key (authenticated), its priority, deadline,
objective and overflow policy headers, and its body, parsed. The result is the guard's ``RequestContext``."""

from __future__ import annotations

import itertools
import math
import re
import uuid
from collections.abc import MutableMapping
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import Request

from gateway.admission.deadlines import MIN_DEADLINE_SECONDS
from gateway.config import PromptOverflowPolicy, Settings, priority_in_range
from gateway.errors import InvalidRequest
from gateway.guard import offload
from gateway.guard.context import RequestContext
from gateway.guard.endpoints.base import decode_json
from gateway.http.auth import Caller, identify
from gateway.http.body import BodyLimits, read_body
from gateway.observe.tracing import carrier_of

# (header, seconds per unit, its unit, the most accepted in its units): a day at most, as ms and as seconds.
_IN_MS, _IN_S = (0.001, "ms", 86_400_000.0), (1.0, "s", 86_400.0)
_DEADLINE_HEADERS = (("x-guard-deadline-ms", *_IN_MS), ("x-stainless-read-timeout", *_IN_S))
# A TTFT objective the request brings (an aim judged at its arrival, not a deadline): the llm-d router's SLO header,
# in milliseconds, else its deprecated name, which the router still reads when the new one is absent.
_OBJECTIVE_HEADERS = (("x-llm-d-slo-ttft-ms", *_IN_MS), ("x-slo-ttft-ms", *_IN_MS))
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")

# Request ids: one random prefix per process plus a counter. uuid4() reads os.urandom, which was measured
# at ~0.5 ms a call under load in sandboxed machines: more than the whole rest of the request path.
_ID_PREFIX = uuid.uuid4().hex[:12]
_ID_COUNTER = itertools.count(1)


class IndexedHeaders(Headers):
    """Starlette's ``Headers``, whose lookups (``[]``, ``get``, ``in``) are answered from an index of the raw
    headers built once, instead of a scan of them each (and, for a header the request lacks, a ``KeyError`` raised
    and caught inside ``Mapping.get``). A guarded request looks up about a dozen headers, most of them absent: with
    the fourteen an OpenAI SDK client sends, 15.2 us against 6.1 with the index, measured. The first of repeated
    headers answers, as Starlette's scan finds it; the keys compared are the same bytes
    (``tests/unit/http/test_context.py`` holds the two to the same answers)."""

    def __init__(self, scope: MutableMapping[str, Any]) -> None:
        super().__init__(scope=scope)
        self._index: dict[bytes, bytes] = dict(reversed(self._list))  # the first of repeated names wins

    def __getitem__(self, key: str) -> str:
        value = self._index.get(key.lower().encode("latin-1"))
        if value is None:
            raise KeyError(key)
        return value.decode("latin-1")

    def get(self, key: str, default: Any = None) -> Any:
        value = self._index.get(key.lower().encode("latin-1"))
        return default if value is None else value.decode("latin-1")

    def __contains__(self, key: Any) -> bool:
        return key.lower().encode("latin-1") in self._index


class GuardedRequest(Request):
    """A guarded route's request: its headers indexed (``IndexedHeaders``)."""

    @property
    def headers(self) -> Headers:
        if not hasattr(self, "_headers"):
            self._headers = IndexedHeaders(self.scope)
        return self._headers


async def read_context(settings: Settings, request: Request, rid: str, route: str, path: str) -> RequestContext:
    caller = identify(settings, request)
    # The headers first: a malformed one is refused before a body is read for nothing.
    rank, policy = priority(settings, request, caller.key, caller_priority(caller)), prompt_policy(request, settings)
    due, wanted = deadline(request), objective(request)
    raw = await read_body(request, BodyLimits.of(settings))
    # Parsed on the loop when small, else in a worker; the size decides for every later stage too (offload).
    body = await offload.decode_body(raw, decode_json)
    return RequestContext(
        rid, route, path, body, priority=rank, deadline=due, objective=wanted, prompt_policy=policy,
        tenant=caller.tenant_name,
        tenant_weight=caller.tenant.weight if caller.tenant is not None else 1.0,
        trace_carrier=carrier_of(request.headers),
    )


def request_id(request: Request) -> str:
    """The client's ``x-request-id`` when it is a sane token, else a fresh one; kept on the request for the
    error handlers."""
    rid = request.headers.get("x-request-id")
    if rid is None or not _REQUEST_ID.match(rid):
        rid = f"{_ID_PREFIX}{next(_ID_COUNTER):08x}"
    request.state.request_id = rid
    return rid


def caller_priority(caller: Caller) -> int:
    """The default priority of a keys-file caller's tenant (``--api-key`` keys carry their own)."""
    return caller.tenant.priority if caller.tenant is not None else 0


def priority(settings: Settings, request: Request, key: str | None, default: int = 0) -> int:
    """The ``x-guard-priority`` header, else the ``--api-key``'s priority, else ``default``."""
    raw = request.headers.get("x-guard-priority")
    if raw is None:
        return settings.key_priorities().get(key, default) if key else default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest(f"x-guard-priority must be an integer; got {raw!r}.", param="x-guard-priority") from None
    try:
        return priority_in_range(value, "x-guard-priority")
    except ValueError as exc:
        raise InvalidRequest(f"{exc}.", param="x-guard-priority") from None


def deadline(request: Request) -> float | None:
    """Seconds the client gives the request: the earlier of ``x-guard-deadline-ms`` and the OpenAI SDKs'
    ``x-stainless-read-timeout`` (seconds; a client that gives up then gains nothing from a later first token).
    A value that is not a positive number within bounds, or one below the least any engine can meet
    (``deadlines.MIN_DEADLINE_SECONDS``), is a 400 naming the header."""
    found = [
        seconds for header, scale, unit, most in _DEADLINE_HEADERS
        if (seconds := _header_seconds(request, header, scale, unit, most)) is not None
    ]
    return min(found, default=None)


def objective(request: Request) -> float | None:
    """Seconds to a first token the request asks for as its own TTFT objective: the llm-d router's
    ``x-llm-d-slo-ttft-ms`` (milliseconds), else its deprecated ``x-slo-ttft-ms``. Bounded as a deadline is (a
    positive number of ms, at most a day, at least ``deadlines.MIN_DEADLINE_SECONDS``), else a 400 naming the
    header: a router that sent a value the gateway cannot honour is told, not ignored."""
    for header, scale, unit, most in _OBJECTIVE_HEADERS:
        if (seconds := _header_seconds(request, header, scale, unit, most)) is not None:
            return seconds
    return None


def _header_seconds(request: Request, header: str, scale: float, unit: str, most: float) -> float | None:
    raw = request.headers.get(header)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value <= most:  # NaN fails too
        raise InvalidRequest(
            f"{header} must be a number above 0 and at most {most:g}; got {raw[:32]!r}.", param=header
        )
    if value * scale < MIN_DEADLINE_SECONDS:
        floor = MIN_DEADLINE_SECONDS / scale
        raise InvalidRequest(
            f"{header} is {raw[:32]} {unit}, below the least any engine can meet: {floor:g} {unit} to a first "
            f"token (the round trip to the engine and one step of its model take longer). Give the request "
            f"{floor:g} {unit} or more; retrying as it is cannot succeed.",
            param=header, code="deadline_too_short",
        )
    return value * scale


def prompt_policy(request: Request, settings: Settings) -> PromptOverflowPolicy:
    raw = request.headers.get("x-guard-on-overflow")
    if raw is None:
        return settings.on_prompt_overflow
    if raw not in ("reject", "truncate"):
        raise InvalidRequest(
            f"x-guard-on-overflow must be 'reject' or 'truncate'; got {raw!r}.", param="x-guard-on-overflow"
        )
    return "truncate" if raw == "truncate" else "reject"
