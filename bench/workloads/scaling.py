"""What ``--workers N`` can scale to, from one machine's per-process figures: each process's CPU (from /proc) over
a run and the requests (or relayed tokens) each one served (told apart by the request id prefix each process
writes in its answers' ``x-request-id``).

The authority serves its share of the port's connections like any worker and, besides, admits and releases every
request a worker forwards. So:

- a worker's whole cost per unit it served: ``w`` = the workers' CPU / what they served;
- the authority's coordination per unit a worker served: ``c`` = (the authority's CPU - what it served x ``w``)
  / what the workers served: its own serving priced at a worker's (or at ``one_us``, one process's, when given);
- with ``M`` processes on ``M`` cores and the port spreading the connections evenly, the authority's core is
  full at ``M / (w + (M - 1) c)`` units a second (its share of serving, plus coordination of the rest), the
  workers' at ``M / w``: the gateway's bound is the smaller, and its speed-up over one process (``w1`` a unit)
  is that bound times ``w1``, at most ``w1 / c`` however many workers (Amdahl's law, the coordination the
  serial part);
- an authority apart (``--authority apart``: it serves nothing; ``M`` workers, one process more on the same ``M``
  cores) is bound at ``min(M / (w + c), 1 / c)``, and its ``c`` is measured directly: its whole CPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Process:
    """One process of a gateway over a run: its role, CPU seconds, and units (requests or tokens) it served."""

    name: str  # "authority" or "worker N"
    cpu_s: float
    served: float

    @property
    def is_authority(self) -> bool:
        return self.name == "authority"


@dataclass(frozen=True)
class Split:
    """The per-unit figures of one run (microseconds; NaN where a figure has no units to divide by)."""

    units: float  # served by all processes
    authority_share: float  # of the units, served by the authority
    worker_us: float  # w: a worker's CPU per unit it served
    authority_us: float  # the authority's CPU per unit of the whole
    coordination_us: float  # c: the authority's CPU beyond its own serving, per unit a worker served
    coordination_whole_us: float  # the same per unit of the whole

    @property
    def coordination_of_worker(self) -> float:
        """c / w: the issue's target is 1/8 at most (eight workers then not bound by the authority)."""
        return self.coordination_us / self.worker_us if self.worker_us else math.nan


def split(processes: Sequence[Process], one_us: float | None = None) -> Split:
    """The figures of one run; ``one_us``: one process's CPU per unit, the price of the authority's own serving
    (a worker's when None or unknown)."""
    nan = math.nan
    authority = next((p for p in processes if p.is_authority), None)
    workers = [p for p in processes if not p.is_authority]
    units = sum(p.served for p in processes)
    served_w = sum(p.served for p in workers)
    w = sum(p.cpu_s for p in workers) * 1e6 / served_w if served_w else nan
    if authority is None or not units:
        return Split(units, nan, w, nan, nan, nan)
    price = one_us if one_us is not None and not math.isnan(one_us) else w
    beyond = authority.cpu_s * 1e6 - authority.served * (price if not math.isnan(price) else 0.0)
    return Split(units=units, authority_share=authority.served / units, worker_us=w,
                 authority_us=authority.cpu_s * 1e6 / units,
                 coordination_us=beyond / served_w if served_w else nan, coordination_whole_us=beyond / units)


def beyond_idle(authority_cpu_s: float, idle_per_s: float, seconds: float, served_w: float, w_us: float) -> float:
    """``c / w`` less what the authority spends whatever the load (apart: it serves nothing): its CPU over a load
    of ``seconds`` less ``idle_per_s`` (CPU seconds a second with nothing sent) that long, per unit the workers
    served, over a worker's cost ``w_us``. NaN where a figure is missing."""
    if not served_w or not w_us or math.isnan(idle_per_s) or math.isnan(w_us):
        return math.nan
    return (authority_cpu_s - idle_per_s * seconds) * 1e6 / served_w / w_us


def bound_per_s(m: int, one_us: float, w_us: float, c_us: float) -> float:
    """Units a second ``m`` processes on ``m`` cores can serve, the port spreading connections evenly: the
    authority's core (its share at one process's price ``one_us``, and ``c_us`` for each of the others') or the
    workers' (``w_us`` each), whichever is full first."""
    if m == 1:
        return 1e6 / one_us if one_us else math.nan
    return min(m * 1e6 / (one_us + (m - 1) * c_us), m * 1e6 / w_us)


def speedup(m: int, one_us: float, w_us: float, c_us: float) -> float:
    """``m`` processes' bound over one process's rate."""
    return bound_per_s(m, one_us, w_us, c_us) * one_us / 1e6


def limit(one_us: float, c_us: float) -> float:
    """The speed-up no number of workers passes: one process's cost over the coordination's."""
    return one_us / c_us if c_us > 0 else math.inf


def bound_apart(m: int, w_us: float, c_us: float) -> float:
    """Units a second of ``m`` workers on ``m`` cores with the authority apart (``--authority apart``: it serves
    nothing, one process more on the same cores): the cores full at ``m / (w + c)``, or the authority's own at
    ``1 / c``, whichever first. Against a serving authority's ``m / (w + (m - 1) c)``: the same at ``m = 2``, more
    from 3 on for any ``c < w``."""
    return min(m * 1e6 / (w_us + c_us), 1e6 / c_us if c_us > 0 else math.inf)


def served_by(processes: Mapping[str, str], counts: Mapping[str, float]) -> dict[str, float]:
    """Each process's units from counts by request id prefix: ``processes`` maps a process's name to its
    prefix; a prefix no process was mapped to (an answer without an id) is left out."""
    return {name: float(counts.get(prefix, 0)) for name, prefix in processes.items()}
