"""How much of the recent past the host kept work waiting for a CPU: the time in which a client on a busy host
may have been unable to run at all.

Linux's pressure stall information (``/proc/pressure/cpu``, 4.20+) gives, host-wide, the share of the last 10
and 60 seconds during which at least one runnable task waited for a CPU (``some avg10=... avg60=...``, in
percent): on a host whose cores are all taken (a CPU hog beside the engine and the client) it nears 100, on an
idle one it is 0. Where it is missing (an older kernel, PSI disabled, a file that cannot be read) the share is 0:
every second counts against a client, as it did without this. It is read only when a protection is about to
cut a client (a file in memory, microseconds), never per request.
"""

from __future__ import annotations

from pathlib import Path

PSI_CPU = Path("/proc/pressure/cpu")
# Windows up to this long are judged by the 10-second average, longer ones by the 60-second one.
SHORT_WINDOW = 20.0


def parse_some(text: str) -> tuple[float, float] | None:
    """``some``'s avg10 and avg60 as fractions of time, from ``/proc/pressure/cpu``'s text (None: not there)."""
    for line in text.splitlines():
        if line.startswith("some "):
            fields = dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)
            try:
                return float(fields["avg10"]) / 100.0, float(fields["avg60"]) / 100.0
            except (KeyError, ValueError):
                return None
    return None


def starved_share(window: float, path: Path = PSI_CPU) -> float:
    """The share (0 to 1) of about the last ``window`` seconds during which the host kept some runnable task
    from a CPU; 0 where unknown."""
    try:
        some = parse_some(path.read_text())
    except OSError:
        return 0.0
    if some is None:
        return 0.0
    share = some[0] if window <= SHORT_WINDOW else some[1]
    return min(1.0, max(0.0, share))
