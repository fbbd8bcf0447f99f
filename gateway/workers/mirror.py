"""What a worker process must know of the engines to serve requests, as the admission authority knows it.

The authority sends it whenever it changes (``state_of``, checked twenty times a second); a worker applies it
(``apply_state``): each engine's hang (new requests refused, streams in flight cut, as in one process), its model
listing (the context length requests are counted against), its URL and lifecycle state in managed mode (requests
refused while it starts, held while it restarts), and the KV capacity that clamps ``max_tokens``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from gateway.admission.ledger import Capacity
from gateway.engine.engine import Engine
from gateway.engine.vllm_api import ModelList, ServedModel
from gateway.errors import GatewayError
from gateway.guard.models import Models
from gateway.guard.parts import Parts
from gateway.managed.lifecycle import EngineLifecycle
from gateway.workers.messages import error_from_json, error_to_json


def state_of(parts: Parts) -> dict[str, Any]:
    """The authority's view, as JSON."""
    engines = []
    for engine in parts.every_engine():
        listing = engine.models.cached
        refusal = engine.refusal()
        engines.append({
            "hung": engine.progress.hung, "detail": engine.progress.detail, "url": engine.url,
            "refusal": None if refusal is None else error_to_json(refusal),
            "fingerprint": [engine.fingerprint.known, engine.fingerprint.value],
            "models": None if listing is None else [
                [m.id, m.root, m.max_model_len, m.parent] for m in listing.models
            ],
        })
    sups = [
        {"state": str(s.state), "retry_after": s.retry_after(), "url": s.url}
        for s in parts.every_supervisor()
    ]
    largest = parts.admission.largest_capacity()
    return {
        "engines": engines, "supervisors": sups,
        "capacity": None if largest is None else [largest.blocks, largest.block_size, largest.source],
        "sharing": parts.admission.sharing,
    }


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


def apply_state(parts: Parts, mirror: Mirror, supervisors: list[SupervisorMirror], state: dict[str, Any]) -> None:
    for engine, seen in zip(parts.every_engine(), state.get("engines", []), strict=False):
        if isinstance(engine, MirroredEngine):
            mirror_hang = getattr(engine.progress, "mirror", None)  # the worker's ``assembly.ForwardingProgress``
            if mirror_hang is not None:
                mirror_hang(bool(seen.get("hung")), seen.get("detail"))
            refusal = seen.get("refusal")
            engine.told = None if refusal is None else error_from_json(refusal)
        known, value = seen.get("fingerprint", (False, None))
        if known and not engine.fingerprint.known:
            engine.fingerprint.learn(value)
        models = seen.get("models")
        if models is not None:
            listing = ModelList(tuple(ServedModel(*m) for m in models))
            if engine.models.cached != listing:
                engine.models.update(listing)
    for sup, seen in zip(supervisors, state.get("supervisors", []), strict=False):
        sup.state = EngineLifecycle(seen["state"])
        sup.url = str(seen.get("url") or "")
        sup._retry_after = float(seen.get("retry_after", 5.0))
        if sup.changed is not None:
            sup.changed.set()
    cap = state.get("capacity")
    mirror.capacity = None if cap is None else Capacity(int(cap[0]), int(cap[1]), str(cap[2]))
    mirror.sharing = bool(state.get("sharing"))
