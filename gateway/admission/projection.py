"""What the adaptive policy learns and projects with: the requests in flight as it reads them (``Booked``), the
outlook on their lengths (the booking quantile the preemption controller sets, and the lengths seen), and the
credit a request earns from its streamed progress against an engine snapshot.

``credited(r)``: the tokens a snapshot of the engine's KV usage surely holds of ``r``, known from its streamed
progress. Only a request seen making progress shortly before the snapshot is credited: one not yet scheduled, or
preempted, is not in the live usage and gets no credit. The projection itself is ``curve``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Protocol

from gateway.admission.budget import ROOM_BELOW, PreemptionBudget
from gateway.admission.lengths import OutputLengths
from gateway.engine.live import EngineSnapshot

log = logging.getLogger(__name__)

class Booked(Protocol):
    """What the projection reads of an admitted request."""

    @property
    def prompt_tokens(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def min_output(self) -> int: ...
    @property
    def n(self) -> int: ...
    @property
    def blocks(self) -> int: ...
    @property
    def prefix_blocks(self) -> int: ...
    @property
    def shared_blocks(self) -> int: ...
    @property
    def keys(self) -> Sequence[Hashable]: ...
    @property
    def generated(self) -> int: ...
    @property
    def credited(self) -> int | None: ...
    @property
    def admitted_at(self) -> float | None: ...
    @property
    def family(self) -> str: ...
    @property
    def tenant(self) -> str: ...


class Creditable(Booked, Protocol):
    """An admitted request whose progress snapshots are credited with."""

    def credit(self, taken_at: float, window: float) -> None: ...
    def forget_credit(self) -> None: ...


@dataclass(frozen=True)
class Outlook:
    """What the projection assumes of outputs: the booking quantile (1: the worst case) and the lengths seen."""

    quantile: float
    lengths: OutputLengths | None = None
    reach: float = 0.0  # how far past the budget the projected peak may go, as a share of it (``budget``)

    @property
    def z(self) -> float | None:
        """The quantile's normal score: how many standard deviations of the projected usage admission keeps
        free (0.52 at 0.7); None at the worst case."""
        if self.quantile >= 1.0 or self.lengths is None:
            return None
        return NormalDist().inv_cdf(min(max(self.quantile, 1e-6), 1 - 1e-6))

    def expected_output(self, r: Booked) -> int | None:
        """Output tokens per sequence ``r`` is expected to reach; None: its worst case."""
        if self.quantile >= 1.0 or self.lengths is None:
            return None
        per_sequence = math.ceil(r.generated / r.n)
        return self.lengths.expected(r.family, r.tenant, r.max_tokens, per_sequence, self.quantile, r.min_output)


class Projector:
    """What the adaptive policy learns from the engine and from completed requests, and projects with."""

    def __init__(self, credit_window: float, budget: float = 1.0, kv_target: float = 1.0) -> None:
        self.optimism = PreemptionBudget(budget)
        self.outputs = OutputLengths()
        self._credit_window = credit_window
        self._room_below = ROOM_BELOW * kv_target  # of the engine's cache

    def outlook(self) -> Outlook:
        return Outlook(self.optimism.quantile, self.outputs, self.optimism.reach)

    def completed(self, r: Booked, output: int | None, at: float) -> None:
        """``r`` ended at ``at``; ``output``: its output tokens per sequence when it ran to its end. An answer
        forced to its ``max_tokens`` (``ignore_eos``) is not learned: its length was the client's choice, and would
        only make the same tenant's other answers look longer than they are."""
        self.optimism.completed(at)
        if output is not None and r.min_output < r.max_tokens:
            self.outputs.add(r.family, r.tenant, r.max_tokens, output)

    def observe(
        self, old: EngineSnapshot, new: EngineSnapshot, in_flight: Iterable[Creditable], *, foreign: bool = False,
        held_back: bool = False, compute_room: bool = True,
    ) -> float:
        """Learn from a new engine snapshot: preemptions move the optimism, progress earns credit. ``foreign``:
        the engine runs traffic that bypasses the gateway; ``held_back``: requests wait in the gateway's queue
        (room in the engine is then room the projection did not see, not a load still ramping up);
        ``compute_room``: the engine's steps leave time for more within the TTFT objective; returns the
        preemptions not held against admission."""
        if not (new.ok and new.has_metrics):
            for r in in_flight:
                r.forget_credit()
            return 0.0
        clean = new.taken_at - old.taken_at if old.ok else None
        waiting = (new.waiting or 0) > 0
        room = held_back and new.kv_usage is not None and new.kv_usage < self._room_below
        increase = self.optimism.observe(
            new.preemptions_total, clean, at=new.taken_at, blame=not foreign, engine_waiting=waiting,
            engine_room=room, compute_room=compute_room,
        )
        if increase > 0 and foreign:
            log.warning("engine reported %g new preemptions while traffic that bypasses the gateway ran; "
                        "admission optimism kept at %.3f", increase, self.optimism.value)
        elif increase > 0:
            log.warning("engine reported %g new preemptions; admission optimism now %.3f",
                        increase, self.optimism.value)
        for r in in_flight:
            r.credit(new.taken_at, self._credit_window)
        return increase if foreign else 0.0


def credited_progress(checkpoints: Iterable[tuple[float, int]], taken_at: float, window: float, n: int) -> int | None:
    """Generated tokens a snapshot taken at ``taken_at`` surely includes, from (time, generated) checkpoints
    seen within ``window`` before it; None when none were."""
    since = taken_at - window
    seen = [g for t, g in checkpoints if since < t <= taken_at]
    if not seen:
        return None
    # Streamed progress can run ahead of the cache: a role-only first chunk per choice, the usage chunk,
    # [DONE], and each choice's last sampled token, which is not cached yet.
    return max(0, max(seen) - (2 + 2 * n))
