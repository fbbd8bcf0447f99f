"""The refusals admission hands back to a waiting request, each message stating the limit and the value given."""

from __future__ import annotations

from gateway import errors


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
