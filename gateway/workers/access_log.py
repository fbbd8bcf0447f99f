"""A worker's access log (``seams.AccessLogging``): its lines formatted and redacted here, written by the authority.

The authority writes every process's lines to its one output, so that no process's write cuts another's line; the
formatting and the redaction are each worker's own, in a thread of its own as one process's default writer does
(``observe/access_log.py``'s ``DefaultHandler``), so that the authority's core, the one every worker waits on, only
writes them: formatting a record there cost it tens of microseconds a request (``docs/overhead.md``, "What the
authority no longer does").
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

from gateway.observe.access_log import AccessLogFormat, AccessRecord, DefaultHandler
from gateway.workers.messages import Access, Message


class Sender(Protocol):
    """The worker's channel to the authority (``remote.AuthorityClient``)."""

    def send(self, message: Message) -> None: ...


class ForwardedAccessLog:
    """A worker's access log (``seams.AccessLogging``): a thread of this process formats and redacts its records,
    as the default writer does (``DefaultHandler``), and each batch of lines goes to the authority in one message;
    the authority writes every process's lines to the one output, so that no process cuts another's line. The
    formatting is the worker's, not the authority's: the authority's core is the one all workers wait on
    (``docs/overhead.md``, "The authority's coordination, per process"). ``stop`` sends what is still queued."""

    def __init__(self, fmt: AccessLogFormat, client: Sender) -> None:
        self.fmt = fmt
        self._client = client
        self._loop = asyncio.get_running_loop()
        self._writer = DefaultHandler(fmt, _ToAuthority(self)) if fmt != "off" else None

    @property
    def on(self) -> bool:
        return self.fmt != "off"

    def write(self, record: AccessRecord) -> None:
        if self._writer is not None:
            self._writer.put(record)  # formatted by its thread, then sent from the loop (``_ToAuthority``)

    def write_lines(self, text: str) -> None:
        if self.fmt != "off" and text:
            self._client.send(Access(text))

    def stop(self) -> None:
        if self._writer is not None:
            self._writer.stop()
            self._writer = None


class _ToAuthority:
    """The worker's access-log thread's output: each batch of lines is sent on the loop, the channel's thread."""

    def __init__(self, log: ForwardedAccessLog) -> None:
        self._log = log

    def write(self, text: str) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: the worker is stopping
            self._log._loop.call_soon_threadsafe(self._log.write_lines, text)

    def flush(self) -> None:
        pass  # sent as written
