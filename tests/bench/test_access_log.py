"""The access-log benchmark writes each of its records through the serving setup, in either format, reports the
caller's time, the time until written and the CPU for each, and leaves the process's logging as it found it."""

from __future__ import annotations

import logging

import pytest

from bench.workloads.access_log import caller_cost, cases
from gateway.observe import access_log


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_each_record_has_a_cost_and_the_logging_is_undone(fmt: access_log.AccessLogFormat) -> None:
    factory = logging.getLogRecordFactory()
    figures = caller_cost(fmt, scale=0.01, pause_s=0)
    stems = [c.key.removesuffix("_us") for c in cases()]
    assert set(figures) == {f"{s}{k}" for s in stems for k in ("_us", "_written_us", "_cpu_us")}
    assert all(v > 0 for v in figures.values())
    assert logging.getLogRecordFactory() is factory
    assert access_log._direct is None, "the default writer was left installed"


def test_the_huge_records_are_a_client_s_model_names_of_1_and_8_mib() -> None:
    ordinary, one, eight = cases()
    assert (len(one.record.model or ""), len(eight.record.model or "")) == (1 << 20, 8 << 20)
    assert ordinary.count > one.count > eight.count >= 1
