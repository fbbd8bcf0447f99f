from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.config import Settings
from gateway.tools.tinymodel import build_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture
def base_settings(tokenizer_dir: Path) -> Iterator[Settings]:
    yield Settings(tokenizer=str(tokenizer_dir), scrape_interval=0.05, queue_timeout=5.0, read_timeout=5.0)


@pytest.fixture(autouse=True)
def idle_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's timeouts give a client on a starved host its time back (``gateway.http.starved``), read from
    the host's CPU pressure: the suite judges them on an idle host, whatever else shares the machine; a test of a
    starved host injects its own pressure."""
    from gateway.observe import cpu_pressure

    monkeypatch.setattr(cpu_pressure, "starved_share", lambda window: 0.0)
