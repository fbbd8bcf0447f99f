"""Cutting an upstream byte stream into whole server-sent events.

The upstream's reads fall anywhere: one read may hold three events, or half of one (under load, right after
``data:``). Clients that assume one event per write, as vLLM sends them (vLLM's own benchmark client among
them), fail on a split event, so the relay forwards exactly one whole event per write.

An event ends at a blank line; lines end with CRLF, LF or CR (the SSE spec). vLLM writes ``\\n\\n``, so that
is the fast path: ``bytes.find`` only, and a read that is exactly one event is forwarded without a copy.
"""

from __future__ import annotations

import re

from gateway.engine.client import UpstreamStream, decoder_for
from gateway.errors import BadUpstreamResponse

# A blank line after any line end; a lone CR is one only when no LF follows (else it starts a CRLF).
_BLANK_LINE = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?!\n)|\n)")
_LINE_ENDS = b"\r\n"


class PartialEvent(BadUpstreamResponse):
    """The upstream's stream ended in the middle of an event (a line without its end)."""


class SSEFramer:
    """Feeds upstream bytes in, takes whole events out. Bytes held waiting for an event's end are bounded by
    ``limit``: a longer "event" raises ``BadUpstreamResponse``."""

    __slots__ = ("_buf", "_cr", "_scan", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buf = bytearray()
        self._scan = 0  # where the search for the first event's end resumes
        self._cr = False  # a CR was seen: from then on the general (regex) scan

    def feed(self, data: bytes) -> list[bytes]:
        if not self._buf and not self._cr:
            if b"\r" in data:
                self._cr = True
            elif data.endswith(b"\n\n") and data.find(b"\n\n") == len(data) - 2 and data[0] != 0x0A:
                return [data]  # vLLM's usual read: exactly one event
        elif b"\r" in data:
            self._cr = True
        self._buf += data
        events = self._take(final=False)
        if len(self._buf) > self.limit:
            size = len(self._buf)
            self._buf.clear()
            self._scan = 0
            raise BadUpstreamResponse(
                f"The upstream sent a stream event larger than the limit of {self.limit} bytes "
                f"(at least {size} bytes without a blank line)."
            )
        return events

    def close(self) -> list[bytes]:
        """The upstream's end: the events still held. A last event whose lines are whole but which lacks its
        blank line is completed; one cut mid-line raises ``PartialEvent`` (a client could not parse it)."""
        events = self._take(final=True)
        rest = bytes(self._buf)
        self._buf.clear()
        if not rest:
            return events
        if rest[-1] in _LINE_ENDS:
            events.append(rest + rest[-1:])  # the same line end again: the blank line
            return events
        raise PartialEvent(
            f"The upstream ended the stream in the middle of an event ({len(rest)} bytes without a line end); "
            "that part was dropped."
        )

    def _take(self, *, final: bool) -> list[bytes]:
        buf = self._buf
        events: list[bytes] = []
        while buf:
            # Extra blank lines between events dispatch nothing: dropped, so every write starts an event.
            if buf[0] in _LINE_ENDS:
                del buf[: len(buf) - len(buf.lstrip(_LINE_ENDS))]
                self._scan = 0
                continue
            end = self._find_end(final)
            if end < 0:
                break
            events.append(bytes(buf[:end]))
            del buf[:end]
            self._scan = 0
        return events

    def _find_end(self, final: bool) -> int:
        buf = self._buf
        if not self._cr:
            i = buf.find(b"\n\n", self._scan)
            if i < 0:
                self._scan = max(0, len(buf) - 1)
                return -1
            return i + 2
        m = _BLANK_LINE.search(buf, self._scan)
        if m is None or (m.end() == len(buf) and buf[-1] == 0x0D and not final):
            # Resume a few bytes back: the blank line may straddle this read and the next.
            self._scan = max(0, len(buf) - 4)
            return -1
        return m.end()


def counts_as_token(event: bytes) -> bool:
    """vLLM sends one data event per generated token (per choice), then ``data: [DONE]``."""
    return event.startswith(b"data:") and not event.startswith(b"data: [DONE]")


def require_event_stream(stream: UpstreamStream) -> None:
    """Checked before anything is sent to the client, so that a wrong answer is still a plain 502."""
    ctype = stream.headers.get("content-type", "")
    if not ctype.startswith("text/event-stream"):
        raise BadUpstreamResponse(f"The upstream answered a stream request with content-type {ctype!r}.")
    decoder_for(stream.headers)  # an encoding it cannot decode is refused here too
