"""One request's booking of KV blocks, and the phases it goes through from arrival to release.

A reservation knows what it books (prompt tokens, max tokens, ``n``, priority) and the request's progress;
deciding when it may go is the controller's. It reaches the controller only through ``Admitter``, and the
controller moves it from phase to phase only through its public transitions, each checked against the
phase diagram: new -> queued -> admitted -> released, with rejected and released reachable from new or
queued.
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Protocol

from gateway import errors
from gateway.admission.deadlines import WaitLimit
from gateway.admission.destination import Destination
from gateway.admission.ledger import own_blocks, request_need
from gateway.admission.prefix import BlockKey, PromptPrefix, block_keys
from gateway.admission.projection import credited_progress

CHECKPOINTS = 8  # progress checkpoints kept per request
OFF_LOOP_TOKENS = 4096  # prompts this long have their block keys hashed off the event loop (~0.6 ms and more)


class Phase(enum.Enum):
    NEW = "new"
    QUEUED = "queued"
    ADMITTED = "admitted"
    RELEASED = "released"
    REJECTED = "rejected"


# Tuples, not sets: membership by identity, without hashing the members on every transition.
_WAITING = (Phase.NEW, Phase.QUEUED)  # not admitted yet: may still be turned away or withdrawn


class Admitter(Protocol):
    """The controller, as a reservation sees it."""

    async def enter(self, reservation: Reservation) -> None:
        """Return once ``reservation`` is admitted; raise when it is refused, shed or times out."""

    def leave(self, reservation: Reservation) -> None:
        """Give back what ``reservation`` holds, or withdraw it from the queue (idempotent)."""

    def first_token(self, reservation: Reservation, seconds: float) -> None:
        """``reservation``'s first token was streamed ``seconds`` after it was sent to its engine (after its
        admission where it was not told apart)."""


class Reservation:
    """One request's claim on KV blocks. Use as ``async with``; released exactly once on every path."""

    def __init__(
        self, admitter: Admitter, *, prompt_tokens: int, max_tokens: int, n: int, priority: int,
        request_id: str, block_size: int, clock: Callable[[], float], checkpoint_spacing: float,
        tenant: str = "default", weight: float = 1.0, prefix: PromptPrefix | None = None,
        avoid: frozenset[str] = frozenset(), family: str = "", deadline: float | None = None,
        min_output: int = 0, objective: float | None = None,
    ) -> None:
        self._admitter = admitter
        self.family = family  # served model and route: whose answers' lengths it is booked from (``lengths``)
        self.deadline = deadline  # seconds its client gives it to a first token, when it says (``deadlines``)
        # Seconds to a first token it asks for as an objective (llm-d's ``x-llm-d-slo-ttft-ms``): judges its arrival
        # only, as ``--ttft-objective`` does; its deadline still bounds its wait (``deadlines``).
        self.objective = objective
        self.wait_limit: WaitLimit | None = None  # how long it may wait in the queue, set as it enters
        self.due: float | None = None  # when an objective wanted it admitted by, where one judged it as it arrived
        self._admitted_at: float | None = None
        self._sent_at: float | None = None  # when the request path began writing it to its engine
        self.avoid = avoid  # engines not to place it on (one failed under it already)
        self.target: Destination | None = None  # where it was placed, once admitted
        self._clock = clock
        self._checkpoint_spacing = checkpoint_spacing
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        # Output tokens per sequence it surely generates (``ignore_eos``: all of max_tokens; ``min_tokens``): booked
        # at least so, whatever the lengths learned (``lengths``).
        self.min_output = max(0, min(min_output, max_tokens))
        self.n = n
        self.priority = priority
        self.tenant = tenant
        self.weight = weight  # the tenant's share of the engine when tenants compete (see ``fairness``)
        self.prefix = prefix
        self._keys: tuple[BlockKey, ...] = ()
        self._own = self._logical = request_need(prompt_tokens, max_tokens, n, block_size)
        self._prefix_blocks = 0  # shared prompt blocks it adds: quoted while waiting, fixed at admission
        self._hashed: tuple[int, tuple[BlockKey, ...]] | None = None  # (block size, keys) hashed ahead
        self.queue_ms = 0.0
        self._phase = Phase.NEW
        self._future: asyncio.Future[None] | None = None
        self._waited = False
        self._engine_queued = False  # admitted into a queue in the engine, or behind a crowd of prefills (``admit``)
        self._cut = False
        self._generated = 0
        self._observed = False
        self._timed = False  # its first token was timed (a stream's): it told admission when it left the engine's queue
        # (time, generated) pairs spaced a fraction of the scrape interval apart: what the engine surely
        # held at a past instant, to compare with a snapshot taken then.
        self._checkpoints: deque[tuple[float, int]] = deque(maxlen=CHECKPOINTS)
        self._credited: int | None = None  # generated tokens the latest fresh snapshot surely includes

    # -- reading ------------------------------------------------------------------------------------
    def overdue(self, now: float) -> bool:
        """Whether it is queued past the time an objective gave it to be admitted by."""
        return self.due is not None and self.due < now

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def admitted(self) -> bool:
        return self._phase is Phase.ADMITTED

    @property
    def blocks(self) -> int:
        """The most KV blocks admitting this request adds to the ledger: its own blocks, plus the shared prompt
        blocks nobody in flight held (as quoted while it waits; as booked once admitted)."""
        return self._own + self._prefix_blocks

    @property
    def own_blocks(self) -> int:
        """Blocks its sequences can allocate beyond the shared prompt blocks."""
        return self._own

    @property
    def prefix_blocks(self) -> int:
        """Shared prompt blocks it added to the ledger (admitted) or would add now (waiting)."""
        return self._prefix_blocks

    @property
    def keys(self) -> tuple[BlockKey, ...]:
        """Keys of its shareable prompt blocks (empty without prefix sharing)."""
        return self._keys

    @property
    def shared_blocks(self) -> int:
        """Its prompt blocks held in common by its sequences (and by any request with the same prefix)."""
        return len(self._keys)

    @property
    def logical_blocks(self) -> int:
        """What it would book without prefix sharing: every sequence its whole prompt and output."""
        return self._logical

    @property
    def alone_blocks(self) -> int:
        """What it books when no other request holds its prefix: the most it can ever add."""
        return self._own + len(self._keys)

    @property
    def generated(self) -> int:
        return self._generated

    @property
    def admitted_at(self) -> float | None:
        """When admission let it go to the engine (the admission clock); None while it was not."""
        return self._admitted_at

    @property
    def credited(self) -> int | None:
        return self._credited

    @property
    def waited(self) -> bool:
        """Whether it had to wait in the queue (rather than being admitted as it arrived)."""
        return self._waited

    @property
    def queued_anywhere(self) -> bool:
        """Whether it waited in the queue, or was admitted as it arrived into an engine with requests waiting in
        its own or behind a crowd of ours awaiting their first token: either way its first token came after a queue's
        wait, not the engine's unhurried time."""
        return self._waited or self._engine_queued

    @property
    def timed_first_token(self) -> bool:
        """Whether its first token was timed (``Admitter.first_token``), as a stream's is; a whole answer's is not."""
        return self._timed

    @property
    def completed_output(self) -> int | None:
        """Output tokens per sequence of a request that ran to its end; None when it was cut or not seen."""
        if not self._observed or self._cut:
            return None
        return math.ceil(self._generated / self.n)

    # -- the request's side -------------------------------------------------------------------------
    async def __aenter__(self) -> Reservation:
        await self._admitter.enter(self)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release(completed=exc_type is None)

    def sent(self) -> None:
        """The request path begins writing the request to its engine. What came between the admission and this
        (the waiting task's turn on the event loop, the engine's body) is the gateway's own time: counted into
        the engine's time to a first token, a gateway short of CPU (its loop 0.7 s late a wakeup beside vLLM's CPU
        build, docs/realistic.md) read as a slow engine, and the pace cut the engine's work for it."""
        if self._admitted_at is not None and self._sent_at is None:
            self._sent_at = self._clock()

    def release(self, *, completed: bool = True) -> None:
        """Give the blocks back (idempotent). On a queued reservation: withdraw it; its wait is cancelled.

        ``completed=False`` (a cut stream, an upstream error) keeps the request's output length out of the
        adaptive policy's estimate, which a truncated output would bias low. How it ended is fixed by the first
        release: a later one (the request path's own exit after the stream's end gave it back) changes nothing."""
        if not completed and self.phase is not Phase.RELEASED:
            self._cut = True
        self._admitter.leave(self)

    def observe_output_tokens(self, generated: int, first_token_s: float | None = None) -> None:
        """Completion tokens produced so far, summed over the ``n`` choices (streamed progress or final usage).
        ``first_token_s``: with the first, its time as measured where the request was written to its engine (a
        worker's own write: ``workers/messages.py``), taken instead of this clock's."""
        if generated < self._generated:
            return
        now = self._clock()
        if self._generated == 0 and self._admitted_at is not None and 0 < generated <= self.n:
            # A stream's first token; a whole answer reports all its tokens at once, a sample only when that is one
            # token a choice (its whole time is then its time to a first token). The engine's time counts from the
            # request's write, not from its admission (``sent``).
            start = self._sent_at if self._sent_at is not None else self._admitted_at
            self._timed = True
            self._admitter.first_token(self, now - start if first_token_s is None else first_token_s)
        self._generated = generated
        self._observed = True
        if not self._checkpoints or now - self._checkpoints[-1][0] >= self._checkpoint_spacing:
            self._checkpoints.append((now, generated))

    # -- the controller's side ----------------------------------------------------------------------
    def hashes_off_loop(self, sharing: bool) -> bool:
        """Whether ``prepare`` hashes its block keys off the loop (without it ``Admitter.arrive`` would, on it)."""
        return sharing and self.prefix is not None and len(self.prefix.ids) >= OFF_LOOP_TOKENS

    async def prepare(self, block_size: int, sharing: bool) -> None:
        """Hash a long prompt's block keys in a worker thread: ~5 ms for 32K tokens in blocks of 16, measured,
        which would otherwise hold the event loop at admission."""
        if self.prefix is not None and self.hashes_off_loop(sharing):
            keys = await asyncio.get_running_loop().run_in_executor(None, block_keys, self.prefix, block_size)
            self._hashed = (block_size, keys)

    def recount(self, block_size: int, sharing: bool) -> int:
        """Count the need again in another block size, or with prefix sharing switched; returns the previous own
        blocks. The keys change with it: an admitted reservation's keys go back to the ledger before this."""
        old = self._own
        keys: tuple[BlockKey, ...] = ()
        if sharing and self.prefix is not None:
            hashed = self._hashed
            keys = hashed[1] if hashed is not None and hashed[0] == block_size else block_keys(self.prefix, block_size)
        self._keys = keys
        self._own = own_blocks(self.prompt_tokens, self.max_tokens, self.n, block_size, len(keys))
        self._logical = request_need(self.prompt_tokens, self.max_tokens, self.n, block_size)
        self._prefix_blocks = len(keys)
        return old

    def quote(self, prefix_blocks: int) -> None:
        """Set the shared prompt blocks it would add if admitted now (the controller's to say)."""
        self._prefix_blocks = prefix_blocks

    def enqueue(self) -> None:
        self._move(Phase.QUEUED, (Phase.NEW,))
        self._future = asyncio.get_running_loop().create_future()

    async def wait(self) -> None:
        """Wait in the queue until admitted; raises what rejected it, or the cancellation of the waiter."""
        if self._future is None:
            raise RuntimeError(f"reservation {self.request_id} is not queued")
        self._waited = True
        try:
            await self._future
        except asyncio.CancelledError:
            if self._future.done() and not self._future.cancelled():
                self._future.exception()  # failed in the same instant: mark it seen, the cancellation wins
            raise

    def admit(self, waited_seconds: float, *, engine_queued: bool = False) -> None:
        """``engine_queued``: its engine had requests of its own waiting as it was admitted, or more of ours awaited
        their first token than it starts unhurried (``Deadlines.crowded``)."""
        self._move(Phase.ADMITTED, (Phase.QUEUED,))
        self._engine_queued = engine_queued
        self._admitted_at = self._clock()
        self.queue_ms = waited_seconds * 1000.0
        if self._future is not None and not self._future.done():
            self._future.set_result(None)

    def reject(self, error: errors.GatewayError | None = None) -> None:
        """Turn it away; a waiter gets ``error`` (None: the refusal is raised to the caller directly)."""
        self._move(Phase.REJECTED, _WAITING)
        if error is not None and self._future is not None and not self._future.done():
            self._future.set_exception(error)

    def withdraw(self) -> None:
        """Leave before admission: a waiter is cancelled."""
        self._move(Phase.RELEASED, _WAITING)
        if self._future is not None and not self._future.done():
            self._future.cancel()

    def finish(self) -> None:
        self._move(Phase.RELEASED, (Phase.ADMITTED,))

    def credit(self, taken_at: float, window: float) -> None:
        """Credit the progress a snapshot taken at ``taken_at`` surely contains."""
        self._credited = credited_progress(self._checkpoints, taken_at, window, self.n)

    def forget_credit(self) -> None:
        self._credited = None

    def _move(self, to: Phase, sources: tuple[Phase, ...]) -> None:
        if self._phase not in sources:
            raise RuntimeError(f"reservation {self.request_id} cannot go from {self._phase.value} to {to.value}")
        self._phase = to
