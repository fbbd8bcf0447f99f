"""The admission authority's side of the workers: one coherent admission for every process that serves.

With ``--workers N`` the main process is the admission authority: it holds the one ``Admission`` (KV books,
queue, projection, forecast, preemption budget) and the one ``Tenants`` (windows, shares, usage) for its engine
set, and serves requests itself like any worker. Each other worker connects over a Unix socket (``Channel``)
and, per request, asks here what one process would have asked itself (``messages.py``):

    Admit {key, booking, tenant charge}  ->  Admitted {key, target, waited, headers} | Refused {key, error, headers}
    Progress {key: tokens, ...}, per engine {streams opened/closed, chunks, answers}   (batched, ~20 a second)
    Release {key, completed, generated}  ->  the blocks go back, the tenant is settled on End {key, queue_ms}
    End {key, queue_ms, released}        ->  both at once, where the release and the end left in one write

A request is named by the worker's key, unique on its channel; the client's ``x-request-id`` is only the
reservation's label, so two requests that carry the same id (a retry reusing it) are two requests here, each
charged to its tenant and each released. Nothing crosses per token: a worker's progress is batched. Each request
holds the real reservation and tenant grant here (``holding.Attempt``: most are charged and admitted as their
``Admit`` arrives and released by their ``Release``, without a task; one that waits, for the queue, a tenant's KV
share or Redis, is a task holding them with ``async with``), so the rules of one process hold across all of
them: the ledger never commits past the budget, the queue's order and fair shares see every request, tenants'
limits are counted once per request. A worker that dies closes its channel: every request it
held is released (not completed) and settled at once, its queued requests leave the queue, and its streams
leave the engines' view (the hang detectors count only the streams still open).

The authority also tells every worker what the request path reads of the engines (``State``): whether each is
hung, each managed engine's lifecycle state and URL, the engines' model listings and the KV capacity that
clamps ``max_tokens`` (``workers/mirror.py`` applies it); it sends a heartbeat (``Alive``) every
``ALIVE_EVERY`` seconds, whose absence tells a worker that the authority is frozen (``liveness.py``), and asks
the workers for their metrics when ``/metrics`` is read and every ``SNAPSHOT_EVERY`` seconds
(``metrics_merge.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from gateway.admission.controller import Admission
from gateway.admission.reservation import Reservation
from gateway.errors import GatewayError
from gateway.guard.parts import Parts
from gateway.guard.seams import Granted
from gateway.periodic import Periodic
from gateway.tenants import Grant, Tenants
from gateway.workers.channel import Channel
from gateway.workers.holding import Attempt, HeldRequest, booked
from gateway.workers.messages import (
    ALIVE_EVERY,
    Access,
    Admit,
    Admitted,
    Alive,
    Charge,
    End,
    Message,
    MetricsAsk,
    MetricsReply,
    Progress,
    Refused,
    Rejected,
    Release,
    Serving,
    State,
    Withdraw,
    error_data,
)
from gateway.workers.metrics_merge import SNAPSHOT_EVERY, WorkerCounts
from gateway.workers.mirror import state_of

log = logging.getLogger(__name__)

# Seconds between checks of the state the workers mirror (sent only when it changed). What changes it tells the
# authority at once (``Authority.start``: an engine's scrape, hang, health and first usage chunk, a managed engine's
# lifecycle), so this check is the net for the rest: a managed engine's Retry-After counting down, a models
# listing fetched outside a scrape. Checked alone 20 times a second, it was a quarter of an idle authority's CPU
# apart from its workers (16-17 ms a second, each check building the state from caches its sleep left cold; 10-12
# with these pushes and 4 checks a second, 11-13 with 2: docs/overhead.md).
STATE_EVERY = 0.25
_ALIVE_TICKS = round(ALIVE_EVERY / STATE_EVERY)
_SNAPSHOT_TICKS = round(SNAPSHOT_EVERY / STATE_EVERY)


class WorkerLink:
    """One worker's channel and the requests it holds here."""

    def __init__(self, parts: Parts, authority: Authority) -> None:
        self.parts = parts
        self.authority = authority
        self.requests: dict[int, HeldRequest] = {}  # by the worker's key
        self.channel = Channel(self._on_message, self._on_lost)
        self._tasks: set[asyncio.Task[None]] = set()  # every admission's, cancelled when the worker goes
        self._opened: dict[int, int] = {}  # engine -> the worker's streams open on it, as it reported them
        self._metrics: dict[int, asyncio.Future[Any]] = {}
        self._asks = itertools.count(1)
        self.serving = False  # the worker listens on the port (it said so once its server had started)

    # -- messages -------------------------------------------------------------------------------------
    def _on_message(self, msg: Message) -> None:
        handler = _HANDLERS.get(type(msg))
        if handler is None:
            log.error("a message a worker does not send: %s", type(msg).__name__)
            return
        handler(self, msg)

    def _admit(self, msg: Admit) -> None:
        attempt = Attempt()
        held = self.requests.get(msg.key)
        if held is None:
            held = self.requests[msg.key] = HeldRequest(attempt)
        else:
            held.attempt.drop()  # a worker admits a request again only once it released it: never two
            held.attempt = attempt
        if not self._admit_now(msg, held, attempt):
            self._spawn(attempt, self._serve(msg, held, attempt), "worker-admit")

    def _admit_now(self, msg: Admit, held: HeldRequest, attempt: Attempt) -> bool:
        """Most admissions, without a task of their own (a task per request, its context managers and wake-up cost
        12 us of the 152 the authority spent on a short chat's four messages, measured in-process): the tenant
        charged here, the request admitted as it arrives, or queued and waited for by a task. False where it must
        first wait for something else (Redis's windows, a tenant's KV share, a long prompt's hashing): ``_serve``'s."""
        admission, key = self.parts.admission, msg.key
        try:
            if held.grant is None:  # the request's first admission: charged to its tenant, whatever its id
                charged = self._charge_now(msg.charge)
                if charged is None:
                    return False
                held.grant = charged
                charged.raise_if_refused()
            grant = held.grant
            if not isinstance(admission, Admission) or not isinstance(grant, Grant) or \
                    not grant.plain(admission.budget_blocks):
                return False
            reservation = admission.reservation(**booked(msg.booking))
            if reservation.hashes_off_loop(admission.sharing):
                return False
            if admission.arrive(reservation):
                self._admitted(key, grant, attempt, reservation)
            else:
                self._spawn(attempt, self._queued(key, grant, attempt, reservation), "worker-queued")
        except GatewayError as exc:
            self.channel.send(Refused(key, error_data(exc), dict(held.grant.headers) if held.grant else {}))
        except Exception:
            log.exception("admitting a worker's request failed")
            self.channel.send(Refused(key, None, {}))
        return True

    def _admitted(self, key: int, grant: Grant, attempt: Attempt, reservation: Reservation) -> None:
        attempt.reservation = reservation
        grant.entered(reservation)
        self.channel.send(Admitted(key, reservation.queue_ms, dict(grant.headers), reservation.target))

    async def _queued(self, key: int, grant: Grant, attempt: Attempt, reservation: Reservation) -> None:
        """Wait for a reservation ``_admit_now`` queued; once admitted, nothing holds it but ``attempt``."""
        try:
            await reservation.wait()
        except GatewayError as exc:
            self.channel.send(Refused(key, error_data(exc), dict(grant.headers)))
            return
        except asyncio.CancelledError:  # withdrawn by the worker, or the worker gone
            reservation.release(completed=False)
            return
        self._admitted(key, grant, attempt, reservation)

    def _spawn(self, attempt: Attempt, work: Coroutine[Any, Any, None], name: str) -> None:
        task = attempt.task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _charge_now(self, charge: Charge | None) -> Granted | None:
        tenants = self.parts.tenants
        if tenants is None or charge is None:
            return Grant.unlimited()
        if isinstance(tenants, Tenants):
            return tenants.check_now(charge.tenant, prompt_tokens=charge.prompt_tokens,
                                     output_tokens=charge.output_tokens)
        return None

    async def _serve(self, msg: Admit, held: HeldRequest, attempt: Attempt) -> None:
        parts, key = self.parts, msg.key
        done = attempt.done = asyncio.Event()  # released by the worker (or the worker gone)
        try:
            if held.grant is None:  # the request's first admission: charged to its tenant, whatever its id
                held.grant = await self._charge(msg.charge)
                held.grant.raise_if_refused()
            reservation = parts.admission.reservation(**booked(msg.booking))
            async with held.grant.admit(reservation, parts.admission.budget_blocks) as waited_ms:
                attempt.reservation = reservation
                self.channel.send(Admitted(key, waited_ms, dict(held.grant.headers), reservation.target))
                await done.wait()
                reservation.observe_output_tokens(attempt.generated)
                reservation.release(completed=attempt.completed)
        except GatewayError as exc:
            headers = dict(held.grant.headers) if held.grant is not None else {}
            self.channel.send(Refused(key, error_data(exc), headers))
        except asyncio.CancelledError:
            pass  # withdrawn by the worker, or the worker gone: ``async with`` gave everything back
        except Exception:
            log.exception("admitting a worker's request failed")
            self.channel.send(Refused(key, None, {}))

    async def _charge(self, charge: Charge | None) -> Granted:
        tenants = self.parts.tenants
        if tenants is None or charge is None:
            return Grant.unlimited()
        return await tenants.check(
            charge.tenant, prompt_tokens=charge.prompt_tokens, output_tokens=charge.output_tokens
        )

    def _withdraw(self, msg: Withdraw) -> None:
        held = self.requests.get(msg.key)
        if held is not None:  # it gave up waiting: what an answer crossing this held goes back too
            held.attempt.drop()

    def _progress(self, msg: Progress) -> None:
        for key, tokens in msg.tokens.items():
            held = self.requests.get(key)
            if held is not None and held.attempt.reservation is not None:
                held.attempt.reservation.observe_output_tokens(tokens, msg.first.get(key))
        engines = self.parts.every_engine()
        for index, value in msg.fingerprints.items():
            if 0 <= index < len(engines):
                engines[index].fingerprint.learn(value)
        for index, (opened, chunks, answers) in msg.engines.items():
            if 0 <= index < len(engines):
                engines[index].progress.note_remote(opened, chunks, answers)
                self._opened[index] = self._opened.get(index, 0) + opened

    def _release(self, msg: Release) -> None:
        held = self.requests.get(msg.key)
        if held is not None:
            _give_back(held, msg.completed, msg.generated, msg.first)

    def _end(self, msg: End) -> None:
        held = self.requests.pop(msg.key, None)
        if held is None:
            return
        if msg.released is not None:  # its release, folded in
            _give_back(held, *msg.released)
        if held.attempt.done is not None:
            held.attempt.done.set()  # its task releases what it still holds
        else:
            held.attempt.drop()  # a no-op once released
        if held.grant is not None:
            held.grant.settle(msg.queue_ms)

    def _access(self, msg: Access) -> None:
        """A worker's requests ended: their access-log lines, formatted there, are written here with every
        process's."""
        self.parts.access_log.write_lines(msg.lines)

    def _rejected(self, msg: Rejected) -> None:
        tenants = self.parts.tenants
        if tenants is not None:
            tenants.usage.rejected(msg.tenant, msg.reason)

    def _serving(self, msg: Serving) -> None:
        self.serving = True

    def _metrics_reply(self, msg: MetricsReply) -> None:
        families = list(msg.families)
        self.authority.counts.seen(self, families)
        waiter = self._metrics.pop(msg.ask, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(families)

    # -- asked of the worker -------------------------------------------------------------------------
    async def metrics(self, timeout: float) -> Any:
        ask = next(self._asks)
        waiter = self._metrics[ask] = asyncio.get_running_loop().create_future()
        self.channel.send(MetricsAsk(ask))
        try:
            return await asyncio.wait_for(waiter, timeout)
        finally:
            self._metrics.pop(ask, None)

    def _on_lost(self) -> None:
        """The worker is gone: what it held goes back (not completed), its tenants are settled, its streams leave
        the engines' view."""
        self.authority.links.discard(self)
        self.authority.counts.lost(self)  # its counters stay in /metrics: they never go backwards
        for task in list(self._tasks):
            task.cancel()
        for held in self.requests.values():
            held.attempt.drop()
            if held.grant is not None:
                held.grant.settle(0.0)
        self.requests.clear()
        engines = self.parts.every_engine()
        for index, opened in self._opened.items():
            if opened:  # ended with it (the engine aborts them as their connections close); counted on, they
                # would be work for good, and an idle engine probed, and judged hung on one failed probe
                engines[index].progress.note_remote(-opened, 0, 0)
        self._opened.clear()
        for waiter in self._metrics.values():
            if not waiter.done():
                waiter.set_result([])


def _give_back(held: HeldRequest, completed: bool, generated: int, first: float | None) -> None:
    """A worker released the request's reservation: its blocks go back now, before any task wakes."""
    attempt = held.attempt
    attempt.completed, attempt.generated = completed, generated
    if attempt.reservation is not None:
        attempt.reservation.observe_output_tokens(generated, first)
        attempt.reservation.release(completed=completed)
    if attempt.done is not None:
        attempt.done.set()


_HANDLERS: dict[type, Callable[[WorkerLink, Any], None]] = {
    Admit: WorkerLink._admit,
    Withdraw: WorkerLink._withdraw,
    Progress: WorkerLink._progress,
    Release: WorkerLink._release,
    End: WorkerLink._end,
    Rejected: WorkerLink._rejected,
    MetricsReply: WorkerLink._metrics_reply,
    Serving: WorkerLink._serving,
    Access: WorkerLink._access,
}


class Authority:
    """The Unix socket the workers connect to, and what it keeps telling them."""

    def __init__(self, parts: Parts, path: Path) -> None:
        self.parts = parts
        self.path = path
        self.links: set[WorkerLink] = set()
        self._server: asyncio.AbstractServer | None = None
        # It must never die: the workers would take its silence for a freeze.
        self._pushing = Periodic(
            self._tell_workers, STATE_EVERY, name="workers-state",
            failed="telling the workers this authority lives failed", logger=log,
        )
        self._ticks = itertools.count()
        self._state: State | None = None
        self.counts = WorkerCounts()  # each worker's newest metrics, and the dead workers' counters

    async def start(self) -> None:
        for engine in self.parts.every_engine():
            engine.fingerprint.on_learn = self.push_now  # a worker's first streams need not wait for it
            engine.progress.on_change = engine.health.on_change = self.push_now  # a hang cut in every worker at once
            engine.view.on_snapshot(lambda old, new: self.push_now())  # after admission's: its new capacity
        for supervisor in self.parts.every_supervisor():
            supervisor.on_change(self.push_now)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._connect, str(self.path))
        self._pushing.start()

    def _connect(self) -> Channel:
        link = WorkerLink(self.parts, self)
        self.links.add(link)
        if self._state is not None:
            link.channel.send(self._state)
        return link.channel

    def _tell_workers(self) -> None:
        tick = next(self._ticks)
        self.push_now()
        for link in list(self.links):
            if tick % _ALIVE_TICKS == 0:  # its absence tells a worker that this loop is frozen
                link.channel.send(Alive())
            if tick % _SNAPSHOT_TICKS == 0:  # each worker's counts, kept should it die between two scrapes
                link.channel.send(MetricsAsk(0))

    def push_now(self) -> None:
        """Tell every worker the engines' state if it changed."""
        try:
            state = state_of(self.parts)
            if state != self._state:
                self._state = state
                for link in list(self.links):
                    link.channel.send(state)
        except Exception:
            log.exception("telling the workers the engines' state failed")

    def serving(self) -> int:
        """How many workers serve now."""
        return sum(1 for link in self.links if link.serving)

    async def worker_metrics(self, timeout: float = 2.0) -> list[Any]:
        """Every worker's metric families (``metrics_merge.families_of``) as of now, the dead ones' counters too;
        a worker that does not answer within ``timeout`` at its newest snapshot."""
        await asyncio.gather(*(link.metrics(timeout) for link in list(self.links)), return_exceptions=True)
        return self.counts.families()

    async def close(self) -> None:
        await self._pushing.stop()
        if self._server is not None:
            self._server.close()
        for link in list(self.links):
            link.channel.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
