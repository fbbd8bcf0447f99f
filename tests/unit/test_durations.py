"""Durations as flags and config files give them (``--restart-every``)."""

from __future__ import annotations

import pytest

from gateway.durations import parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("3600", 3600.0), ("2.5", 2.5), ("45s", 45.0), ("90m", 5400.0), ("6h", 21600.0), ("1h30m", 5400.0),
     ("1d", 86400.0), (" 1.5h ", 5400.0), ("2H", 7200.0)],
)
def test_a_duration_is_read_in_seconds(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "6 hours", "1.2.3h", "6x", "30m5", ".h", "-5m"])
def test_anything_else_is_refused_with_what_a_duration_looks_like(text: str) -> None:
    with pytest.raises(ValueError, match=r"not a duration.*90m, 6h"):
        parse_duration(text)
