"""The access log's two formats parse back into the same record, with stable keys; off writes nothing."""

from __future__ import annotations

import asyncio
import io
import logging
import re
import shlex
import threading
import time
from dataclasses import replace

import orjson
import pytest

from gateway.clip import FIELD_CHARS, clip, digest
from gateway.observe.access_log import (
    _PLAIN,
    FIELDS,
    HAND_OFF_AT,
    LOGGER_NAME,
    AccessLog,
    AccessRecord,
    DefaultHandler,
    format_json,
    format_text,
    install_default_handler,
    quote,
)

RECORD = AccessRecord(
    time=1_795_000_000.25, request_id="req-1", tenant="team a", route="chat", model='tiny "v2"', status=200,
    outcome="ok", reason=None, prompt_tokens=12, max_tokens_asked=4000, max_tokens=2036, truncated_tokens=0,
    queue_ms=1.26, engine="0", ttft_ms=15.04, duration_ms=40.0, completion_tokens=7, trace_id=None,
)


def parse_text(line: str) -> dict[str, str]:
    """logfmt as a shell splits it: quoted values unquoted (our escapes are shell escapes for these values)."""
    pairs = [token.split("=", 1) for token in shlex.split(line)]
    return {key: value for key, value in pairs}


def test_json_is_one_object_with_every_key_in_order() -> None:
    data = orjson.loads(format_json(RECORD))
    assert tuple(data) == FIELDS
    assert data["time"] == "2026-11-18T11:06:40.250Z"
    assert (data["model"], data["queue_ms"], data["ttft_ms"], data["trace_id"]) == ('tiny "v2"', 1.3, 15.0, None)


def test_text_is_key_value_pairs_with_every_key_in_order_and_quoting() -> None:
    line = format_text(RECORD)
    fields = parse_text(line)
    assert tuple(fields) == FIELDS
    assert (fields["tenant"], fields["model"], fields["status"], fields["reason"]) == ("team a", 'tiny "v2"', "200", "")
    assert 'model="tiny \\"v2\\""' in line


@pytest.mark.parametrize(("value", "written"), [
    (None, ""), ("plain-1.0/x:y", "plain-1.0/x:y"), ("", '""'), ("a b", '"a b"'), ("k=v", '"k=v"'),
    ("line\nbreak", '"line\\nbreak"'), ("bell\x07", '"bell\\u0007"'), ('back\\slash', '"back\\\\slash"'),
])
def test_a_text_value_is_quoted_when_it_is_not_plain(value: str | None, written: str) -> None:
    assert quote(value) == written


@pytest.mark.parametrize("value", [0, -3, 10**30, 1.5, -0.25, 1e30, -1e-7, float("inf"), float("-inf"), float("nan")])
def test_a_number_is_written_as_python_writes_it_and_never_quoted(value: float) -> None:
    assert quote(value) == str(value)
    assert _PLAIN.fullmatch(str(value))  # as the plain test would have found it


def test_a_value_can_never_start_a_line_or_a_field_of_its_own() -> None:
    forged = replace(RECORD, model="x\nstatus=500 outcome=ok")
    line = format_text(forged)
    assert "\n" not in line and parse_text(line)["status"] == "200"
    assert len(re.findall(r"(?:^| )status=", line)) == 1


def test_records_go_to_their_own_logger_at_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    AccessLog("json").write(RECORD)
    AccessLog("off").write(RECORD)
    [record] = [r for r in caplog.records if r.name == LOGGER_NAME]
    assert orjson.loads(record.getMessage())["request_id"] == "req-1"


def test_the_default_handler_writes_plain_lines_through_its_thread_and_stops() -> None:
    out = io.StringIO()
    logger = logging.getLogger(LOGGER_NAME)
    listener = install_default_handler("text", out)
    assert listener is not None
    try:
        assert install_default_handler("text", out) is None  # routed already: left as it is
        AccessLog("text").write(RECORD)
    finally:
        listener.stop()  # writes what is queued, and gives the logger back as it was
    assert out.getvalue() == format_text(RECORD) + "\n"
    assert (logger.handlers, logger.propagate, logger.level) == ([], True, logging.NOTSET)


def test_the_default_handler_writes_every_record_whatever_the_log_level() -> None:
    out = io.StringIO()
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(logging.WARNING)  # --log-level warning: other logs quiet, the access log still on
    listener = install_default_handler("text", out)
    assert listener is not None
    try:
        log = AccessLog("text")
        assert log.on
        log.write(RECORD)
    finally:
        listener.stop()
        logger.setLevel(logging.NOTSET)
    assert out.getvalue() == format_text(RECORD) + "\n"


def test_a_workers_lines_are_written_as_they_are_in_turn_with_this_process_s_records() -> None:
    out = io.StringIO()
    listener = install_default_handler("text", out)
    assert listener is not None
    try:
        log = AccessLog("text")
        log.write(RECORD)
        log.write_lines("request_id=w-1 status=200\nrequest_id=w-2 status=429\n")
        log.write(RECORD)
    finally:
        listener.stop()
    line = format_text(RECORD) + "\n"
    assert out.getvalue() == line + "request_id=w-1 status=200\nrequest_id=w-2 status=429\n" + line


def test_a_workers_lines_go_to_the_logger_one_record_a_line_where_logging_routes_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    AccessLog("text").write_lines("request_id=w-1\nrequest_id=w-2\n")
    AccessLog("off").write_lines("request_id=w-3\n")
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME] == ["request_id=w-1", "request_id=w-2"]


