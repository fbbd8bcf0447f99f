"""What every hostile case asserts, and the raw HTTP/1.1 client the protocol-level cases speak through."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from gateway.config import Settings
from testing.gateway_thread import GatewayServer

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


# -- cases -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One hostile request and what the gateway must answer. ``status`` may allow several answers where the
    issue leaves the choice open (refuse or normalise); ``code`` and ``param``, when set, are checked too."""

    id: str
    body: bytes | None = None
    path: str = "/v1/chat/completions"
    method: str = "POST"
    headers: tuple[tuple[str, str], ...] = ()
    status: frozenset[int] = frozenset({400})
    code: str | None = None
    param: str | None = None

    def param_set(self) -> Any:
        return pytest.param(self, id=self.id)


def statuses(*codes: int) -> frozenset[int]:
    return frozenset(codes)


def table(cases: Iterable[Case]) -> list[Any]:
    cases = list(cases)
    ids = [c.id for c in cases]
    duplicates = {i for i in ids if ids.count(i) > 1}
    assert not duplicates, f"duplicate case ids: {duplicates}"
    return [c.param_set() for c in cases]


def dumps(data: Any) -> bytes:
    return json.dumps(data).encode()


def need_settings(*names: str) -> None:
    """Skip (not fail) while a limit the issue asks for has no setting yet."""
    missing = [n for n in names if n not in Settings.model_fields]
    if missing:
        pytest.skip(f"gateway.config.Settings has no {', '.join(missing)} yet")


# -- answers ---------------------------------------------------------------------------------------
def error_of(body: bytes) -> dict[str, Any]:
    """The ``error`` object of an OpenAI-shaped error body; fails the test when the shape is wrong."""
    try:
        data = json.loads(body)
    except ValueError:
        pytest.fail(f"the error body is not JSON: {body[:200]!r}")
    assert isinstance(data, dict) and isinstance(data.get("error"), dict), f"not OpenAI's error shape: {data!r}"
    err: dict[str, Any] = data["error"]
    assert set(err) >= {"message", "type", "param", "code"}, f"error fields missing: {err!r}"
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err
    assert "Traceback" not in err["message"], err
    return err


def check_answer(status: int, body: bytes, case: Case) -> dict[str, Any] | None:
    assert status in case.status, f"{case.id}: status {status}, expected {sorted(case.status)}: {body[:300]!r}"
    if status < 400:
        return None
    err = error_of(body)
    assert err["code"] != "internal_error", f"{case.id}: the gateway failed on it: {err}"
    if case.code is not None:
        assert err["code"] == case.code, f"{case.id}: code {err['code']!r}, expected {case.code!r}: {err}"
    if case.param is not None:
        assert err["param"] == case.param, f"{case.id}: param {err['param']!r}, expected {case.param!r}: {err}"
    return err


# -- the gateway under test ------------------------------------------------------------------------
@dataclass
class Target:
    """A running gateway, an HTTP client for it, and a request it must always answer with 200."""

    gw: GatewayServer
    key: str | None
    normal_body: bytes
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        # Short keep-alive on our side: a gateway that closes idle connections must never meet a reused one.
        self.client = httpx.Client(
            base_url=self.gw.url, timeout=10.0, limits=httpx.Limits(keepalive_expiry=0.2)
        )

    @property
    def url(self) -> str:
        return self.gw.url

    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"} if self.key else {}

    def send(self, case: Case, *, auth: bool = True) -> httpx.Response:
        headers = {"content-type": "application/json", **(self.auth() if auth else {})}
        headers.update(dict(case.headers))
        return self.client.request(case.method, case.path, content=case.body, headers=headers)

    def still_well(self) -> None:
        """The gateway answers an ordinary request and its ledger is back at zero."""
        r = self.client.post(
            "/v1/chat/completions", content=self.normal_body,
            headers={"content-type": "application/json", **self.auth()},
        )
        assert r.status_code == 200, f"an ordinary request failed afterwards: {r.status_code} {r.text[:300]}"
        self.ledger_at_zero()

    def ledger_at_zero(self, within: float = 3.0) -> None:
        deadline = time.monotonic() + within
        while True:
            s = self.gw.status()
            held = {k: s[k] for k in ("committed_blocks", "in_flight", "queued")}
            if not any(held.values()):
                return
            if time.monotonic() > deadline:
                pytest.fail(f"the ledger did not return to zero: {held}")
            time.sleep(0.02)

    def close(self) -> None:
        self.client.close()


