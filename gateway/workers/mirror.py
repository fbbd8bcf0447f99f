"""What a worker process must know of the engines to serve requests, as the admission authority knows it.

The authority sends it (``messages.State``) whenever it changes (``state_of``, checked as each engine's scrape,
hang, health or lifecycle changes, and four times a second for the rest); a
worker applies it (``apply_state``): each engine's hang (new requests refused, streams in flight cut, as in one
process), its model listing (the context length requests are counted against), its URL and lifecycle state in
managed mode (requests refused while it starts, held while it restarts), and the KV capacity that clamps
``max_tokens``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from gateway.admission.ledger import Capacity
from gateway.engine.engine import Engine
from gateway.engine.vllm_api import ModelList
from gateway.errors import GatewayError
from gateway.guard.models import Models
from gateway.guard.parts import Parts
from gateway.managed.lifecycle import EngineLifecycle
from gateway.workers.messages import EngineState, State, SupervisorState, error_data, error_of


def state_of(parts: Parts) -> State:
    """The authority's view."""
    engines = []
    for engine in parts.every_engine():
        listing = engine.models.cached
        refusal = engine.refusal()
        engines.append(EngineState(
            engine.progress.hung, engine.progress.detail, engine.url,
            None if refusal is None else error_data(refusal),
            engine.fingerprint.known, engine.fingerprint.value,
            None if listing is None else tuple(listing.models),
        ))
    sups = tuple(
        SupervisorState(str(s.state), float(s.retry_after()), s.url) for s in parts.every_supervisor()
    )
    admission = parts.local_admission()
    return State(tuple(engines), sups, admission.largest_capacity(), admission.sharing)


@dataclass(slots=True)
class MirroredEngine(Engine[Models]):
    """A worker's engine: whether it takes requests is what the authority last told (``Engine.refusal``)."""

    told: GatewayError | None = None

    def refusal(self) -> GatewayError | None:
        return self.told


@dataclass
class SupervisorMirror:
    """A managed engine's supervisor as a worker sees it: its state, its URL, when to retry."""

    state: EngineLifecycle = EngineLifecycle.STARTING
    url: str = ""
    _retry_after: float = 5.0
    changed: asyncio.Event | None = None

    def retry_after(self) -> float:
        return self._retry_after

    async def failure_noticed(self, timeout: float = 10.0) -> bool:
        """Until the authority says the engine is no longer ready (or ``timeout``): a retry before would hit the
        dead engine again."""
        if self.state is not EngineLifecycle.READY:
            return True
        changed = self.changed = self.changed or asyncio.Event()
        changed.clear()
        try:
            await asyncio.wait_for(changed.wait(), timeout)
        except TimeoutError:
            return False
        return self.state is not EngineLifecycle.READY


@dataclass
class Mirror:
    """What the latest state said that has no home in the worker's own parts."""

    capacity: Capacity | None = None
    sharing: bool = False


def apply_state(parts: Parts, mirror: Mirror, supervisors: list[SupervisorMirror], state: State) -> None:
    for engine, seen in zip(parts.every_engine(), state.engines, strict=False):
        if isinstance(engine, MirroredEngine):
            engine.progress.mirror(seen.hung, seen.detail)
            engine.told = None if seen.refusal is None else error_of(seen.refusal)
        if seen.fingerprint_known and not engine.fingerprint.known:
            engine.fingerprint.learn(seen.fingerprint)
        if seen.models is not None:
            listing = ModelList(seen.models)
            if engine.models.cached != listing:
                engine.models.update(listing)
    for sup, told in zip(supervisors, state.supervisors, strict=False):
        sup.state = EngineLifecycle(told.state)
        sup.url = told.url
        sup._retry_after = told.retry_after
        if sup.changed is not None:
            sup.changed.set()
    mirror.capacity = state.capacity
    mirror.sharing = state.sharing
