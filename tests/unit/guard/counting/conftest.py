from __future__ import annotations

from typing import Any

import pytest

from gateway.guard.counting import LocalCounter


@pytest.fixture(scope="module")
def counter(tokenizer: Any) -> LocalCounter:
    return LocalCounter(tokenizer)
