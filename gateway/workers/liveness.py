"""Whether a worker's admission authority still answers: a frozen one (SIGSTOP, a loop stuck on a bug) keeps its
socket open, so only silence shows it.

The authority sends a heartbeat (``messages.Alive``) every ``ALIVE_EVERY`` seconds besides everything else it
sends. A worker that hears nothing from it for ``SILENT_AFTER`` seconds calls it silent: every request that
would wait on it is refused at once (503 ``authority_unresponsive`` with ``Retry-After``), and the worker's
``/health`` answers 503 with the reason, from the worker itself; the requests already waiting on it are refused
as the silence begins (``on_silent``), not at the end of their own limit (``--queue-timeout``, 300 s by default).
The first message from the authority ends it.

The judgement is made on a timer of the worker's own loop, and only by a tick that came on time: a worker whose
own loop was held (a long request on it, the host starved) wakes to the authority's messages still unread, and
must not take its own delay for the authority's silence.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gateway.errors import UpstreamUnavailable
from gateway.periodic import Periodic
from gateway.workers.messages import ALIVE_EVERY

log = logging.getLogger(__name__)

SILENT_AFTER = 4 * ALIVE_EVERY  # seconds without a word from the authority that make it silent
WATCH_EVERY = ALIVE_EVERY / 2
CODE = "authority_unresponsive"


class Liveness:
    """The authority's silence as this worker judges it, from when its channel last heard anything."""

    def __init__(
        self, heard_at: Callable[[], float], clock: Callable[[], float], on_silent: Callable[[], None] | None = None
    ) -> None:
        self._heard_at = heard_at
        self._clock = clock
        self._on_silent = on_silent
        self.silent_since: float | None = None  # when the silence began (the last word heard), while silent
        self._ticked: float | None = None
        self._timer = Periodic(
            self.tick, WATCH_EVERY, name="worker-authority-liveness",
            failed="judging whether the admission authority still answers failed", logger=log,
        )

    @property
    def silent(self) -> bool:
        return self.silent_since is not None

    def heard(self) -> None:
        """A message came from the authority."""
        if self.silent_since is not None:
            log.warning("the admission authority answers again after %.1f s of silence; requests are admitted",
                        self._clock() - self.silent_since)
            self.silent_since = None

    def tick(self) -> None:
        now = self._clock()
        on_time = self._ticked is not None and now - self._ticked <= 3 * WATCH_EVERY
        self._ticked = now
        if not on_time or self.silent_since is not None:
            return
        heard = self._heard_at()
        if now - heard > SILENT_AFTER:
            self.silent_since = heard
            log.error("the admission authority has said nothing for %.1f s (limit %g s); this worker refuses what "
                      "would wait on it until it does", now - heard, SILENT_AFTER)
            if self._on_silent is not None:
                self._on_silent()

    def start(self) -> None:
        """Judge every ``WATCH_EVERY`` seconds, from now until ``stop``."""
        self._timer.start()

    async def stop(self) -> None:
        await self._timer.stop()

    def silence(self) -> float:
        """Seconds since the authority was last heard from."""
        return max(0.0, self._clock() - self._heard_at())

    def reason(self) -> str:
        return (f"this gateway worker's admission authority has not answered for {self.silence():.1f} s "
                f"(limit {SILENT_AFTER:g} s); it refuses requests until the authority answers again")

    def refusal(self) -> UpstreamUnavailable:
        return UpstreamUnavailable(f"{self.reason()}. Retry shortly.", code=CODE, retry_after=SILENT_AFTER)
