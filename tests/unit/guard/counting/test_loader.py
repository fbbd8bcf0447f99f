"""Loading a tokenizer from a directory or the local cache, never downloading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.guard.counting import TokenizerUnavailable, load_tokenizer


def test_a_tokenizer_loads_from_a_directory(tokenizer_dir: Path) -> None:
    assert load_tokenizer(str(tokenizer_dir)).bos_token == "<s>"


@pytest.mark.parametrize("source", ["/nonexistent/tokenizer", "nobody-knows/no-such-model-xyz"])
def test_a_tokenizer_that_cannot_load_without_downloading_is_unavailable(source: str) -> None:
    with pytest.raises(TokenizerUnavailable, match=json.dumps(source)[1:-1]):
        load_tokenizer(source)
