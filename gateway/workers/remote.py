"""A worker process's admission and tenant limits: the authority's, asked over its channel.

The request path (``guard/pipeline.py``) is the same in every process; in a worker its ``parts.admission`` and
``parts.tenants`` are these stand-ins. Each request gets a key of this worker's making (``AuthorityClient.key``)
that names it on the channel; the client's ``x-request-id`` is only its label. A reservation is entered with one
``Admit`` (the tenant's charge rides along until the authority has seen the request) and answered ``Admitted``
or ``Refused``; its progress goes out batched (``Progress``, every ``PROGRESS_EVERY`` seconds, only what
changed); its release and the tenant's settlement are one message each.

Every wait on the authority is bounded: by the request's own limit (its deadline, else ``--queue-timeout``) and
``ANSWER_GRACE``, or twice the limit while the authority is heard from (a tenant's KV share is waited for before
the queue, each within the limit). A request given up on, or whose client left, is withdrawn, so that an
authority that answers later frees what it held for it. An authority that says nothing at all
(``liveness.py``) gets no new requests: they are refused at once with 503 and ``Retry-After``. If the authority
goes away the worker can admit nothing: its requests get 503 and it stops (the authority restarts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from gateway.admission.destination import Destination
from gateway.admission.ledger import fit_output
from gateway.config import Settings
from gateway.errors import UpstreamUnavailable
from gateway.guard.parts import Parts
from gateway.metrics import Metrics
from gateway.periodic import Periodic
from gateway.tenants import KeyDirectory, Tenant, Tenants
from gateway.workers.channel import Channel
from gateway.workers.liveness import CODE, Liveness
from gateway.workers.messages import (
    Admit,
    Admitted,
    Alive,
    Booking,
    Charge,
    End,
    Message,
    MetricsAsk,
    MetricsReply,
    Progress,
    Refused,
    Rejected,
    Release,
    State,
    Withdraw,
    crossing_prefix,
    error_of,
)
from gateway.workers.metrics_merge import families_of
from gateway.workers.mirror import Mirror, SupervisorMirror, apply_state

log = logging.getLogger(__name__)

_UNTOLD = object()
PROGRESS_EVERY = 0.05  # seconds: what a worker's streams generated reaches the authority this often
# Seconds past a request's own limit that the authority is given to say so itself (its QueueTimeout is exact).
ANSWER_GRACE = 1.0


class AuthorityClient:
    """The worker's one channel to the authority."""

    def __init__(self, parts: Parts, settings: Settings) -> None:
        self.parts = parts
        self.settings = settings
        self.mirror = Mirror()
        self.supervisors: list[SupervisorMirror] = []
        self.channel = Channel(self._on_message, self._on_lost, self._send_releases)
        loop = asyncio.get_running_loop()
        self.liveness = Liveness(lambda: self.channel.heard_at, loop.time, self._refuse_waiting)
        self.state_seen = asyncio.Event()
        self.lost = asyncio.Event()
        self._keys = itertools.count(1)
        self._known: set[int] = set()  # keys the authority was told of and not yet told the end of
        # Releases held back until this iteration's write, so that a request's end in the same iteration carries
        # its release (one frame, ``End.released``; the authority decodes and handles one frame less a short chat).
        self._releasing: dict[int, Release] = {}
        self._replies: dict[int, asyncio.Future[Admitted | Refused]] = {}
        self._tokens: dict[int, int] = {}
        self._first: dict[int, float] = {}  # key -> its first token's time, until a Progress or its Release tells it
        self.clock = time.monotonic  # times a request's first token from its write (``RemoteReservation``)
        self._engines: dict[int, list[int]] = {}  # engine -> [opened - closed, chunks, answers] since last sent
        # The flusher must never die: the authority would stop seeing this process's streams.
        self._progress = Periodic(
            self.flush, PROGRESS_EVERY, name="worker-progress", immediately=False,
            failed="telling the authority this worker's progress failed", logger=log,
        )
        self._told: dict[int, object] = {}  # engine -> the fingerprint the authority was told

    async def connect(self, path: str) -> None:
        loop = asyncio.get_running_loop()
        await loop.create_unix_connection(lambda: self.channel, path)
        await asyncio.wait_for(self.state_seen.wait(), 30)
        self._progress.start()
        self.liveness.start()

    async def close(self) -> None:
        await self._progress.stop()
        await self.liveness.stop()
        self.channel.close()

    # -- requests -------------------------------------------------------------------------------------
    def key(self) -> int:
        """A new request's name on the channel: unique on it, whatever ids the clients send."""
        return next(self._keys)

    def refusal(self) -> UpstreamUnavailable | None:
        """Why nothing can wait on the authority now (gone, or silent), or None."""
        if self.lost.is_set():
            return _authority_gone()
        if self.liveness.silent:
            return self.liveness.refusal()
        return None

    def _refuse_waiting(self) -> None:
        """The authority fell silent: the requests waiting on it are refused now (each withdraws its admit, so a
        thawed authority frees what it held for them)."""
        for waiter in self._replies.values():
            if not waiter.done():
                waiter.set_exception(self.liveness.refusal())

    def knows(self, key: int) -> bool:
        return key in self._known

    async def admit(self, key: int, booking: Booking, charge: Charge | None) -> Admitted | Refused:
        refusal = self.refusal()
        if refusal is not None:
            raise refusal
        waiter = self._replies[key] = asyncio.get_running_loop().create_future()
        self._known.add(key)
        held = self._releasing.pop(key, None)
        if held is not None:  # a failover's second attempt: the first one's release goes first
            self.channel.send(held)
        self.channel.send(Admit(key, booking, charge))
        try:
            return await self._answer(waiter, booking)
        except BaseException:  # the client left, or the wait was given up: the authority frees what it holds
            self.channel.send(Withdraw(key))
            raise
        finally:
            self._replies.pop(key, None)

    async def _answer(self, waiter: asyncio.Future[Admitted | Refused], booking: Booking) -> Admitted | Refused:
        q = self.settings.queue_timeout
        limit = min(booking.deadline, q) if booking.deadline is not None and booking.deadline > 0 else q
        done, _ = await asyncio.wait((waiter,), timeout=limit + ANSWER_GRACE)
        if not done and not self.liveness.silent:
            done, _ = await asyncio.wait((waiter,), timeout=limit)  # a tenant's KV share, then the queue
        if not done:
            if self.liveness.silent:
                raise self.liveness.refusal()
            raise UpstreamUnavailable(
                f"This gateway worker's admission authority did not answer within {2 * limit + ANSWER_GRACE:g} s "
                f"(the request's limit: {limit:g} s, its deadline or --queue-timeout). Retry shortly.",
                code=CODE, retry_after=1,
            )
        return waiter.result()

    def release(self, message: Release) -> None:
        """Give back a request's reservation: with this iteration's write, folded into its ``End`` if that comes
        first (``_send_releases``)."""
        self._releasing[message.key] = message
        self.channel.wake()

    def _send_releases(self) -> None:
        """The releases no ``End`` took up, as this iteration's write goes out."""
        if self._releasing:
            releases, self._releasing = self._releasing, {}
            for message in releases.values():
                self.channel.send(message)

    def end(self, key: int, queue_ms: float) -> None:
        """The request is over: the authority settles its tenant and forgets it (and gives back its reservation,
        if it was released in this iteration)."""
        if key in self._known:
            self._known.discard(key)
            held = self._releasing.pop(key, None)
            released = None if held is None else (held.completed, held.generated, held.first)
            self.channel.send(End(key, queue_ms, released))

    def progress(self, key: int, generated: int, first: float | None = None) -> None:
        self._tokens[key] = generated
        if first is not None:
            self._first[key] = first

    def released(self, key: int, completed: bool, generated: int) -> Release:
        """A request's release, with its first token's time where no progress told it yet."""
        return Release(key, completed, generated, self._first.pop(key, None))

    def engine_moved(self, engine: int, opened: int = 0, chunks: int = 0, answers: int = 0) -> None:
        counts = self._engines.get(engine)
        if counts is None:
            counts = self._engines[engine] = [0, 0, 0]
        counts[0] += opened
        counts[1] += chunks
        counts[2] += answers

    def send(self, message: Message) -> None:
        self.channel.send(message)

    def flush(self) -> None:
        learned = self._fingerprints()
        if not self._tokens and not self._engines and not learned:
            return
        tokens, self._tokens = self._tokens, {}
        engines, self._engines = self._engines, {}
        first, self._first = self._first, {}
        moves = {i: (c[0], c[1], c[2]) for i, c in engines.items()}
        self.channel.send(Progress(tokens, moves, learned, first))

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
        self.liveness.heard()
        if isinstance(msg, Admitted | Refused):
            waiter = self._replies.get(msg.key)
            if waiter is not None and not waiter.done():
                waiter.set_result(msg)
        elif isinstance(msg, State):
            apply_state(self.parts, self.mirror, self.supervisors, msg)
            self.state_seen.set()
        elif isinstance(msg, MetricsAsk):
            self.channel.send(MetricsReply(msg.ask, tuple(families_of(self.parts))))
        elif not isinstance(msg, Alive):
            log.error("a message the authority does not send: %s", type(msg).__name__)

    def _on_lost(self) -> None:
        self.lost.set()
        for waiter in self._replies.values():
            if not waiter.done():
                waiter.set_exception(_authority_gone())


