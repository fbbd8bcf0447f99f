"""The request path's seams: what it needs from admission, tenants, an engine's progress and the access log.

The request path (``pipeline.py`` and the stages it calls) is the same in every process. One process
(``http/assembly.py``) fills these seams with the real parts: ``Admission`` and its ``Reservation``, ``Tenants``
and its ``Grant``, each engine's ``ProgressDetector``, the ``AccessLog``. A worker of ``--workers``
(``workers/assembly.py``) fills them with stand-ins that ask the admission authority, or tell it:
``RemoteAdmission`` and ``RemoteReservation``, ``RemoteTenants`` and ``RemoteGrant``, ``ForwardedAccessLog``; its
``ProgressDetector`` forwards what it sees to the authority's. Each Protocol is the whole of what the request path
may rely on, and says the contract both sides keep; ``Parts`` and both assemblies are typed on them, so a type
checker holds each implementation to it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any, Protocol

from gateway.admission.destination import Destination
from gateway.admission.prefix import PromptPrefix
from gateway.errors import GatewayError
from gateway.observe.access_log import AccessRecord
from gateway.tenants.keys import KeyDirectory, Tenant


# -- admission ------------------------------------------------------------------------------------------------------
class Held(Protocol):
    """One request's reservation, as the request path holds it from its admission to its end."""

    @property
    def target(self) -> Destination | None:
        """Where it was placed once admitted (the engine, and its rank on a data-parallel one); None before."""

    @property
    def generated(self) -> int:
        """Output tokens generated so far, as the engine counts them (never goes down)."""

    def observe_output_tokens(self, generated: int, first_token_s: float | None = None) -> None:
        """The engine's count of what it generated so far: it grows the booking the request holds, and teaches
        admission how long outputs really are. ``first_token_s``, with the first: its time as measured where the
        request was written to its engine, where that was not here (a worker's request, at the authority); else
        it is timed here."""

    def sent(self) -> None:
        """The request is about to be written to its engine: the engine's time to a first token counts from here
        (what came before it since the admission is the gateway's own)."""

    def release(self, *, completed: bool = True) -> None:
        """Free what it holds, exactly once: calls after the first (or before the admission) do nothing, so that
        every exit of the request path may call it. ``completed``: the engine finished it (an aborted one must
        not teach admission that outputs are short)."""


class Admitting(Protocol):
    """``parts.admission``: the KV books the request path reserves against (kept here, or at the authority)."""

    def reservation(
        self, *, prompt_tokens: int, max_tokens: int, n: int, priority: int, request_id: str, tenant: str = "default",
        weight: float = 1.0, prefix: PromptPrefix | None = None, avoid: frozenset[str] = frozenset(), family: str = "",
        deadline: float | None = None, min_output: int = 0, objective: float | None = None,
    ) -> Held:
        """A reservation not yet admitted: entered through the tenant's grant (``Granted.admit``), which waits in
        the queue if need be. Nothing is held until then."""

    def fit(self, prompt_tokens: int, max_tokens: int, n: int, *, clamp: bool, prefix_known: bool = False) -> int:
        """``max_tokens`` if the request fits the whole KV budget; with ``clamp``, lowered until it does. Raises
        ``KVBudgetExceeded`` when it cannot fit."""

    def budget_blocks(self) -> int | None:
        """The blocks the gateway may commit, for a tenant's KV share; None while unknown (no share applies)."""


# -- tenants --------------------------------------------------------------------------------------------------------
class Granted(Protocol):
    """One request's standing with its tenant, from its check to its end."""

    @property
    def headers(self) -> dict[str, str]:
        """The tenant's x-ratelimit-* headers (empty without per-minute limits)."""

    def raise_if_refused(self) -> None:
        """Raise ``TenantRateLimited`` when the check found the tenant over a limit (a worker learns it with the
        admission instead, and raises there)."""

    def admit(self, booked: Any, budget: Callable[[], int | None]) -> AbstractAsyncContextManager[float]:
        """Enter ``booked`` (which may queue) within the tenant's KV share of ``budget()`` blocks; yields the
        milliseconds waited and leaves the reservation on exit. ``booked``: a reservation of the same process's
        admission (``Admitting.reservation``): each kind of grant enters only its own kind of reservation."""

    def settle(self, queue_ms: float) -> None:
        """Once, when the request ends, admitted or not: charge what it really used."""


class Rejections(Protocol):
    """Where a tenant's refused requests are counted (``/guard/usage``)."""

    def rejected(self, tenant: str, reason: str) -> None: ...


class TenantLimits(Protocol):
    """``parts.tenants``: who a key belongs to (the keys file), and each tenant's limits."""

    @property
    def usage(self) -> Rejections: ...

    @property
    def directory(self) -> KeyDirectory:
        """The keys file as last read."""

    def identify(self, digest: bytes) -> Tenant | None:
        """The tenant of the key with this SHA-256 digest; None when the keys file has no such key."""

    def tenant(self, name: str) -> Tenant: ...

    async def check(self, tenant_name: str, *, prompt_tokens: int, output_tokens: int) -> Granted:
        """Charge one request to its tenant's windows; a refusal raises on ``Granted.raise_if_refused``."""


# -- an engine's progress -------------------------------------------------------------------------------------------
class Progress(Protocol):
    """What the request path tells an engine's hang detector, and asks of it. Every request opened to the engine is
    closed exactly once; a hung engine cuts the requests watching it."""

    @property
    def hung(self) -> bool: ...

    def error(self) -> GatewayError:
        """The refusal a request gets while the engine is hung."""

    def opened(self) -> None:
        """A request to the engine was opened."""

    def closed(self) -> None:
        """That request is over (answered, broken or abandoned)."""

    def stream_moved(self) -> None:
        """A stream's chunk arrived: the engine is moving."""

    def answered(self) -> None:
        """A whole answer arrived: progress, even from an engine whose metrics never move."""

    def interruptible(self) -> AbstractContextManager[None]:
        """Around a wait on the engine: a hang found meanwhile cuts it."""

    def watch(self, abort: Callable[[GatewayError], None]) -> int:
        """Call ``abort`` when the engine is found hung; the token is for ``unwatch``."""

    def unwatch(self, token: int) -> None: ...


# -- the access log -------------------------------------------------------------------------------------------------
class AccessLogging(Protocol):
    """``parts.access_log``: one line per guarded request (written here, or by the authority)."""

    @property
    def on(self) -> bool:
        """Whether a record would be written: off, a request notes nothing for it."""

    def write(self, record: AccessRecord) -> None:
        """Write one request's record, without blocking the event loop."""

    def write_lines(self, text: str) -> None:
        """Write lines a worker formatted (the authority writes every process's), without blocking the loop."""
