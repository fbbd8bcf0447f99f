"""A request goes out at most twice, the client's own resend and the pipeline's failover together: a request an
engine lost is sent to the other engine once, without a resend of the client's there; one the client already
sent twice is never failed over."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.admission.destination import Destination
from gateway.config import Settings
from gateway.engine.engine import Engine
from gateway.errors import UpstreamLost
from gateway.guard import pipeline
from gateway.guard.context import Booking, RequestContext
from gateway.guard.parts import Parts
from gateway.metrics import Metrics
from gateway.tenants import Grant

ANSWER = b'{"choices": [], "usage": {"completion_tokens": 1}}'


class Answer:
    status = 200
    headers: dict[str, str] = {}

    async def read_all(self) -> bytes:
        return ANSWER

    def close(self) -> None:
        pass


class Client:
    """An engine's client: loses the request (``lost``: the ``UpstreamLost`` it raises) or answers it."""

    def __init__(self, lost: UpstreamLost | None) -> None:
        self.lost = lost
        self.opened: list[dict[str, Any]] = []

    async def open(self, method: str, path: str, **kw: Any) -> Answer:
        self.opened.append(kw)
        if self.lost is not None:
            raise self.lost
        return Answer()


class Booked:
    """A reservation placed on the first engine not avoided."""

    queue_ms = 0.0

    def __init__(self, avoid: frozenset[str]) -> None:
        index = 0 if "e0" not in avoid else 1
        self.target = Destination(f"e{index}", index)

    async def __aenter__(self) -> Booked:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    def observe_output_tokens(self, generated: int, first_token_s: float | None = None) -> None:
        pass

    def sent(self) -> None:
        pass

    def release(self, *, completed: bool = True) -> None:
        pass


class Admission:
    def reservation(self, **kw: Any) -> Booked:
        return Booked(kw["avoid"])

    def budget_blocks(self) -> int | None:
        return None


def lost(resent: bool) -> UpstreamLost:
    error = UpstreamLost("The upstream closed the connection before answering.", may_have_read=True)
    error.resent = resent
    return error


async def exchange(first: Client, second: Client) -> list[Any]:
    engines = [Engine(first, None, None), Engine(second, None, None)]  # type: ignore[arg-type]
    parts = Parts(Settings(), Metrics(), engines[0], Admission(), engines=engines)  # type: ignore[arg-type]
    ctx = RequestContext("r1", "completions", "/v1/completions", {"model": "m"})
    return [piece async for piece in pipeline.admit_and_exchange(
        parts, ctx, b"{}", Booking(1, 1, 1), Grant.unlimited()
    )]


async def test_a_request_its_engine_lost_goes_to_the_other_engine_once_and_is_not_resent_there() -> None:
    first, second = Client(lost(resent=False)), Client(None)
    (reply,) = await exchange(first, second)
    assert reply.body == ANSWER
    assert [kw["resend"] for kw in first.opened] == [True] and [kw["resend"] for kw in second.opened] == [False]


async def test_a_request_its_client_already_sent_twice_is_never_failed_over() -> None:
    first, second = Client(lost(resent=True)), Client(None)
    with pytest.raises(UpstreamLost):
        await exchange(first, second)
    assert len(first.opened) == 1 and not second.opened