def _authority_gone() -> UpstreamUnavailable:
    return UpstreamUnavailable("This gateway worker lost its admission authority; retry shortly.", retry_after=1)


class RemoteReservation:
    """A reservation held at the authority: what the request path reads and tells of it."""

    __slots__ = ("_client", "_released", "_sent_at", "booking", "generated", "key", "min_output", "queue_ms",
                 "request_id", "target")

    def __init__(self, client: AuthorityClient, booking: Booking) -> None:
        self._client = client
        self.booking = booking
        self.key = 0  # the request's, set by its grant before the admission
        self.request_id = booking.request_id
        self.min_output = booking.min_output
        self.target: Destination | None = None
        self.generated = 0
        self.queue_ms = 0.0
        self._released = True  # until admitted
        self._sent_at: float | None = None  # when the request path began writing it to its engine

    def observe_output_tokens(self, generated: int, first_token_s: float | None = None) -> None:
        if generated > self.generated:
            first = None  # a first token (a whole answer only at one a choice), timed from its write
            if self.generated == 0 and generated <= self.booking.n and self._sent_at is not None:
                first = self._client.clock() - self._sent_at if first_token_s is None else first_token_s
            self.generated = generated
            self._client.progress(self.key, generated, first)

    def sent(self) -> None:
        if self._sent_at is None:
            self._sent_at = self._client.clock()

    def admitted(self, reply: Admitted) -> None:
        self.target = reply.target
        self.queue_ms = reply.waited_ms
        self._released = False

    def release(self, *, completed: bool = True) -> None:
        if self._released:
            return
        self._released = True
        self._client.release(self._client.released(self.key, completed, self.generated))


