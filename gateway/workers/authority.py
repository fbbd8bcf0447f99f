"""The admission authority's side of the workers: one coherent admission for every process that serves.

With ``--workers N`` the main process is the admission authority: it holds the one ``Admission`` (KV books,
queue, projection, forecast, preemption budget) and the one ``Tenants`` (windows, shares, usage) for its engine
set, and serves requests itself like any worker. Each other worker connects over a Unix socket (``Channel``)
and, per request, asks here what one process would have asked itself:

    admit {id, booking, tenant charge}  ->  admitted {target, waited, headers} | refused {error, headers}
    progress {id: tokens, ...}, per engine {streams opened/closed, chunks, answers}   (batched, ~20 a second)
    release {id, completed, generated}  ->  the blocks go back, the tenant is settled on end {id, queue_ms}

Nothing crosses per token: a worker's progress is batched. Each request is a task here holding the real
reservation and tenant grant (``async with``), so the rules of one process hold across all of them: the
ledger never commits past the budget, the queue's order and fair shares see every request, tenants' limits
are counted once. A worker that dies closes its channel: every request it held is released (not completed)
and settled at once, and its queued requests leave the queue.

The authority also tells every worker what the request path reads of the engines (``state``): whether each is
hung, each managed engine's lifecycle state and URL, the engines' model listings and the KV capacity that
clamps ``max_tokens`` (``workers/mirror.py`` applies it), and asks the workers for their metrics when
``/metrics`` is read (``metrics_merge.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from pathlib import Path
from typing import Any

from gateway.errors import GatewayError
from gateway.guard.parts import Parts
from gateway.observe.access_log import AccessRecord
from gateway.tenants import Grant
from gateway.workers.channel import Channel, Message
from gateway.workers.messages import error_to_json, prefix_from_json
from gateway.workers.metrics_merge import SNAPSHOT_EVERY, WorkerCounts
from gateway.workers.mirror import state_of

log = logging.getLogger(__name__)

STATE_EVERY = 0.05  # seconds between checks of the state the workers mirror (sent only when it changed)


class _Attempt:
    """One admission of a request (a request its engine failed under is admitted again, elsewhere)."""

    __slots__ = ("completed", "done", "generated", "reservation", "task")

    def __init__(self) -> None:
        self.reservation: Any = None  # while admitted
        self.task: asyncio.Task[None] | None = None
        self.done = asyncio.Event()  # released by the worker (or the worker gone)
        self.completed = False
        self.generated = 0


class _Request:
    """One worker's request as the authority holds it: its tenant grant and its admission in progress."""

    __slots__ = ("attempt", "grant")

    def __init__(self) -> None:
        self.grant: Grant | None = None
        self.attempt = _Attempt()


