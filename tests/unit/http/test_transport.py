"""The connection's transport wrapper: an answer's head goes out with the write after it, and never after any
other byte: not after a stream's direct writes, not lost at a close, not held past the loop's turn."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from gateway.http.transport import LingeringTransport


class Recorder:
    """A transport that records its writes (each one a system call on a real socket)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.events: list[str] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def write_eof(self) -> None:
        self.events.append("eof")

    def close(self) -> None:
        self.events.append("close")
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing


def wrap(linger: Callable[[], bool] = lambda: False) -> tuple[LingeringTransport, Recorder]:
    inner = Recorder()
    return LingeringTransport(inner, linger), inner  # type: ignore[arg-type]


async def test_a_head_and_its_body_go_out_in_one_write() -> None:
    out, inner = wrap()
    out.hold_head()
    out.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    out.write(b"{}")
    assert inner.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
    await asyncio.sleep(0)
    assert len(inner.writes) == 1, "nothing is written twice"


async def test_a_head_alone_goes_out_at_the_end_of_the_loops_turn() -> None:
    out, inner = wrap()
    out.hold_head()
    out.write(b"HEAD")
    assert inner.writes == []
    await asyncio.sleep(0)
    assert inner.writes == [b"HEAD"]
    out.write(b"event")
    assert inner.writes == [b"HEAD", b"event"]


@pytest.mark.parametrize(
    ("ending", "then"),
    [
        ("a stream's writer takes the raw transport", lambda out: out.raw.write(b"event")),
        ("the connection closes", lambda out: out.close()),
        ("the connection half-closes", lambda out: out.write_eof()),
    ],
)
async def test_a_held_head_goes_out_before_anything_else_when(ending: str, then: Callable[[Any], None]) -> None:
    out, inner = wrap()
    out.hold_head()
    out.write(b"HEAD")
    then(out)
    assert inner.writes[0] == b"HEAD", ending
    await asyncio.sleep(0)
    assert inner.writes.count(b"HEAD") == 1


async def test_only_the_first_write_after_a_head_is_held() -> None:
    out, inner = wrap()
    out.write(b"unheld")
    out.hold_head()
    out.write(b"HEAD")
    out.write(b"body")
    out.write(b"more")
    assert inner.writes == [b"unheld", b"HEADbody", b"more"]


async def test_a_lingering_close_still_sends_the_held_head_first() -> None:
    out, inner = wrap(linger=lambda: True)
    out.hold_head()
    out.write(b"HEAD")
    out.close()
    assert inner.writes == [b"HEAD"] and inner.events == []


def test_once_let_go_a_close_closes_and_the_protocol_is_held_no_more() -> None:
    """The protocol holds its transport, and the transport the protocol's ``linger``: after the connection is lost
    that pair would be a reference cycle, each closed connection's, that only the cyclic collector frees."""
    import gc
    import weakref

    class Protocol:
        def linger(self) -> bool:
            return True

    protocol = Protocol()
    out, inner = wrap(protocol.linger)
    gone = weakref.ref(protocol)
    gc.disable()
    try:
        out.let_go()
        del protocol
        assert gone() is None
    finally:
        gc.enable()
    out.close()
    assert inner.events == ["close"]