class RemoteAdmission:
    """``parts.admission`` in a worker: reservations held at the authority, ``fit`` from its capacity."""

    def __init__(self, client: AuthorityClient, settings: Settings) -> None:
        self._client = client
        self._settings = settings

    def reservation(self, *, prompt_tokens: int, max_tokens: int, n: int = 1, priority: int = 0,
                    request_id: str = "", tenant: str = "default", weight: float = 1.0, prefix: Any = None,
                    avoid: frozenset[str] = frozenset(), family: str = "", deadline: float | None = None,
                    min_output: int = 0, objective: float | None = None) -> RemoteReservation:
        booking = Booking(request_id, prompt_tokens, max_tokens, n, priority, tenant, weight, crossing_prefix(prefix),
                          tuple(sorted(avoid)), family, deadline, objective, min_output)
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
    """A tenant's charge for one request, made at the authority with its first admission; the request's key."""

    def __init__(self, client: AuthorityClient, charge: Charge | None) -> None:
        self._client = client
        self._charge = charge
        self.key = client.key()
        self.headers: dict[str, str] = {}

    def raise_if_refused(self) -> None:
        """Refusals come with the admission (``admit``)."""

    def admit(self, booked: RemoteReservation, budget: Callable[[], int | None]) -> Any:
        return self._admit(booked)

    @contextlib.asynccontextmanager
    async def _admit(self, booked: RemoteReservation) -> AsyncIterator[float]:
        booked.key = self.key
        # Charged with the first admission the authority sees; a failover's second is the same request.
        charge = None if self._client.knows(self.key) else self._charge
        reply = await self._client.admit(self.key, booked.booking, charge)
        self.headers = dict(reply.headers)
        if isinstance(reply, Refused):
            raise error_of(reply.error) if reply.error is not None else UpstreamUnavailable(
                "The gateway's admission failed; retry shortly.", retry_after=1
            )
        booked.admitted(reply)
        try:
            yield booked.queue_ms
        finally:
            booked.release(completed=False)  # a no-op once the request path released it

    def settle(self, queue_ms: float) -> None:
        self._client.end(self.key, queue_ms)


class RemoteUsage:
    def __init__(self, client: AuthorityClient) -> None:
        self._client = client

    def rejected(self, tenant: str, reason: str) -> None:
        self._client.send(Rejected(tenant, reason))


class RemoteTenants:
    """The worker's tenants (``seams.TenantLimits``): its keys read from the keys file here, for authentication;
    its limits the authority's (``check`` makes a grant that charges there, with the request's first admission)."""

    def __init__(self, settings: Settings, metrics: Metrics, client: AuthorityClient) -> None:
        # The keys file and its reload, nothing more: the windows (and Redis) are the authority's.
        self._keys = Tenants(settings.model_copy(update={"redis_url": None}), metrics)
        self._client = client
        self.usage = RemoteUsage(client)

    @property
    def directory(self) -> KeyDirectory:
        return self._keys.directory

    def identify(self, digest: bytes) -> Tenant | None:
        return self._keys.identify(digest)

    def tenant(self, name: str) -> Tenant:
        return self._keys.tenant(name)

    async def start(self) -> None:
        await self._keys.start()

    async def close(self) -> None:
        await self._keys.close()

    async def check(self, tenant_name: str, *, prompt_tokens: int, output_tokens: int) -> RemoteGrant:
        return RemoteGrant(self._client, Charge(tenant_name, prompt_tokens, output_tokens))


__all__ = ["AuthorityClient", "RemoteAdmission", "RemoteTenants"]