# -- raw HTTP/1.1 ----------------------------------------------------------------------------------
@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes
    # The body's HTTP chunks as the server wrote them (chunked responses only).
    chunks: list[bytes] = field(default_factory=list)


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def request_bytes(method: str, target: str, headers: dict[str, str] | list[tuple[str, str]],
                  body: bytes = b"", *, version: str = "HTTP/1.1") -> bytes:
    items = list(headers.items()) if isinstance(headers, dict) else list(headers)
    names = {k.lower() for k, _ in items}
    if "host" not in names:
        items.insert(0, ("host", "127.0.0.1"))
    if body and "content-length" not in names and "transfer-encoding" not in names:
        items.append(("content-length", str(len(body))))
    head = f"{method} {target} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in items) + "\r\n"
    return head.encode("latin-1") + body


async def read_response(reader: asyncio.StreamReader) -> RawResponse | None:
    """One response (past any 1xx), or None when the server closed the connection without one."""
    status = 100
    while 100 <= status < 200:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    chunks: list[bytes] = []
    if headers.get("transfer-encoding", "").lower() == "chunked":
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, ValueError):
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    break
                chunks.append(await reader.readexactly(size))
                await reader.readexactly(2)
        body = b"".join(chunks)
    elif "content-length" in headers:
        try:
            body = await reader.readexactly(int(headers["content-length"]))
        except (asyncio.IncompleteReadError, ConnectionError):
            body = b""
    else:
        try:
            body = await reader.read()
        except ConnectionError:
            body = b""
    return RawResponse(status, headers, body, chunks)


async def raw_exchange(url: str, data: bytes, *, timeout: float = 10.0) -> RawResponse | None:
    """Send bytes as they are on a fresh connection and read one response (None: closed without one)."""
    host, port = host_port(url)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        with contextlib.suppress(ConnectionError):
            writer.write(data)
            await writer.drain()
        return await asyncio.wait_for(read_response(reader), timeout)
    finally:
        await close_writer(writer)


async def close_writer(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError, OSError):
        await writer.wait_closed()


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed the connection within ``seconds``, and what it sent before closing."""
    got = b""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False, got
        try:
            data = await asyncio.wait_for(reader.read(65536), left)
        except TimeoutError:
            return False, got
        except ConnectionError:
            return True, got
        if not data:
            return True, got
        got += data


def parse_raw(data: bytes) -> tuple[int, bytes] | None:
    """Status and body of the first response in ``data`` (sent before a close), or None when empty."""
    if not data:
        return None
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


# -- server-sent events ----------------------------------------------------------------------------
def sse_events(body: bytes) -> list[bytes]:
    """The events of an SSE body, each whole (framed on the blank line, LF or CRLF)."""
    text = body.replace(b"\r\n", b"\n")
    return [e for e in text.split(b"\n\n") if e.strip()]


def event_data(event: bytes) -> Any:
    """The parsed ``data:`` payload of one event: a JSON value, or the string ``[DONE]``."""
    lines = [ln for ln in event.split(b"\n") if not ln.startswith(b":")]
    assert lines and all(ln.startswith(b"data:") for ln in lines), f"not an SSE data event: {event!r}"
    payload = b"\n".join(ln[5:].lstrip(b" ") for ln in lines)
    if payload == b"[DONE]":
        return "[DONE]"
    try:
        return json.loads(payload)
    except ValueError:
        pytest.fail(f"an SSE event holds no parseable JSON (split or glued?): {event!r}")
