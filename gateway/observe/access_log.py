"""The access log: one line per guarded request, in a form log pipelines parse (``--access-log text|json|off``).

Each line is one ``AccessRecord`` with the same keys in the same order (``FIELDS``): ``json`` writes one JSON
object per line, ``text`` ``key=value`` pairs (logfmt: a value with a space, a quote, ``=`` or a control
character is double-quoted with backslash escapes; an unknown value is empty). Lines go through Python logging
on their own logger, ``vllm_guard.access``, so that operators route them like any other log; the process-wide
redaction (``gateway/redact.py``) applies to them as to every record. Nothing here knows who the caller is
beyond its tenant's name: a key never reaches a record.

**Every field is bounded**, whatever the request: a text value longer than ``clip.FIELD_CHARS`` (256) characters
is written in ``gateway/clip.py``'s cut form (its start, then ``...[cut: <length> chars, <hash>]``), so a line
is at most a few KiB and costs the same to write whatever a client sent (a model name of 8 MiB made an 8 MB line
and held the event loop 1.3-2.5 s escaping it). A line is one line for every reader: ``text`` escapes every
character that is not printable, ``json`` the Unicode line breaks JSON allows raw (U+0085, U+2028, U+2029) and
that log shippers splitting on Unicode line breaks would cut a record at.

Unless logging already routes that logger, ``install_default_handler`` writes it to standard output through a
thread: the request path only appends the record to a batch that the loop hands to the thread every
``HAND_OFF_EVERY`` seconds (a thread woken for each record cost more than the record), and the thread writes it, so
a slow reader of the gateway's output (a full pipe to a log shipper) never holds the event loop. The writer thread
formats and redacts the records too: the caller pays an append. Measured by ``python -m bench run access-log`` (each
record's cost to the caller, until written, and in the process's CPU; the writer's work still holds the
interpreter's lock the loop needs, so the bound matters as much as the thread). With the line formatted on the
caller, 3 runs each on the shared 2-core test machine: before the bound (load 2-3), an ordinary record 80-147 us, an
8 MiB model name 1.3-1.6 s (text) and 0.32-0.37 s (json); with it (load 5-9), an ordinary record 95-200 us, a 1 MiB
or 8 MiB model name 130-740 us in either format. Formatted by the writer thread (2026-11-28, at 6cf7cd5, load 0.5):
the caller 0.3-0.5 us an ordinary record and 38-208 us a 1 MiB or 8 MiB one, 46-61 us of the process's CPU an
ordinary record, 125-249 us a huge one. With the pipe's reader stalled, 2,000 queued records took 86 ms on the
caller, while the direct handler was still blocked in its write after 2 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import Literal, Protocol

import orjson

from gateway.clip import clip
from gateway.redact import MESSAGE_CHARS, active_redactor

LOGGER_NAME = "vllm_guard.access"
AccessLogFormat = Literal["text", "json", "off"]


@dataclass(slots=True)
class AccessRecord:
    """What the gateway knows of one request once it has ended. ``None``: not known (a request refused before
    it was counted has no prompt tokens; only a stream has a time to its first event)."""

    time: float  # when the request arrived, seconds since the epoch
    request_id: str
    tenant: str | None  # the tenant's name from the keys file; never the key
    route: str
    model: str | None
    status: int  # the HTTP status answered (499: the client went away before the answer)
    outcome: str  # ok, refused (the client's doing or a limit), error (ours or the engine's), cancelled
    reason: str | None  # the refusal or failure reason, as vllm_guard_rejections_total counts it
    prompt_tokens: int | None
    max_tokens_asked: int | None  # as the client sent it (max_tokens, max_completion_tokens, max_output_tokens)
    max_tokens: int | None  # as sent to the engine (clamped)
    truncated_tokens: int | None
    queue_ms: float | None
    engine: str | None
    ttft_ms: float | None  # streams: arrival to the first event written to the client
    duration_ms: float  # arrival to the end of the answer
    completion_tokens: int | None
    trace_id: str | None


FIELDS = tuple(AccessRecord.__dataclass_fields__)


def iso_time(epoch: float) -> str:
    """UTC, milliseconds: ``2026-11-26T14:05:09.123Z``."""
    seconds = int(epoch)
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(seconds))}.{int((epoch - seconds) * 1000):03d}Z"


_MS = ("queue_ms", "ttft_ms", "duration_ms")


def _values(record: AccessRecord) -> dict[str, object]:
    # Field by field rather than dataclasses.asdict, which deep-copies: measured 5x the cost of the whole line.
    # Every text field clipped here, whoever filled the record: what a client sent is bounded on every path.
    values: dict[str, object] = {
        name: clip(value) if isinstance(value := getattr(record, name), str) else value for name in FIELDS
    }
    values["time"] = iso_time(record.time)
    for key in _MS:
        value = values[key]
        if isinstance(value, float):
            values[key] = round(value, 1)
    return values


# Unicode line breaks that JSON may carry raw (orjson writes them so) and that shippers splitting on Unicode line
# breaks (Python's str.splitlines, JavaScript's line terminators) would cut a record at. JSON escapes the rest.
_JSON_BREAKS = re.compile("[\u0085\u2028\u2029]")


def format_json(record: AccessRecord) -> str:
    values = _values(record)
    try:
        line = orjson.dumps(values).decode()
    except TypeError:  # an integer a client sent beyond 64 bits (max_tokens 10^30): orjson refuses it, json not
        line = json.dumps(values, ensure_ascii=False, separators=(",", ":"))
    # Such a character can only stand inside a JSON string, where its \u escape means the same.
    return _JSON_BREAKS.sub(lambda m: f"\\u{ord(m.group()):04x}", line) if _JSON_BREAKS.search(line) else line


_PLAIN = re.compile(r"[A-Za-z0-9\-_.:/+@,;]+")
# A character that needs quoting's escape: the quote, the backslash, and every one that is not printable.
_SPECIAL = re.compile(r'["\\]|[^\x20-\x7e]')
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    c = match.group()
    if (escape := _ESCAPES.get(c)) is not None:
        return escape
    code = ord(c)
    return c if c.isprintable() else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def quote(value: object) -> str:
    """One logfmt value: as is when plain, else double-quoted with escapes; None as nothing."""
    if value is None:
        return ""
    if type(value) is int or type(value) is float:  # digits, a sign, a point, an exponent, inf, nan: all plain
        return str(value)
    text = str(value)
    if _PLAIN.fullmatch(text):
        return text
    if text.isprintable():  # most values with a space or a letter beyond ASCII: escaped in C
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return f'"{_SPECIAL.sub(_escape, text)}"'


def format_text(record: AccessRecord) -> str:
    return " ".join(f"{key}={quote(value)}" for key, value in _values(record).items())


class LineSink(Protocol):
    """Where the default writer's thread puts a batch of lines: standard output, or a worker's channel."""

    def write(self, text: str, /) -> object: ...

    def flush(self) -> None: ...


class AccessLog:
    """Writes records in the configured format on ``vllm_guard.access`` (at INFO)."""

    def __init__(self, fmt: AccessLogFormat, logger: logging.Logger | None = None) -> None:
        self.fmt = fmt
        self._logger = logger if logger is not None else logging.getLogger(LOGGER_NAME)
        self._format = format_json if fmt == "json" else format_text

    @property
    def on(self) -> bool:
        """Whether a record is written: the default writer writes whatever ``--log-level`` says of other logs (the
        access log is ``--access-log``'s; at ``--log-level warning`` the authority wrote its workers' lines, which
        reach it as records, and dropped its own); a logger the operator routes follows its own level."""
        if self.fmt == "off":
            return False
        return _direct is not None or self._logger.isEnabledFor(logging.INFO)

    def write(self, record: AccessRecord) -> None:
        direct = _direct
        if direct is not None and self.fmt != "off":
            direct.put(record)  # formatted and written by its thread
        elif self.on:
            self._logger.info("%s", self._format(record))

    def write_lines(self, text: str) -> None:
        """Lines another process formatted and redacted (a worker's: ``workers/access_log.py``), each ending in a
        newline, written as they are with this process's own."""
        direct = _direct
        if direct is not None and self.fmt != "off":
            direct.put(text)
        elif self.on:
            for line in text.split("\n"):
                if line:
                    self._logger.info("%s", line)


# Records put on the event loop reach the writer's thread in batches: the first of a batch starts a timer, and the
# batch is handed over when it fires (or at once when ``HAND_OFF_AT`` records wait). A thread woken for each record
# paid a wake-up and two hand-overs of the interpreter's lock for each: at 40 short streams a second (8 at a time, 10
# tokens each, the gateway on one core) over 440 streams, the thread's CPU 60-70 ms before and 10-20 ms with the
# batches, the process's context switches 5,345-5,801 and 3,398-3,958 (three turns each; the process's whole CPU
# within its spread). A line is written at most this late; ``stop`` writes what waits.
HAND_OFF_EVERY = 0.1
HAND_OFF_AT = 256
# The thread formats a batch holding the interpreter's lock, which the loop waits for; left to the interpreter, the
# loop gets it back after up to 5 ms (``sys.getswitchinterval``). A batch of 0.1 s of short chats (~140 records,
# tens of us each in the thread) then held the loop up to 5 ms at a time: one chat at a time, p99 2.85-3.13 ms
# against 1.40-2.62 before the batching (three turns each). After ``YIELD_AFTER`` seconds of formatting the thread
# lets the loop take the lock. Not after every few records: every hand-over costs both threads their caches, and
# yielding every 8 records cost 1.14x the CPU a chat at 64 concurrent (five turns).
YIELD_AFTER = 0.001


class DefaultHandler:
    """The access log's default writer: records go on a list as they are (the loop pays an append), handed to a
    thread in batches (``HAND_OFF_EVERY``), and the thread formats, redacts (``gateway/redact.py``: the process's
    secrets) and writes them, a batch per write. Through Python logging the loop paid ~100 us a record (the
    record, the caller's frame looked up, a copy for the queue, the redaction's regexes), measured with ``python -m
    bench run access-log``. A record put off the event loop (or on another loop than the first) goes to the thread
    at once. ``stop`` writes what is still waiting."""

    def __init__(self, fmt: AccessLogFormat, stream: LineSink, *, every: float = HAND_OFF_EVERY) -> None:
        self._format = format_json if fmt == "json" else format_text
        self._stream = stream
        self._every = every
        # A batch of records and lines already formatted (a worker's), or None: stop.
        self._records: queue.SimpleQueue[list[AccessRecord | str] | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop whose records are batched
        self._waiting: list[AccessRecord | str] = []  # put on that loop, not yet handed over
        self._timer: asyncio.TimerHandle | None = None
        self._thread = threading.Thread(target=self._write, name="access-log", daemon=True)
        self._thread.start()

    def put(self, record: AccessRecord | str) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or (self._loop is not None and loop is not self._loop):
            self._records.put([record])
            return
        self._loop = loop
        waiting = self._waiting
        waiting.append(record)
        if len(waiting) >= HAND_OFF_AT:
            self._hand_off()
        elif self._timer is None:
            self._timer = loop.call_later(self._every, self._hand_off)

    def _hand_off(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        if self._waiting:
            batch, self._waiting = self._waiting, []
            self._records.put(batch)

    def _write(self) -> None:
        records = self._records
        while True:
            batches = [records.get()]
            with contextlib.suppress(queue.Empty):
                while len(batches) < 256:
                    batches.append(records.get_nowait())
            stop = None in batches
            lines: list[str] = []
            held_since = time.perf_counter()
            for batch in batches:
                for r in batch or ():
                    lines.append(r if isinstance(r, str) else self._line(r))
                    if time.perf_counter() - held_since > YIELD_AFTER:
                        time.sleep(0)  # the interpreter's lock back to the loop, if it waits for it
                        held_since = time.perf_counter()
            if lines:
                try:
                    self._stream.write("".join(lines))
                    self._stream.flush()
                except (OSError, ValueError):
                    pass  # a closed or broken standard output: the gateway serves on
            if stop:
                return

    def _line(self, record: AccessRecord) -> str:
        try:
            line = self._format(record)
        except Exception:  # a bug of ours in one record must not end the thread, and with it every later line
            logging.getLogger(__name__).exception("an access-log record could not be written: %.200r", record)
            return ""
        redactor = active_redactor()
        return (redactor.redact_within(line, MESSAGE_CHARS) if redactor is not None else line) + "\n"

    def stop(self) -> None:
        """Write what waits and end the thread; called on the loop's thread (during or after its run)."""
        global _direct
        if _direct is self:
            _direct = None
        self._hand_off()
        self._records.put(None)
        self._thread.join(10)


_direct: DefaultHandler | None = None  # the default writer, when installed (``vllm-guard serve``)


def install_default_handler(fmt: AccessLogFormat, stream: LineSink | None = None) -> DefaultHandler | None:
    """Write the access log to ``stream`` (standard output) from a thread of its own, unless it is off or logging
    routes it already (an operator's logging configuration). Returns the writer, started: the caller stops it
    on shutdown."""
    global _direct
    logger = logging.getLogger(LOGGER_NAME)
    if fmt == "off" or logger.handlers or _direct is not None:
        return None
    _direct = DefaultHandler(fmt, stream if stream is not None else sys.stdout)
    return _direct
