"""Where an admitted request goes. Kept in a module of its own, never compiled (``gateway/native.py``): it crosses
the workers' channel, whose codec builds its decoders from the type hints of the dataclasses it carries, and a
compiled module's annotations are erased to their runtime classes (``int | None`` reads back as ``type``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Destination:
    """Where an admitted request goes: the gateway's engine ``engine`` (its index), and on a data-parallel one the
    rank sent as ``X-data-parallel-rank``; ``name`` is how responses, status and metrics call it."""

    name: str
    engine: int = 0
    rank: int | None = None
