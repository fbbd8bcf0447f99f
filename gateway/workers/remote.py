"""A worker process's admission and tenant limits: the authority's, asked over its channel.

The request path (``guard/pipeline.py``) is the same in every process; in a worker its ``parts.admission`` and
``parts.tenants`` are these stand-ins. A reservation is entered with one ``admit`` message (the tenant's charge
rides along the first time) and answered ``admitted`` or ``refused``; its progress goes out batched
(``progress``, every ``PROGRESS_EVERY`` seconds, only what changed); its release and the tenant's settlement
are one message each. A request whose client leaves while it waits in the queue is withdrawn. If the authority
goes away the worker can admit nothing: its requests get 503 and it stops (the authority restarts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from gateway.admission.ledger import fit_output
from gateway.admission.reservation import Target
from gateway.config import Settings
from gateway.errors import GatewayError, UpstreamUnavailable
from gateway.guard.parts import Parts
from gateway.metrics import Metrics
from gateway.observe.access_log import FIELDS, AccessLog, AccessLogFormat, AccessRecord
from gateway.tenants import Tenants
from gateway.workers.channel import Channel, Message
from gateway.workers.messages import error_from_json, prefix_to_json
from gateway.workers.metrics_merge import families_of
from gateway.workers.mirror import Mirror, SupervisorMirror, apply_state

log = logging.getLogger(__name__)

_UNTOLD = object()
PROGRESS_EVERY = 0.05  # seconds: what a worker's streams generated reaches the authority this often


class AuthorityClient:
    """The worker's one channel to the authority."""

    def __init__(self, parts: Parts, settings: Settings) -> None:
        self.parts = parts
        self.settings = settings
        self.mirror = Mirror()
        self.supervisors: list[SupervisorMirror] = []
        self.channel = Channel(self._on_message, self._on_lost)
        self.state_seen = asyncio.Event()
        self.lost = asyncio.Event()
        self._replies: dict[str, asyncio.Future[Message]] = {}
        self._tokens: dict[str, int] = {}
        self._engines: dict[int, list[int]] = {}  # engine -> [opened - closed, chunks, answers] since last sent
        self._flusher: asyncio.Task[None] | None = None
        self._told: dict[int, object] = {}  # engine -> the fingerprint the authority was told

    async def connect(self, path: str) -> None:
        await asyncio.get_running_loop().create_unix_connection(lambda: self.channel, path)
        await asyncio.wait_for(self.state_seen.wait(), 30)
        self._flusher = asyncio.get_running_loop().create_task(self._flush_progress(), name="worker-progress")

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        self.channel.close()

    # -- requests -------------------------------------------------------------------------------------
    async def admit(self, rid: str, booking: dict[str, Any], charge: dict[str, Any] | None) -> Message:
        if self.lost.is_set():
            raise _authority_gone()
        waiter = self._replies[rid] = asyncio.get_running_loop().create_future()
        self.channel.send({"type": "admit", "id": rid, "booking": booking, "charge": charge})
        try:
            reply: Message = await waiter
            return reply
        except asyncio.CancelledError:
            self.channel.send({"type": "withdraw", "id": rid})  # the client left while it waited
            raise
        finally:
            self._replies.pop(rid, None)

    def progress(self, rid: str, generated: int) -> None:
        self._tokens[rid] = generated

    def engine_moved(self, engine: int, opened: int = 0, chunks: int = 0, answers: int = 0) -> None:
        counts = self._engines.get(engine)
        if counts is None:
            counts = self._engines[engine] = [0, 0, 0]
        counts[0] += opened
        counts[1] += chunks
        counts[2] += answers

    def send(self, message: Message) -> None:
        self.channel.send(message)

    async def _flush_progress(self) -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY)
            try:
                self.flush()
            except Exception:  # the flusher must never die: the authority would stop seeing this process's streams
                log.exception("telling the authority this worker's progress failed")

    def flush(self) -> None:
        learned = self._fingerprints()
        if not self._tokens and not self._engines and not learned:
            return
        tokens, self._tokens = self._tokens, {}
        engines, self._engines = self._engines, {}
        self.channel.send({"type": "progress", "tokens": tokens, "engines": engines, "fingerprints": learned})

    def _fingerprints(self) -> dict[int, str | None]:
        """The engines' ``system_fingerprint``s this process learned and the authority was not told yet: it tells
        every worker, whose first streams then need not hold their choices' ends for it (``engine/usage.py``)."""
        learned: dict[int, str | None] = {}
        for i, engine in enumerate(self.parts.every_engine()):
            fingerprint = engine.fingerprint
            if fingerprint.known and self._told.get(i, _UNTOLD) != fingerprint.value:
                learned[i] = self._told[i] = fingerprint.value
        return learned

    # -- from the authority ------------------------------------------------------------------------------
    def _on_message(self, msg: Message) -> None:
        kind = msg.get("type")
        if kind in ("admitted", "refused"):
            waiter = self._replies.get(str(msg["id"]))
            if waiter is not None and not waiter.done():
                waiter.set_result(msg)
        elif kind == "state":
            apply_state(self.parts, self.mirror, self.supervisors, msg["state"])
            self.state_seen.set()
        elif kind == "metrics":
            self.channel.send({"type": "metrics_reply", "ask": msg["ask"], "families": families_of(self.parts)})

    def _on_lost(self) -> None:
        self.lost.set()
        for waiter in self._replies.values():
            if not waiter.done():
                waiter.set_exception(_authority_gone())


