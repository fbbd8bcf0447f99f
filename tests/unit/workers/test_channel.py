"""The workers' channel: length-prefixed JSON messages, whole whatever the reads, in one write per loop turn;
a frame too large or not JSON ends the connection."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import orjson
import pytest

from gateway.workers.channel import MAX_MESSAGE, Channel


class Recorder:
    def __init__(self) -> None:
        self.got: list[dict[str, Any]] = []
        self.lost = 0

    def channel(self) -> Channel:
        return Channel(self.got.append, self.lost_one)

    def lost_one(self) -> None:
        self.lost += 1


class Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True


def frame(message: dict[str, Any]) -> bytes:
    body = orjson.dumps(message)
    return struct.pack(">I", len(body)) + body


MESSAGES = [{"type": "admit", "id": str(i), "booking": {"prompt_tokens": i}} for i in range(5)]
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


async def test_what_is_sent_before_the_connection_is_made_waits_for_it() -> None:
    rec = Recorder()
    channel, transport = rec.channel(), Transport()
    channel.send(MESSAGES[0])
    await asyncio.sleep(0)
    channel.connection_made(transport)  # type: ignore[arg-type]
    assert transport.writes == [frame(MESSAGES[0])]


@pytest.mark.parametrize(
    "bad", [struct.pack(">I", MAX_MESSAGE + 1), struct.pack(">I", 3) + b"{x]"], ids=["too large", "not JSON"]
)
async def test_a_bad_frame_ends_the_connection(bad: bytes) -> None:
    rec = Recorder()
    channel, transport = rec.channel(), Transport()
    channel.connection_made(transport)  # type: ignore[arg-type]
    channel.data_received(frame(MESSAGES[0]) + bad + frame(MESSAGES[1]))
    assert rec.got == MESSAGES[:1] and transport.closed and rec.lost == 1


async def test_engines_by_index_cross_as_keys() -> None:
    rec = Recorder()
    sender, transport = rec.channel(), Transport()
    sender.connection_made(transport)  # type: ignore[arg-type]
    sender.send({"type": "progress", "engines": {0: [1, 2, 3]}})
    await asyncio.sleep(0)
    receiver = rec.channel()
    receiver.data_received(transport.writes[0])
    assert rec.got == [{"type": "progress", "engines": {"0": [1, 2, 3]}}]


async def test_a_message_its_handler_fails_on_is_logged_and_the_next_still_handled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    got: list[dict[str, Any]] = []

    def handle(message: dict[str, Any]) -> None:
        if message["id"] == "0":
            raise KeyError("booking")
        got.append(message)

    channel = Channel(handle, lambda: None)
    channel.data_received(frame(MESSAGES[0]) + frame(MESSAGES[1]))
    assert got == [MESSAGES[1]] and "handling a message" in caplog.text
