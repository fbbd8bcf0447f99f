"""The workers' channel: length-prefixed typed messages, whole whatever the reads, in one write per loop turn; a
frame too large, not JSON or not a well-formed message ends the connection (one that nothing waits on is dropped
alone); a peer that reads nothing is let go past a bound."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import orjson
import pytest

from gateway.workers import channel as channel_module
from gateway.workers.channel import MAX_MESSAGE, Channel
from gateway.workers.messages import Alive, End, Message, Progress, Rejected, Release, Withdraw, encode


class Recorder:
    def __init__(self) -> None:
        self.got: list[Message] = []
        self.lost = 0

    def channel(self) -> Channel:
        return Channel(self.got.append, self.lost_one)

    def lost_one(self) -> None:
        self.lost += 1


class Transport:
    def __init__(self, unread: int = 0) -> None:
        self.writes: list[bytes] = []
        self.closed = False
        self.unread = unread

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def get_write_buffer_size(self) -> int:
        return self.unread

    def close(self) -> None:
        self.closed = True


def raw(value: Any) -> bytes:
    body = orjson.dumps(value)
    return struct.pack(">I", len(body)) + body


def frame(message: Message) -> bytes:
    return raw(encode(message))


MESSAGES: list[Message] = [Release(i, i % 2 == 0, 10 * i) for i in range(5)]
STREAM = b"".join(frame(m) for m in MESSAGES)


@pytest.mark.parametrize("size", [1, 3, 7, len(STREAM)])
async def test_messages_arrive_whole_whatever_the_reads(size: int) -> None:
    rec = Recorder()
    channel = rec.channel()
    for at in range(0, len(STREAM), size):
        channel.data_received(STREAM[at : at + size])
    assert rec.got == MESSAGES and rec.lost == 0


async def test_what_one_loop_turn_sends_goes_in_one_write() -> None:
    rec = Recorder()
    channel, transport = rec.channel(), Transport()
    channel.connection_made(transport)  # type: ignore[arg-type]
    for message in MESSAGES:
        channel.send(message)
    assert transport.writes == []
    await asyncio.sleep(0)
    assert transport.writes == [STREAM]


async def test_what_its_owner_held_back_goes_in_the_write_a_wake_asked_for() -> None:
    held: list[Message] = []

    def send_held() -> None:
        while held:
            channel.send(held.pop(0))

    channel, transport = Channel(lambda m: None, lambda: None, send_held), Transport()
    channel.connection_made(transport)  # type: ignore[arg-type]
    held += MESSAGES[1:]
    channel.send(MESSAGES[0])
    channel.wake()  # once, whatever the number of asks
    await asyncio.sleep(0)
    assert transport.writes == [STREAM] and not held
    channel.wake()  # nothing held, nothing sent: no write
    await asyncio.sleep(0)
    assert transport.writes == [STREAM]


async def test_what_is_sent_before_the_connection_is_made_waits_for_it() -> None:
    rec = Recorder()
    channel, transport = rec.channel(), Transport()
    channel.send(MESSAGES[0])
    await asyncio.sleep(0)
    channel.connection_made(transport)  # type: ignore[arg-type]
    assert transport.writes == [frame(MESSAGES[0])]


BAD_FRAMES = {
    "too large": struct.pack(">I", MAX_MESSAGE + 1),
    "not JSON": struct.pack(">I", 3) + b"{x]",
    "no kind": raw({"type": "release", "id": "a"}),
    "an unknown kind": raw(["promote", [1]]),
    "a field missing": raw(["release", [1, True]]),
    "a key that is the client's id": raw(["release", ["retry-1", True, 3]]),
    "a bool for a number": raw(["end", [1, True]]),
    "an admit without its booking": raw(["admit", [1, None, None]]),
}


@pytest.mark.parametrize("bad", BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
async def test_a_bad_frame_ends_the_connection(bad: bytes, caplog: pytest.LogCaptureFixture) -> None:
    rec = Recorder()
    channel, transport = rec.channel(), Transport()
    channel.connection_made(transport)  # type: ignore[arg-type]
    channel.data_received(frame(MESSAGES[0]) + bad + frame(MESSAGES[1]))
    assert rec.got == MESSAGES[:1] and transport.closed and rec.lost == 1
    assert "on the workers' channel; closing it" in caplog.text


async def test_a_malformed_message_nothing_waits_on_is_dropped_alone(caplog: pytest.LogCaptureFixture) -> None:
    rec = Recorder()
    channel, transport = rec.channel(), Transport()
    channel.connection_made(transport)  # type: ignore[arg-type]
    channel.data_received(frame(MESSAGES[0]) + raw(["rejected", ["tenant", 7]]) + frame(Rejected("t", "queue_full")))
    assert rec.got == [MESSAGES[0], Rejected("t", "queue_full")] and not transport.closed and rec.lost == 0
    assert "dropped" in caplog.text


async def test_engines_and_keys_by_number_cross_as_numbers() -> None:
    rec = Recorder()
    sender, transport = rec.channel(), Transport()
    sender.connection_made(transport)  # type: ignore[arg-type]
    sent = Progress({12: 40}, {0: (1, 2, 3)}, {1: None}, {12: 0.5})
    sender.send(sent)
    await asyncio.sleep(0)
    rec.channel().data_received(transport.writes[0])
    assert rec.got == [sent]


async def test_a_message_its_handler_fails_on_is_logged_and_the_next_still_handled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    got: list[Message] = []

    def handle(message: Message) -> None:
        if isinstance(message, Withdraw):
            raise KeyError("booking")
        got.append(message)

    channel = Channel(handle, lambda: None)
    channel.data_received(frame(Withdraw(1)) + frame(End(1, 2.0)))
    assert got == [End(1, 2.0)] and "handling a message" in caplog.text


async def test_a_peer_that_reads_nothing_is_let_go_past_the_backlog(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(channel_module, "MAX_BACKLOG", 1000)
    rec = Recorder()
    channel, transport = rec.channel(), Transport(unread=1001)
    channel.connection_made(transport)  # type: ignore[arg-type]
    channel.send(Alive())
    await asyncio.sleep(0)
    assert transport.closed and rec.lost == 1 and channel.closed


async def test_whatever_the_peer_sends_is_heard() -> None:
    loop = asyncio.get_running_loop()
    rec = Recorder()
    channel = rec.channel()
    channel.heard_at = loop.time() - 10
    channel.data_received(frame(Alive())[:2])  # half a frame is still a word from the peer
    assert loop.time() - channel.heard_at < 1