def _authority_gone() -> UpstreamUnavailable:
    return UpstreamUnavailable("This gateway worker lost its admission authority; retry shortly.", retry_after=1)


class RemoteReservation:
    """A reservation held at the authority: what the request path reads and tells of it."""

    __slots__ = ("_client", "_released", "booking", "generated", "min_output", "queue_ms", "request_id", "target")

    def __init__(self, client: AuthorityClient, booking: dict[str, Any]) -> None:
        self._client = client
        self.booking = booking
        self.request_id = str(booking["request_id"])
        self.min_output = int(booking.get("min_output", 0))
        self.target: Target | None = None
        self.generated = 0
        self.queue_ms = 0.0
        self._released = True  # until admitted

    def observe_output_tokens(self, generated: int) -> None:
        if generated > self.generated:
            self.generated = generated
            self._client.progress(self.request_id, generated)

    def admitted(self, reply: Message) -> None:
        target = reply.get("target")
        self.target = None if target is None else Target(str(target[2]), int(target[0]), target[1])
        self.queue_ms = float(reply.get("waited_ms", 0.0))
        self._released = False

    def release(self, *, completed: bool = True) -> None:
        if self._released:
            return
        self._released = True
        self._client.send({
            "type": "release", "id": self.request_id, "completed": completed, "generated": self.generated,
        })


class RemoteAdmission:
    """``parts.admission`` in a worker: reservations held at the authority, ``fit`` from its capacity."""

    def __init__(self, client: AuthorityClient, settings: Settings) -> None:
        self._client = client
        self._settings = settings

    def reservation(self, *, request_id: str, prefix: Any = None, avoid: frozenset[str] = frozenset(),
                    **booking: Any) -> RemoteReservation:
        booking.update(request_id=request_id, prefix=prefix_to_json(prefix), avoid=sorted(avoid))
        return RemoteReservation(self._client, booking)

    def fit(self, prompt_tokens: int, max_tokens: int, n: int, *, clamp: bool, prefix_known: bool = False) -> int:
        mirror = self._client.mirror
        cap = mirror.capacity
        return max_tokens if cap is None else fit_output(
            prompt_tokens, max_tokens, n, cap, self._settings.kv_target, clamp=clamp,
            shared=mirror.sharing and prefix_known,
        )

    def budget_blocks(self) -> int | None:
        return None  # the tenant's share is held at the authority


class RemoteGrant:
    """A tenant's charge for one request, made at the authority with its first admission."""

    def __init__(self, client: AuthorityClient, charge: dict[str, Any] | None) -> None:
        self._client = client
        self._charge = charge
        self._rid: str | None = None
        self.headers: dict[str, str] = {}

    def raise_if_refused(self) -> None:
        """Refusals come with the admission (``admit``)."""

    def admit(self, booked: RemoteReservation, budget: Callable[[], int | None]) -> Any:
        return self._admit(booked)

    @contextlib.asynccontextmanager
    async def _admit(self, booked: RemoteReservation) -> AsyncIterator[float]:
        charge, self._charge = self._charge, None  # charged once, with the first admission
        self._rid = booked.request_id
        reply = await self._client.admit(booked.request_id, booked.booking, charge)
        self.headers = dict(reply.get("headers") or {})
        if reply["type"] == "refused":
            error = reply.get("error")
            raise error_from_json(error) if error is not None else UpstreamUnavailable(
                "The gateway's admission failed; retry shortly.", retry_after=1
            )
        booked.admitted(reply)
        try:
            yield booked.queue_ms
        finally:
            booked.release(completed=False)  # a no-op once the request path released it

    def settle(self, queue_ms: float) -> None:
        if self._rid is not None:
            self._client.send({"type": "end", "id": self._rid, "queue_ms": queue_ms})
            self._rid = None


class ForwardedAccessLog(AccessLog):
    """A worker's access log: each record goes to the authority, which writes every process's lines."""

    def __init__(self, fmt: AccessLogFormat, client: AuthorityClient) -> None:
        super().__init__(fmt)
        self._client = client

    @property
    def on(self) -> bool:
        return self.fmt != "off"

    def write(self, record: AccessRecord) -> None:
        if self.fmt != "off":
            self._client.send({"type": "access", "record": {name: _json_int(getattr(record, name)) for name in FIELDS}})


def _json_int(value: object) -> object:
    """A client's integer beyond what JSON carries exactly (``max_tokens`` 10^30) as its digits."""
    if isinstance(value, int) and not -(2**63) <= value < 2**63:
        return {"int": str(value)}
    return value


class RemoteUsage:
    def __init__(self, client: AuthorityClient) -> None:
        self._client = client

    def rejected(self, tenant: str, reason: str) -> None:
        self._client.send({"type": "rejected", "tenant": tenant, "reason": reason})


class RemoteTenants(Tenants):
    """The worker's tenants: its keys (read from the keys file here, for authentication), its limits the
    authority's."""

    def __init__(self, settings: Settings, metrics: Metrics, client: AuthorityClient) -> None:
        super().__init__(settings.model_copy(update={"redis_url": None}), metrics)
        self._client = client
        self.usage = RemoteUsage(client)  # type: ignore[assignment]

    async def check(self, tenant_name: str, *, prompt_tokens: int, output_tokens: int) -> Any:
        charge = {"tenant": tenant_name, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}
        return RemoteGrant(self._client, charge)


__all__ = ["AuthorityClient", "GatewayError", "RemoteAdmission", "RemoteTenants"]