class WorkerLink:
    """One worker's channel and the requests it holds here."""

    def __init__(self, parts: Parts, authority: Authority) -> None:
        self.parts = parts
        self.authority = authority
        self.requests: dict[str, _Request] = {}
        self.channel = Channel(self._on_message, self._on_lost)
        self._metrics: dict[int, asyncio.Future[Any]] = {}
        self._asks = itertools.count(1)
        self.serving = False  # the worker listens on the port (it said so once its server had started)

    # -- messages -------------------------------------------------------------------------------------
    def _on_message(self, msg: Message) -> None:
        kind = msg.get("type")
        handler = _HANDLERS.get(str(kind))
        if handler is None:
            log.error("unknown message from a worker: %r", kind)
            return
        handler(self, msg)

    def _admit(self, msg: Message) -> None:
        rid = str(msg["id"])
        held = self.requests.get(rid)
        if held is None:
            held = self.requests[rid] = _Request()
        attempt = held.attempt = _Attempt()
        attempt.task = asyncio.get_running_loop().create_task(
            self._serve(rid, held, attempt, msg), name="worker-admit"
        )

    async def _serve(self, rid: str, held: _Request, attempt: _Attempt, msg: Message) -> None:
        parts, charge = self.parts, msg.get("charge")
        try:
            if held.grant is None:
                held.grant = await self._charge(charge)
                held.grant.raise_if_refused()
            reservation = parts.admission.reservation(**_reservation_kwargs(msg["booking"], rid))
            async with held.grant.admit(reservation, parts.admission.budget_blocks) as waited_ms:
                attempt.reservation = reservation
                target = reservation.target
                self.channel.send({
                    "type": "admitted", "id": rid, "waited_ms": waited_ms, "headers": held.grant.headers,
                    "target": None if target is None else [target.engine, target.rank, target.name],
                })
                await attempt.done.wait()
                reservation.observe_output_tokens(attempt.generated)
                reservation.release(completed=attempt.completed)
        except GatewayError as exc:
            headers = held.grant.headers if held.grant is not None else {}
            self.channel.send({"type": "refused", "id": rid, "error": error_to_json(exc), "headers": headers})
        except asyncio.CancelledError:
            pass  # withdrawn by the worker, or the worker gone: ``async with`` gave everything back
        except Exception:
            log.exception("admitting a worker's request failed")
            self.channel.send({"type": "refused", "id": rid, "error": None, "headers": {}})

    async def _charge(self, charge: dict[str, Any] | None) -> Grant:
        tenants = self.parts.tenants
        if tenants is None or charge is None:
            return Grant.unlimited()
        return await tenants.check(
            str(charge["tenant"]), prompt_tokens=int(charge["prompt_tokens"]),
            output_tokens=int(charge["output_tokens"]),
        )

    def _withdraw(self, msg: Message) -> None:
        held = self.requests.get(str(msg["id"]))
        if held is not None and held.attempt.task is not None:
            held.attempt.task.cancel()

    def _progress(self, msg: Message) -> None:
        for rid, tokens in msg.get("tokens", {}).items():
            held = self.requests.get(rid)
            if held is not None and held.attempt.reservation is not None:
                held.attempt.reservation.observe_output_tokens(int(tokens))
        engines = self.parts.every_engine()
        for index, value in msg.get("fingerprints", {}).items():
            if int(index) < len(engines):
                engines[int(index)].fingerprint.learn(value)
        for index, (opened, chunks, answers) in msg.get("engines", {}).items():
            i = int(index)
            if i < len(engines):
                engines[i].progress.note_remote(int(opened), int(chunks), int(answers))

    def _release(self, msg: Message) -> None:
        held = self.requests.get(str(msg["id"]))
        if held is not None:
            attempt = held.attempt
            attempt.completed = bool(msg.get("completed"))
            attempt.generated = int(msg.get("generated", 0))
            if attempt.reservation is not None:  # the blocks go back now, before the task wakes
                attempt.reservation.observe_output_tokens(attempt.generated)
                attempt.reservation.release(completed=attempt.completed)
            attempt.done.set()

    def _end(self, msg: Message) -> None:
        held = self.requests.pop(str(msg["id"]), None)
        if held is None:
            return
        held.attempt.done.set()
        if held.grant is not None:
            held.grant.settle(float(msg.get("queue_ms", 0.0)))

    def _access(self, msg: Message) -> None:
        """A worker's request ended: its access-log line is written here, with every process's."""
        fields: dict[str, Any] = {k: int(v["int"]) if isinstance(v, dict) else v for k, v in msg["record"].items()}
        self.parts.access_log.write(AccessRecord(**fields))

    def _rejected(self, msg: Message) -> None:
        tenants = self.parts.tenants
        if tenants is not None:
            tenants.usage.rejected(str(msg["tenant"]), str(msg["reason"]))

    def _serving(self, msg: Message) -> None:
        self.serving = True

    def _metrics_reply(self, msg: Message) -> None:
        self.authority.counts.seen(self, msg.get("families", []))
        waiter = self._metrics.pop(int(msg["ask"]), None)
        if waiter is not None and not waiter.done():
            waiter.set_result(msg.get("families", []))

    # -- asked of the worker -------------------------------------------------------------------------
    async def metrics(self, timeout: float) -> Any:
        ask = next(self._asks)
        waiter = self._metrics[ask] = asyncio.get_running_loop().create_future()
        self.channel.send({"type": "metrics", "ask": ask})
        try:
            return await asyncio.wait_for(waiter, timeout)
        finally:
            self._metrics.pop(ask, None)

    def _on_lost(self) -> None:
        """The worker is gone: what it held goes back (not completed), its tenants are settled."""
        self.authority.links.discard(self)
        self.authority.counts.lost(self)  # its counters stay in /metrics: they never go backwards
        for held in list(self.requests.values()):
            if held.attempt.task is not None:
                held.attempt.task.cancel()
            if held.grant is not None:
                held.grant.settle(0.0)
        self.requests.clear()
        for waiter in self._metrics.values():
            if not waiter.done():
                waiter.set_result([])


