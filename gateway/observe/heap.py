"""The process's heap after start-up, out of the cyclic collector's reach.

A gateway holds about 400,000 objects once it is up (the modules of transformers, pydantic and the rest, the
tokenizer's Python side, the chat templates), and they live as long as the process. CPython's full collection
walks every one of them: measured at 64 short chats at a time on one core, each took 40-280 ms (collecting 10-300
objects), a pause for every request in flight, several a minute. ``gc.freeze`` moves them to a generation that no
collection walks; with it the same load served 1,120-1,300 chats a second against 680-940 without, in turns on one
core (docs/overhead.md). What is frozen is never collected, so only the serving processes freeze, once, after
their start-up (``serving.Server``): never a process that builds and drops gateways (the test suite)."""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def settle() -> int:
    """Collect what start-up left as garbage, then freeze what remains; returns the objects frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("the start-up heap is frozen out of the collector's reach: %d objects", frozen)
    return frozen