class Writes:
    """A line sink that keeps each write apart and says when one came."""

    def __init__(self) -> None:
        self.writes: list[str] = []
        self.came = threading.Event()

    def write(self, text: str) -> None:
        self.writes.append(text)
        self.came.set()

    def flush(self) -> None:
        pass

    async def next_write(self) -> None:
        assert await asyncio.to_thread(self.came.wait, 10), "nothing was written"
        self.came.clear()


async def test_records_put_on_the_loop_wait_there_and_reach_the_writer_in_one_write() -> None:
    sink = Writes()
    handler = DefaultHandler("text", sink, every=3600)
    lines = [format_text(replace(RECORD, request_id=f"req-{n}")) + "\n" for n in range(3)]
    for n in range(3):
        handler.put(replace(RECORD, request_id=f"req-{n}"))
    assert not await asyncio.to_thread(sink.came.wait, 0.2)  # the thread was not woken for each of them
    handler.stop()
    assert sink.writes == ["".join(lines)]


async def test_what_waits_on_the_loop_is_handed_over_when_the_timer_fires() -> None:
    sink = Writes()
    handler = DefaultHandler("text", sink, every=0.01)
    try:
        handler.put(RECORD)
        await sink.next_write()
        assert sink.writes == [format_text(RECORD) + "\n"]
    finally:
        handler.stop()


async def test_a_full_batch_is_handed_over_at_once_without_waiting_for_the_timer() -> None:
    sink = Writes()
    handler = DefaultHandler("text", sink, every=3600)
    try:
        for _ in range(HAND_OFF_AT):
            handler.put(RECORD)
        await sink.next_write()
        assert sink.writes == [(format_text(RECORD) + "\n") * HAND_OFF_AT]
    finally:
        handler.stop()


async def test_stop_writes_what_still_waits_on_the_loop() -> None:
    sink = Writes()
    handler = DefaultHandler("json", sink, every=3600)
    handler.put(RECORD)
    handler.put("request_id=w-1\n")
    handler.stop()
    assert "".join(sink.writes) == format_json(RECORD) + "\nrequest_id=w-1\n"


def test_a_record_put_off_the_loop_goes_to_the_writer_at_once() -> None:
    sink = Writes()
    handler = DefaultHandler("text", sink, every=3600)
    try:
        handler.put(RECORD)
        assert sink.came.wait(10)
        assert sink.writes == [format_text(RECORD) + "\n"]
    finally:
        handler.stop()


def test_off_installs_nothing() -> None:
    assert install_default_handler("off") is None


# -- every field bounded, whatever the request ------------------------------------------------------
HUGE = 8 * 1024 * 1024  # a model name of 8 MiB fits the default --max-body-bytes


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_an_integer_a_client_sent_beyond_64_bits_is_written_whole_and_the_writer_writes_on(fmt: str) -> None:
    huge = replace(RECORD, max_tokens_asked=10**30)
    out = io.StringIO()
    listener = install_default_handler(fmt, out)  # type: ignore[arg-type]
    assert listener is not None
    try:
        log = AccessLog(fmt)  # type: ignore[arg-type]
        log.write(huge)
        log.write(RECORD)
    finally:
        listener.stop()
    first, second = out.getvalue().splitlines()
    assert "1000000000000000000000000000000" in first
    if fmt == "json":
        assert orjson.loads(second) == orjson.loads(format_json(RECORD))
        assert first == format_json(huge) and '"max_tokens_asked":1000000000000000000000000000000' in first


@pytest.mark.parametrize("fmt", ["text", "json"])
@pytest.mark.parametrize("field", ["model", "tenant", "reason", "engine", "route", "request_id", "trace_id"])
def test_a_field_of_any_length_is_written_cut_with_its_length_and_a_hash(fmt: str, field: str) -> None:
    value = "m\u00e9\\\"" * (HUGE // 4)
    line = (format_json if fmt == "json" else format_text)(replace(RECORD, **{field: value}))
    written = str(parse_text(line)[field] if fmt == "text" else orjson.loads(line)[field])
    assert len(line) < 4096, len(line)
    assert written == clip(value) and len(written) <= FIELD_CHARS
    assert written.endswith(f"...[cut: {len(value)} chars, {digest(value)}]")
    assert value.startswith(written[: written.index("...[cut:")])


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_huge_value_costs_the_caller_no_more_than_an_ordinary_one(fmt: str) -> None:
    """The loop's cost of a line is bounded: an 8 MiB model name took 1.3-2.5 s escaped character by character
    (text), 0.3-0.4 s in JSON; cut first, it is a line like any other (microseconds; 50 ms allows a busy host)."""
    huge = replace(RECORD, model="m\u00e9" * (HUGE // 2), tenant="t\u2028" * (HUGE // 2))
    write = format_json if fmt == "json" else format_text
    started = time.perf_counter()
    write(huge)
    assert time.perf_counter() - started < 0.05


@pytest.mark.parametrize("brk", ["\u2028", "\u2029", "\u0085", "\n", "\r", "\x0b", "\x0c", "\x1c", "\x1e"])
@pytest.mark.parametrize("fmt", ["text", "json"])
def test_no_unicode_line_break_is_written_raw(fmt: str, brk: str) -> None:
    """Log shippers that split on Unicode line breaks (str.splitlines' set) read one record as one line."""
    model = f"a{brk}b"
    line = (format_json if fmt == "json" else format_text)(replace(RECORD, model=model))
    assert len(line.splitlines()) == 1 and brk not in line
    if fmt == "json":
        assert orjson.loads(line)["model"] == model  # the escape means the same character
