"""vLLM's own waiting-queue cap as the gateway meets it.

vLLM 0.29+ started with ``--max-num-queued-reqs`` or ``--max-num-queued-tokens`` answers 503 once its queue is
at the cap (``gateway/engine/vllm_api/errors.py``). Sending it more at once only earns more 503s, so an engine
that refused is full: admission places nothing new on it until it has room again, which is when one of the
gateway's requests on it ends (vLLM's cap counts unfinished requests), or after a short hold when none does
(the queue was filled by traffic that does not come through the gateway). One per API server: vLLM applies the
cap across the data-parallel engines behind one URL.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class QueueCap:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._until: float | None = None
        self.refusals_total = 0  # refusals seen by the gateway's requests, for /guard/status

    def refused(self, hold: float) -> None:
        """The engine answered a request with its queue-cap 503: full for at most ``hold`` seconds."""
        self.refusals_total += 1
        self._until = self._clock() + hold

    def room(self) -> None:
        """One of the gateway's requests on the engine ended: its queue has a place again."""
        self._until = None

    @property
    def full(self) -> bool:
        until = self._until
        if until is None:
            return False
        if self._clock() >= until:
            self._until = None
            return False
        return True

    def status(self) -> dict[str, object]:
        return {"full": self.full, "refusals_total": self.refusals_total}
