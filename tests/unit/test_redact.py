"""Every log record is bounded as it is redacted: a text argument, the message and a traceback are cut to their
bounds in the cut form of gateway/clip.py before anything formats or searches them, and a secret that straddles
the cut is still replaced whole (the redaction itself: tests/integration/test_secrets.py)."""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.redact import (
    _URL_USERINFO,
    EXCEPTION_CHARS,
    MESSAGE_CHARS,
    REDACTED,
    SecretRedactor,
    install_log_redaction,
    redact_urls_in,
)

SECRET = "sk-upstream-secret-0123456789"
HUGE = "m\u00e9" * (4 * 1024 * 1024)  # a model name of 8 MiB, as a client may send


def record(msg: Any, *args: Any, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord("t", logging.WARNING, __file__, 1, msg, args or None, exc_info)


def _raised(message: str) -> BaseException:
    try:
        raise RuntimeError(message)
    except RuntimeError as exc:
        return exc


# (a record, the most characters it may be written in, the most seconds bounding it may take): an argument is cut
# before the message is formatted, so its cost does not grow with it (50 ms allows a busy host); a traceback is
# formatted by logging's own code first, then cut.
CASES = [
    pytest.param(lambda: record("model %s not found", HUGE), MESSAGE_CHARS, 0.05, id="an argument"),
    pytest.param(lambda: record("%s and %s", HUGE, HUGE), MESSAGE_CHARS, 0.05, id="two arguments"),
    pytest.param(lambda: record(f"model {HUGE} not found"), MESSAGE_CHARS, 0.05, id="the message itself"),
    pytest.param(lambda: record("failed", exc=_raised(HUGE)), MESSAGE_CHARS + EXCEPTION_CHARS, None, id="a traceback"),
]


@pytest.mark.parametrize(("make", "bound", "seconds"), CASES)
def test_a_record_of_any_size_is_written_within_its_bounds(make: Any, bound: int, seconds: float | None) -> None:
    rec = make()
    started = time.perf_counter()
    SecretRedactor([SECRET]).filter(rec)
    took = time.perf_counter() - started
    line = logging.Formatter().format(rec)
    assert len(line) <= bound + 1, len(line)
    told = re.search(r"\.\.\.\[cut: (\d+) chars, [0-9a-f]{12}\]", line)
    assert told is not None and int(told.group(1)) >= len(HUGE)
    assert seconds is None or took < seconds


@pytest.mark.parametrize("at", [MESSAGE_CHARS - 10, MESSAGE_CHARS - 40, MESSAGE_CHARS + 5])
def test_a_secret_straddling_the_cut_is_never_shown_in_part(at: int) -> None:
    text = "x" * at + SECRET + "y" * (2 * MESSAGE_CHARS)
    rec = record("%s", text)
    SecretRedactor([SECRET]).filter(rec)
    line = rec.getMessage()
    assert len(line) <= MESSAGE_CHARS and SECRET[:6] not in line


def test_credentials_of_a_url_straddling_the_cut_are_never_shown_in_part() -> None:
    text = "x" * (MESSAGE_CHARS - 60) + "http://user:hunter2-password@host/ " + "y" * MESSAGE_CHARS
    rec = record(text)
    SecretRedactor([]).filter(rec)
    assert "hunter2" not in rec.getMessage()


def test_short_records_are_left_as_they_were(caplog: pytest.LogCaptureFixture) -> None:
    undo = install_log_redaction(SecretRedactor([SECRET]))
    try:
        logging.getLogger("some.library").warning("model %s answered %d", "tiny", 404)
    finally:
        undo()
    assert [r.getMessage() for r in caplog.records] == ["model tiny answered 404"]


@given(st.lists(st.sampled_from(["http", "s3+x", "://", "user:pw@", "@", "h.o-st", " ", "/", "x", "\u00e9", "HTTPS"]),
                max_size=12).map("".join))
@settings(max_examples=500, deadline=None)
def test_the_url_redaction_of_any_text_is_what_the_full_search_gives(text: str) -> None:
    # Texts without "://" skip the search: only a text with it can hold a URL's credentials.
    assert redact_urls_in(text) == _URL_USERINFO.sub(rf"\g<1>{REDACTED}@", text)
