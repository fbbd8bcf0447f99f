"""Weighted fair shares between tenants: one virtual token counter per tenant, in the spirit of the Virtual Token
Counter (VTC, Sheng et al., OSDI 2024, "Fairness in Serving Large Language Models").

A tenant's counter is the service it received, in weighted tokens divided by its weight: each admitted request
adds ``prompt_tokens x PROMPT_WEIGHT / weight``, and its output adds ``output_tokens x OUTPUT_WEIGHT / weight``
once it is known. The queue serves the backlogged tenant whose counter is smallest, so while tenants compete
their counters stay within one request's charge of each other: each receives tokens in proportion to its
weight. A tenant that becomes backlogged again is lifted to the smallest counter of the tenants already
waiting (or, when none waits, to the counter of the last tenant that stopped waiting), so time spent idle
cannot be saved up as credit and spent later in a burst that shuts the others out.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypedDict

# VTC's weights: an output token costs the engine about twice a prompt token (a decode step per token, where a
# prompt is read in one pass).
PROMPT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


class TenantShare(TypedDict):
    """One tenant's counter as ``/guard/status`` shows it."""

    weight: float
    counter: float


class FairShare:
    """The tenants' virtual token counters. Tenants are kept once seen: their number is that of the tenants the
    configuration names (plus ``default``), not of the requests."""

    def __init__(self, *, prompt_weight: float = PROMPT_WEIGHT, output_weight: float = OUTPUT_WEIGHT) -> None:
        self._prompt_weight = prompt_weight
        self._output_weight = output_weight
        self._counters: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._last_idle: str | None = None  # the tenant that last stopped waiting

    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def charge(self, tenant: str, weight: float, *, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        """Add the service ``tenant`` received: tokens weighted by their kind, divided by the tenant's weight."""
        if weight <= 0:
            raise ValueError(f"a tenant's weight must be above 0; {tenant!r} has {weight}")
        self._weights[tenant] = weight
        cost = prompt_tokens * self._prompt_weight + output_tokens * self._output_weight
        self._counters[tenant] = self.counter(tenant) + cost / weight

    def wake(self, tenant: str, weight: float, backlogged: Iterable[str]) -> None:
        """``tenant`` starts waiting while ``backlogged`` (the others) wait: lift its counter so that it cannot
        spend credit saved while it was idle."""
        self._weights[tenant] = weight
        # The least counter of those waiting: a loop, not ``min`` over a generator (an object and its frame each
        # time a tenant starts waiting, as every request arriving at an empty queue does).
        floor: float | None = None
        for t in backlogged:
            counter = self.counter(t)
            if floor is None or counter < floor:
                floor = counter
        if floor is None and self._last_idle is not None:
            floor = self.counter(self._last_idle)
        self._counters[tenant] = max(self.counter(tenant), floor or 0.0)

    def rest(self, tenant: str) -> None:
        """``tenant`` has nothing waiting any more."""
        self._last_idle = tenant

    def status(self) -> dict[str, TenantShare]:
        """Every tenant seen, by name: its weight and counter (in weighted tokens per unit of weight)."""
        return {
            t: {"weight": self.weight(t), "counter": round(self.counter(t), 1)}
            for t in sorted(self._weights.keys() | self._counters.keys())
        }
