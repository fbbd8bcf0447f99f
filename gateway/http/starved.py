"""Telling a starved client from a hostile one: the time a busy host kept a client from running is not counted
against it by the gateway's connection timeouts.

Measured beside a CPU hog (16 chat streams/s for 60 s, the load client at niceness 10 on two cores): every
request the gateway lost was a connection it closed because its client had not sent its request within the 10 s
a fresh connection gets (``--header-timeout``): the client had connected, then not run. vLLM alone never closes
a fresh connection. A hostile client (one that opens connections and sends nothing, sends its head or body a
byte at a time, or stops reading its answer) looks the same from the gateway, except that it does so on an idle
host too. So a timeout about to cut a client first asks how much of its wait the host starved runnable work of a
CPU (``cpu_pressure.starved_share``), counts only the rest as the client's, and gives it the difference: never
more than ``STRETCH`` times the timeout in all, so that a hostile client on a busy host is still cut, later.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.observe import cpu_pressure

# The longest a starved host stretches a timeout by default, as a multiple of it (--starved-stretch; with
# --header-timeout 10 s: 40 s at most; --write-timeout 30 s: 120 s). What such a client holds meanwhile stays
# within the connection's limits (--max-connections, --max-buffered-bytes).
STRETCH = 4.0
# A re-check sooner than this is not worth a timer: the client's time is as good as used up.
MIN_RECHECK = 0.05

Share = Callable[[float], float]


def owed(limit: float, elapsed: float, share: Share | None = None, stretch: float = STRETCH) -> float:
    """Seconds more that a client is owed before it missed a timeout of ``limit`` seconds, ``elapsed`` of which
    have passed (0: none, cut it): those of the wait in which the host starved work of a CPU, within
    ``stretch`` times ``limit`` in all (``--starved-stretch``; 0: none owed). On an idle host (or one whose
    pressure is unknown), 0. ``share``: the host's starved share of a window (default
    ``cpu_pressure.starved_share``, looked up at each call)."""
    if elapsed >= limit * stretch:
        return 0.0
    starved = (share or cpu_pressure.starved_share)(max(elapsed, 0.0))
    if starved <= 0.0:
        return 0.0
    more = min(limit - elapsed * (1.0 - starved), limit * stretch - elapsed)
    return more if more >= MIN_RECHECK else 0.0
