"""Each process of --workers holds an equal share of the connection cap: connections are its memory."""

from __future__ import annotations

import pytest

from gateway.config import Settings
from gateway.http.limits import ConnectionLimits


@pytest.mark.parametrize(
    ("workers", "cap", "each"), [("1", 2048, 2048), ("2", 2048, 1024), ("3", 100, 34), ("4", 2, 1)]
)
def test_the_connection_cap_is_shared_out_between_the_processes(workers: str, cap: int, each: int) -> None:
    limits = ConnectionLimits.of(Settings(workers=workers, max_connections=cap))
    assert limits.max_connections == each


@pytest.mark.parametrize("given", ["0", "-1", "two", "257", "1.5"])
def test_a_worker_count_that_is_not_one_to_256_or_auto_is_refused(given: str) -> None:
    with pytest.raises(ValueError, match="--workers"):
        Settings(workers=given)


def test_auto_is_the_cores_this_process_may_run_on() -> None:
    import os

    assert Settings(workers="auto").worker_count() == len(os.sched_getaffinity(0))
