"""The refusals admission hands back to a waiting request, each message stating the limit and the value given."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from gateway import errors
from gateway.admission.deadlines import WaitLimit
from gateway.admission.forecast import ARRIVAL_SHARE, Late
from gateway.admission.ledger import Capacity, too_large_message
from gateway.admission.queue import RETRY_AFTER_MAX, RETRY_AFTER_MIN

# Under --ttft-objective auto, what sets the wait of a request that arrived while the overload was sustained.
SUSTAINED = "while the overload is sustained (--ttft-objective auto)"


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
    deadline = (
        f"{ARRIVAL_SHARE:.0%} of the queue timeout of {timeout:g} s" if late.arriving
        else f"the {late.time_left:.1f} s left of the {timeout:g} s queue timeout"
    )
    return errors.QueueTimeoutExpected(
        f"Expected wait {late.expected_wait:.1f} s for KV capacity exceeds {deadline} (ahead of it: "
        f"{_count(late.position, 'request')} needing {_count(late.blocks_ahead, 'KV block')}; "
        f"{_count(late.in_flight, 'request')} in flight free {late.blocks_per_second:.1f} blocks/s); retry later.",
        retry_after=min(RETRY_AFTER_MAX, max(RETRY_AFTER_MIN, late.expected_wait)),
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


class _Limited(Protocol):
    @property
    def wait_limit(self) -> WaitLimit | None: ...


def span_of(timeout: float) -> Callable[[_Limited], float]:
    """How long a queued request may wait in all: its own limit, else the queue timeout."""
    return lambda r: r.wait_limit.seconds if r.wait_limit is not None else timeout


def expected_late(late: Late[Any], timeout: float) -> errors.QueueTimeoutExpected:
    """A queued request forecast to miss its own deadline (``deadline``) or the queue timeout, refused at once."""
    limit: WaitLimit | None = late.item.wait_limit
    if limit is None or not limit.own:
        return queue_timeout_expected(late, timeout)
    if late.behind:
        return errors.DeadlineUnreachable(
            f"Requests queued ahead of it are already past the time the TTFT objective gave them"
            f"{' ' + SUSTAINED if limit.derived else ''}{_engine(limit)} "
            f"({_count(late.position, 'request')} ahead needing {_count(late.blocks_ahead, 'KV block')}; "
            f"{_count(late.in_flight, 'request')} in flight free {late.blocks_per_second:.1f} blocks/s); retry later.",
            retry_after=min(RETRY_AFTER_MAX, max(RETRY_AFTER_MIN, late.expected_wait)),
        )
    if limit.derived:
        reach = (f"exceeds {ARRIVAL_SHARE:.0%} of the {late.time_left:.1f} s a request may wait {SUSTAINED}"
                 if late.arriving else f"misses the end of the wait allowed {SUSTAINED}, {late.time_left:.1f} s away")
    else:
        reach = (f"exceeds {ARRIVAL_SHARE:.0%} of the {late.time_left:.1f} s to the request's deadline"
                 if late.arriving else f"misses the request's deadline, {late.time_left:.1f} s away")
    return errors.DeadlineUnreachable(
        f"Expected wait {late.expected_wait:.1f} s for KV capacity{_engine(limit)} {reach} (ahead of it: "
        f"{_count(late.position, 'request')} needing {_count(late.blocks_ahead, 'KV block')}; "
        f"{_count(late.in_flight, 'request')} in flight free {late.blocks_per_second:.1f} blocks/s); retry later.",
        retry_after=min(RETRY_AFTER_MAX, max(RETRY_AFTER_MIN, late.expected_wait)),
    )


def timed_out(
    r: _Limited, waited: float, timeout: float, in_flight: int, queued: int, retry_after: float
) -> errors.QueueTimeout:
    """A request reached the end of its wait in the queue: its own deadline, or the queue timeout."""
    limit = r.wait_limit
    if limit is None or not limit.own:
        return queue_timeout(waited, timeout, in_flight, queued, retry_after)
    whose = f"the wait allowed {SUSTAINED} is over" if limit.derived else "the request's deadline leaves no more"
    return errors.DeadlineUnreachable(
        f"Waited {waited:.1f} s for KV capacity: {whose}{_engine(limit)} "
        f"({in_flight} requests in flight, {queued} queued); retry later.",
        retry_after=retry_after,
    )


def deadline_now(limit: WaitLimit, retry_after: float) -> errors.DeadlineUnreachable:
    """A request whose deadline is nearer than the engine's own time to a first token, or (under a sustained
    overload) whose wait the engine's own queue takes whole: refused as it arrives."""
    if limit.derived:
        return errors.DeadlineUnreachable(
            f"Requests wait {limit.engine_queue:.1f} s in the engine's own queue now, and an arriving request may wait "
            f"{limit.seconds + limit.engine_queue:.1f} s in all (the gateway's queue and the engine's) while the "
            f"overload is sustained (--ttft-objective auto); retry later.",
            retry_after=retry_after,
        )
    return errors.DeadlineUnreachable(
        f"The engine takes {limit.engine_seconds:.1f} s to a first token now; the request's deadline is "
        f"{limit.engine_seconds + limit.seconds:.1f} s away; retry later.",
        retry_after=retry_after,
    )


def _engine(limit: WaitLimit) -> str:
    return f" plus {limit.engine_seconds:.1f} s to a first token in the engine" if limit.engine_seconds else ""


class Sized(Protocol):
    """A request as its size is told: its prompt, its output, its sequences, the blocks it needs alone."""

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def max_tokens(self) -> int: ...

    @property
    def n(self) -> int: ...

    @property
    def alone_blocks(self) -> int: ...


def too_large(r: Sized, cap: Capacity, kv_target: float) -> errors.KVBudgetExceeded:
    """A request larger than the largest engine's whole budget: it can never fit."""
    return errors.KVBudgetExceeded(
        too_large_message(r.prompt_tokens, r.max_tokens, r.n, r.alone_blocks, cap, kv_target)
    )
