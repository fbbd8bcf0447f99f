"""A worker's access log: each record formatted and redacted in a thread of the worker's own, the lines sent to the
authority a batch a message, on the loop."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.observe.access_log import AccessRecord, format_json, format_text
from gateway.workers.access_log import ForwardedAccessLog
from gateway.workers.messages import Access, Message

RECORD = AccessRecord(
    time=1.7e9, request_id="r-1", tenant="search", route="chat", model="tiny", status=200, outcome="ok", reason=None,
    prompt_tokens=16, max_tokens_asked=10**30, max_tokens=32, truncated_tokens=None, queue_ms=1.5, engine="e0",
    ttft_ms=None, duration_ms=20.0, completion_tokens=32, trace_id=None,
)


class Sent:
    def __init__(self, lines: int) -> None:
        self.sent: list[Message] = []
        self.lines = lines
        self.all_sent = asyncio.Event()

    def send(self, message: Message) -> None:
        assert asyncio.get_running_loop() is not None  # on the loop, the channel's thread
        self.sent.append(message)
        if lines_of(self.sent).count("\n") >= self.lines:
            self.all_sent.set()


def lines_of(sent: list[Message]) -> str:
    return "".join(m.lines for m in sent if isinstance(m, Access))


@pytest.mark.parametrize(("fmt", "format_"), [("text", format_text), ("json", format_json)])
async def test_a_workers_records_reach_the_authority_as_the_lines_it_would_have_written(fmt: Any, format_: Any) -> None:
    client = Sent(2)
    log = ForwardedAccessLog(fmt, client)  # type: ignore[arg-type]
    assert log.on
    log.write(RECORD)
    log.write(RECORD)
    await asyncio.wait_for(client.all_sent.wait(), 5)  # sent by the loop, with nothing stopped
    log.stop()
    assert lines_of(client.sent) == 2 * (format_(RECORD) + "\n")  # the client's 10^30 written whole
    assert "1000000000000000000000000000000" in lines_of(client.sent)


async def test_stopping_sends_what_is_still_queued_and_off_sends_nothing() -> None:
    client = Sent(50)
    log = ForwardedAccessLog("text", client)  # type: ignore[arg-type]
    for _ in range(50):
        log.write(RECORD)
    log.stop()  # the thread's last batches are handed to the loop
    await asyncio.sleep(0)
    assert lines_of(client.sent).count("\n") == 50
    off = ForwardedAccessLog("off", client)  # type: ignore[arg-type]
    off.write(RECORD)
    off.write_lines("request_id=x\n")
    off.stop()
    await asyncio.sleep(0)
    assert lines_of(client.sent).count("\n") == 50 and not off.on
