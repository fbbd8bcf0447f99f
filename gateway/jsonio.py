"""JSON in and out of the gateway, exactly: what a client sends is what the engine receives.

orjson is fast but reads integers beyond 64 bits as floats and writes at most 254 levels of nesting. The
rare body that holds such an integer is read again with the standard library, and written with it, so the
pass-through fields the gateway does not act on arrive untouched; nesting deeper than ``MAX_DEPTH`` is
refused by the caller with a 400 rather than failing on the way out.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

# Deeper than any real request; orjson itself cannot write past 254 levels (nor read past 1024).
MAX_DEPTH = 128
# orjson reads exactly the integers in [-2**63, 2**64), and any integer outside has at least 19 digits. A
# run of 19 digits anywhere (in a string, a fraction) costs only the second read, never a wrong answer.
# One translate maps digits to "0" and both opening brackets to "[" for the two C-speed searches below: on
# a 32K-token id list that is ~0.35 ms where a regex took ~8 ms (orjson's parse itself: ~0.9 ms).
_SHAPE = bytes(0x30 if 0x30 <= i <= 0x39 else 0x5B if i in (0x5B, 0x7B) else 0x20 for i in range(256))
_LONG_RUN = b"0" * 19
_CONTAINERS = frozenset({dict, list})


class TooDeep(ValueError):
    pass


def loads(raw: bytes) -> Any:
    """Parse JSON; raises ``orjson.JSONDecodeError`` (a ``ValueError``) on malformed input and ``TooDeep``."""
    try:
        # orjson first, always: it is also the validator (UTF-8, lone surrogates, infinities), so the
        # standard library's laxer reading never lets through what orjson refuses.
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if "depth" in str(exc):
            raise TooDeep(
                f"The request nests JSON objects and arrays more than 1024 levels deep; the limit is {MAX_DEPTH}."
            ) from exc
        raise
    shape = raw.translate(_SHAPE)
    # The number of opening brackets bounds the depth from above: most bodies never need the walk.
    if shape.count(b"[") > MAX_DEPTH:
        check_depth(data)
    if shape.find(_LONG_RUN) >= 0:
        data = json.loads(raw)
    return data


def dumps(data: Any) -> bytes:
    try:
        return orjson.dumps(data)
    except orjson.JSONEncodeError:
        # An integer beyond 64 bits (orjson refuses them): the standard library writes any int exactly.
        return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def check_depth(data: Any, limit: int = MAX_DEPTH) -> None:
    """Raise ``TooDeep`` when containers nest deeper than ``limit``. Level by level, never recursing; checking
    ``type`` against a set measured ~3x faster than ``isinstance`` on a 100-message chat (~50 us)."""
    level = [data] if type(data) in _CONTAINERS else []
    for _ in range(limit):
        if not level:
            return
        deeper = []
        for node in level:
            for child in node.values() if type(node) is dict else node:
                if type(child) in _CONTAINERS:
                    deeper.append(child)
        level = deeper
    if level:
        raise TooDeep(f"The request nests JSON objects and arrays more than {limit} levels deep; the limit is {limit}.")
