"""vLLM's ``/version`` answer, ``{"version": "0.32.0"}``, read into a version that compares by release."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import orjson

_LEADING_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True, order=True)
class VllmVersion:
    # Compared by release numbers alone: "0.10.2.dev5+g1234.cpu" is release (0, 10, 2).
    release: tuple[int, ...]
    text: str = field(compare=False)

    def __str__(self) -> str:
        return self.text


def release_of(version: str) -> tuple[int, ...]:
    """The release numbers a version string starts with, at most three: "0.9.0rc1" is (0, 9, 0)."""
    out: list[int] = []
    for part in version.split("+")[0].split(".")[:3]:
        match = _LEADING_DIGITS.match(part)
        if match is None:
            break
        out.append(int(match[0]))
        if match.end() < len(part):
            break  # "0rc1", "2dev": a pre-release of the numbers so far
    return tuple(out)


def parse_version(payload: bytes) -> VllmVersion | None:
    """The version of a ``/version`` body; None for a body that names none (not vLLM, or a very old one)."""
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    raw = data.get("version") if isinstance(data, dict) else None
    if not raw:
        return None
    text = str(raw)
    return VllmVersion(release_of(text), text)
