"""Byte sizes read from the command line."""

from __future__ import annotations

import re

import pytest

from gateway.errors import InvalidRequest
from gateway.tools.memsize import GIB, MIB, parse_memory


@pytest.mark.parametrize(
    ("text", "expected"),
    [("24GiB", 24 * GIB), ("80GB", 80 * GIB), ("81920MiB", 80 * GIB), ("1.5T", 1536 * GIB),
     ("4194304", 4194304), ("512 mib", 512 * MIB)],
)
def test_gpu_memory_sizes_are_parsed(text: str, expected: int) -> None:
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "24XB", "-1GiB", "0"])
def test_bad_gpu_memory_sizes_are_refused_with_the_value_given(text: str) -> None:
    with pytest.raises(InvalidRequest, match=re.escape(repr(text))):
        parse_memory(text)
