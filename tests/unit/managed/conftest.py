"""Fixtures of the supervisor's tests: a state directory for the fake engine, and no engine left behind."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.managed.supervisor import Supervisor


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "fake-state"


@pytest.fixture
def supervisors() -> Iterator[list[Supervisor]]:
    made: list[Supervisor] = []
    yield made
    # Every engine a test started is gone afterwards, whatever the test did.
    for sup in made:
        child = sup._child
        if child is not None and child.proc.returncode is None:
            os.killpg(child.pgid, signal.SIGKILL)
