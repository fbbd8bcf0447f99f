"""Durations as people write them in flags and config files: "3600", "90m", "6h", "1h30m", "1d"."""

from __future__ import annotations

_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """Seconds in a duration: a number of seconds ("3600") or numbers with units ("90m", "6h", "1h30m", "1d")."""
    spec = text.strip().lower()
    try:
        return float(spec)
    except ValueError:
        pass
    wrong = ValueError(f"not a duration: {text!r} (seconds, or numbers with s, m, h, d: 90m, 6h, 1h30m)")
    seconds, number = 0.0, ""
    for ch in spec:
        if ch.isdigit() or ch == ".":
            number += ch
        elif ch in _DURATION_UNITS and number and number.count(".") <= 1 and number != ".":
            seconds += float(number) * _DURATION_UNITS[ch]
            number = ""
        else:
            raise wrong
    if number or not spec:
        raise wrong
    return seconds
