"""The refusals admission hands back to a waiting request, each message stating the limit and the value given."""

from __future__ import annotations

from typing import Any

from gateway import errors
from gateway.admission.forecast import Late
from gateway.admission.queue import RETRY_AFTER_MAX, RETRY_AFTER_MIN


def queue_full(max_queue: int, in_flight: int, retry_after: float) -> errors.QueueFull:
    """The queue had no room for one more request (429)."""
    return errors.QueueFull(
        f"The gateway's queue is full ({max_queue} requests waiting for KV capacity, "
        f"{in_flight} in flight); retry later.",
        retry_after=retry_after,
    )


def queue_timeout(
    waited: float, timeout: float, in_flight: int, queued: int, retry_after: float
) -> errors.QueueTimeout:
    """A request waited its whole queue timeout without being admitted (503)."""
    return errors.QueueTimeout(
        f"Waited {waited:.1f} s for KV capacity, the queue timeout is {timeout:g} s ({in_flight} requests in "
        f"flight, {queued} queued); retry later.",
        retry_after=retry_after,
    )


def queue_timeout_expected(late: Late[Any], timeout: float) -> errors.QueueTimeoutExpected:
    """A queued request forecast to wait past its queue timeout (503 at once, ``Retry-After`` the expected wait)."""
    waited = timeout - late.time_left
    deadline = (
        f"the queue timeout of {timeout:g} s" if waited < 0.1  # refused as it arrived
        else f"the {late.time_left:.1f} s left of the {timeout:g} s queue timeout"
    )
    return errors.QueueTimeoutExpected(
        f"Expected wait {late.expected_wait:.0f} s for KV capacity exceeds {deadline} (ahead of it: "
        f"{_count(late.position, 'request')} needing {_count(late.blocks_ahead, 'KV block')}; "
        f"{_count(late.in_flight, 'request')} in flight free {late.blocks_per_second:.1f} blocks/s); retry later.",
        retry_after=min(RETRY_AFTER_MAX, max(RETRY_AFTER_MIN, late.expected_wait)),
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
