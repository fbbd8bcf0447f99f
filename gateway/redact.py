"""Secrets kept out of everything the gateway shows: credentials in URLs, API keys, log records.

Every place that shows a URL passes it through ``redact_url``. Log records also pass through a
``SecretRedactor`` installed at start-up (``install_log_redaction``), which replaces every configured secret
and any URL credentials in any record, from any library: a second line of defence behind the first.

The same pass bounds every record: a text argument is cut to ``ARGUMENT_CHARS``, the message to
``MESSAGE_CHARS`` (a traceback to ``EXCEPTION_CHARS``), in ``gateway/clip.py``'s cut form before anything
formats or searches them, whatever a client sent into them (a model name, a path). An argument is cut before
the message is formatted, so a megabyte argument costs microseconds, not the copy and the search of a megabyte
line on the event loop.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from gateway.clip import cut_marker

REDACTED = "***"
# Shorter secrets are not replaced everywhere: they would garble every log line, and a key that short is
# guessable anyway. URLs with credentials are redacted whatever their length.
MIN_SECRET_CHARS = 4

# The longest log message (characters): Docker's json-file driver splits longer lines, as do shippers with a
# line limit of their own; the access log's lines are a few KiB at most (gateway/observe/access_log.py).
MESSAGE_CHARS = 16 * 1024
# The longest text argument of a record, so that a message with a few of them is not cut again (its marker keeps
# the argument's own length and hash).
ARGUMENT_CHARS = 4 * 1024
# The longest traceback of a record: a deep async stack with its chained causes fits.
EXCEPTION_CHARS = 64 * 1024
# Characters past a cut that are redacted with the text before it: a secret or a URL's credentials that straddle
# the cut are replaced whole, never shown in part.
_CUT_SLACK = 1024

# scheme://userinfo@ in free text; greedy up to the authority's last '@', as URL parsers read it.
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)[^/?#\s\"'<>]*@")


def redact_url(url: str) -> str:
    """The URL with its user and password hidden: ``http://user:pw@host:8000`` -> ``http://***@host:8000``."""
    try:
        parts = urlsplit(url)
    except ValueError:  # a malformed URL is still shown only redacted
        return redact_urls_in(url)
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{REDACTED}@{host}"))


def redact_urls_in(text: str) -> str:
    """``text`` with the credentials of every URL in it hidden."""
    # Only a text with "://" can hold one: the test is 0.2 us where the search is 7.3 us on an access-log line of
    # 278 characters with none, and every line and log record passes here.
    return _URL_USERINFO.sub(rf"\g<1>{REDACTED}@", text) if "://" in text else text


def url_has_credentials(url: str) -> bool:
    try:
        return "@" in urlsplit(url).netloc
    except ValueError:
        return False


def url_secrets(url: str) -> list[str]:
    """The password of a URL, as written and percent-decoded (logs may show either)."""
    try:
        netloc = urlsplit(url).netloc
    except ValueError:
        return []
    userinfo, at, _ = netloc.rpartition("@")
    _, colon, password = userinfo.partition(":")
    if not at or not colon or not password:
        return []
    return [password, unquote(password)]


class SecretRedactor(logging.Filter):
    """Replaces each secret, and every URL's credentials, with ``***``: in text, and in log records. The settings'
    secrets are ``Settings.secrets()``.

    Usable as a ``logging.Filter`` on a handler or logger; ``install_log_redaction`` applies it to every record
    created in the process instead, since handlers (uvicorn's own among them) come and go.
    """

    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        kept = sorted({s for s in secrets if len(s) >= MIN_SECRET_CHARS}, key=len, reverse=True)
        # Longest first, so that a secret containing another is replaced whole.
        self._pattern = re.compile("|".join(re.escape(s) for s in kept)) if kept else None

    def redact(self, text: str) -> str:
        text = redact_urls_in(text)
        return self._pattern.sub(REDACTED, text) if self._pattern is not None else text

    def redact_within(self, text: str, limit: int) -> str:
        """``text`` redacted, and cut to ``limit`` characters in the cut form when longer (``gateway/clip.py``):
        only its start is searched (a secret straddling the cut is still replaced whole)."""
        if len(text) <= limit:
            return self.redact(text)
        tail = cut_marker(text)
        return self.redact(text[: limit + _CUT_SLACK])[: max(0, limit - len(tail))] + tail

    def filter(self, record: logging.LogRecord) -> bool:
        self.scrub(record)
        return True

    def scrub(self, record: logging.LogRecord) -> None:
        """Redact and bound the record's message (arguments merged in), its traceback and its stack, in place."""
        args = record.args
        if isinstance(args, tuple) and any(isinstance(a, str) and len(a) > ARGUMENT_CHARS for a in args):
            record.args = tuple(self.redact_within(a, ARGUMENT_CHARS) if isinstance(a, str) else a for a in args)
        try:
            message = record.getMessage()
        except Exception:
            # A call whose arguments do not fit its format: logging reports it later, arguments included.
            message = f"{record.msg} {record.args!r}"
            record.msg, record.args = self.redact_within(message, MESSAGE_CHARS), ()
        else:
            redacted = self.redact_within(message, MESSAGE_CHARS)
            if redacted != message:
                record.msg, record.args = redacted, ()
        if record.exc_info and not record.exc_text:
            # Formatted here, as a formatter would, so that exception texts are redacted too.
            record.exc_text = self.redact_within(_FORMATTER.formatException(record.exc_info), EXCEPTION_CHARS)
        elif record.exc_text:
            record.exc_text = self.redact_within(record.exc_text, EXCEPTION_CHARS)
        if record.stack_info:
            record.stack_info = self.redact_within(record.stack_info, EXCEPTION_CHARS)


_FORMATTER = logging.Formatter()


_active: list[SecretRedactor] = []  # the one installed, for writers that bypass log records (the access log's)


def active_redactor() -> SecretRedactor | None:
    return _active[-1] if _active else None


def install_log_redaction(redactor: SecretRedactor) -> Callable[[], None]:
    """Redact every log record from now on, whichever logger or handler it goes to; returns the undo."""
    previous = logging.getLogRecordFactory()
    _active.append(redactor)

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        redactor.scrub(record)
        return record

    logging.setLogRecordFactory(factory)

    def undo() -> None:
        logging.setLogRecordFactory(previous)
        if redactor in _active:
            _active.remove(redactor)

    return undo