_HANDLERS = {
    "admit": WorkerLink._admit,
    "withdraw": WorkerLink._withdraw,
    "progress": WorkerLink._progress,
    "release": WorkerLink._release,
    "end": WorkerLink._end,
    "rejected": WorkerLink._rejected,
    "metrics_reply": WorkerLink._metrics_reply,
    "serving": WorkerLink._serving,
    "access": WorkerLink._access,
}


def _reservation_kwargs(booking: dict[str, Any], rid: str) -> dict[str, Any]:
    return {
        "prompt_tokens": int(booking["prompt_tokens"]), "max_tokens": int(booking["max_tokens"]),
        "n": int(booking["n"]), "priority": int(booking["priority"]), "request_id": rid,
        "tenant": str(booking["tenant"]), "weight": float(booking["weight"]),
        "prefix": prefix_from_json(booking.get("prefix")), "avoid": frozenset(booking.get("avoid", ())),
        "family": str(booking.get("family", "")), "deadline": booking.get("deadline"),
        "min_output": int(booking.get("min_output", 0)),
    }


class Authority:
    """The Unix socket the workers connect to, and what it keeps telling them."""

    def __init__(self, parts: Parts, path: Path) -> None:
        self.parts = parts
        self.path = path
        self.links: set[WorkerLink] = set()
        self._server: asyncio.AbstractServer | None = None
        self._pushing: asyncio.Task[None] | None = None
        self._state: dict[str, Any] | None = None
        self.counts = WorkerCounts()  # each worker's newest metrics, and the dead workers' counters

    async def start(self) -> None:
        for engine in self.parts.every_engine():
            engine.fingerprint.on_learn = self.push_now  # a worker's first streams need not wait for it
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._connect, str(self.path))
        self._pushing = loop.create_task(self._push_state(), name="workers-state")

    def _connect(self) -> Channel:
        link = WorkerLink(self.parts, self)
        self.links.add(link)
        if self._state is not None:
            link.channel.send({"type": "state", "state": self._state})
        return link.channel

    async def _push_state(self) -> None:
        every = round(SNAPSHOT_EVERY / STATE_EVERY)
        for tick in itertools.count():
            self.push_now()
            if tick % every == 0:  # each worker's counts, kept should it die between two scrapes
                for link in list(self.links):
                    link.channel.send({"type": "metrics", "ask": 0})
            await asyncio.sleep(STATE_EVERY)

    def push_now(self) -> None:
        """Tell every worker the engines' state if it changed."""
        try:
            state = state_of(self.parts)
        except Exception:
            log.exception("telling the workers the engines' state failed")
            return
        if state != self._state:
            self._state = state
            for link in list(self.links):
                link.channel.send({"type": "state", "state": state})

    def serving(self) -> int:
        """How many workers serve now."""
        return sum(1 for link in self.links if link.serving)

    async def worker_metrics(self, timeout: float = 2.0) -> list[Any]:
        """Every worker's metric families (``metrics_merge.families_of``) as of now, the dead ones' counters too;
        a worker that does not answer within ``timeout`` at its newest snapshot."""
        await asyncio.gather(*(link.metrics(timeout) for link in list(self.links)), return_exceptions=True)
        return self.counts.families()

    async def close(self) -> None:
        if self._pushing is not None:
            self._pushing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pushing
        if self._server is not None:
            self._server.close()
        for link in list(self.links):
            link.channel.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
