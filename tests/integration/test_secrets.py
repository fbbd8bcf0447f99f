"""Secrets are never shown: the upstream URL's credentials, upstream, client and admin keys stay out of every
response, status page, error message, metric and log line, whether the upstream works or misbehaves."""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import shlex
import socketserver
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from pydantic import ValidationError

from gateway.config import Settings
from gateway.engine.client import Upstream
from gateway.engine.live import FAILED_SCRAPES_DOWN
from gateway.redact import SecretRedactor, install_log_redaction, redact_url, redact_urls_in
from testing.gateway_thread import GatewayServer, free_port, run_gateway
from testing.servers import metric_sum
from testing.vllm_sim import SimConfig, run_sim_server

USER, PASSWORD = "guard-user-7f3a", "pw/5ecret@91c2"
PASSWORD_IN_URL = "pw%2F5ecret%4091c2"
CLIENT_KEY, ADMIN_KEY, UPSTREAM_KEY = "client-key-3b8e", "admin-key-c41d", "upstream-key-9e07"
SECRETS = (USER, PASSWORD, PASSWORD_IN_URL, "5ecret", CLIENT_KEY, ADMIN_KEY, UPSTREAM_KEY)
AS_CLIENT = {"authorization": f"Bearer {CLIENT_KEY}"}


def with_credentials(url: str) -> str:
    return url.replace("http://", f"http://{USER}:{PASSWORD_IN_URL}@")


def leaks(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


def logged(caplog: pytest.LogCaptureFixture) -> str:
    formatter = logging.Formatter("%(name)s %(message)s")
    return "\n".join(formatter.format(r) for r in caplog.records)


# -- the helpers ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://user:password@host:8000", "http://***@host:8000"),
        ("https://user:password@host:8000/v1?x=1#f", "https://***@host:8000/v1?x=1#f"),
        ("http://user@host", "http://***@host"),
        ("http://:password@host", "http://***@host"),
        ("http://us%40er:p%40ss@host:1/", "http://***@host:1/"),
        ("http://user:p@ss@host:8000", "http://***@host:8000"),
        ("http://host:8000", "http://host:8000"),
        ("http://127.0.0.1:8000/path@x", "http://127.0.0.1:8000/path@x"),
        ("http://[::1]:8000", "http://[::1]:8000"),
        ("http://u:p@[::1", "http://***@[::1"),
    ],
    ids=lambda v: v,
)
def test_redact_url_hides_user_and_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("cannot reach http://u:p@h:1/x (refused)", "cannot reach http://***@h:1/x (refused)"),
        ("a http://a:b@h and https://c:d@k", "a http://***@h and https://***@k"),
        ("url='http://u:p@h/v1/models'", "url='http://***@h/v1/models'"),
        ("mail me at x@y.z from http://h/", "mail me at x@y.z from http://h/"),
        ("http://h/?q=a@b", "http://h/?q=a@b"),
    ],
    ids=lambda v: v,
)
def test_redact_urls_in_text(text: str, shown: str) -> None:
    assert redact_urls_in(text) == shown


def test_every_configured_secret_is_known_to_the_redactor() -> None:
    settings = Settings(
        upstream=with_credentials("http://h:1"), api_key=[CLIENT_KEY + "=5"], admin_api_key=[ADMIN_KEY]
    )
    redactor = SecretRedactor(settings.secrets())
    text = f"{CLIENT_KEY} {ADMIN_KEY} {PASSWORD} {PASSWORD_IN_URL} http://{USER}:x@h"
    assert redactor.redact(text) == "*** *** *** *** http://***@h"
    keyed = SecretRedactor(Settings(upstream_api_key=UPSTREAM_KEY).secrets())
    assert keyed.redact(f"--api-key {UPSTREAM_KEY}") == "--api-key ***"


def test_secrets_too_short_to_hide_do_not_garble_logs() -> None:
    assert SecretRedactor(["abc", "abcd"]).redact("abc abcd") == "abc ***"


def record(msg: Any, *args: Any, exc: BaseException | None = None, stack: str | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord("t", logging.ERROR, __file__, 1, msg, args or None, exc_info, sinfo=stack)


def _raised(message: str) -> BaseException:
    try:
        raise RuntimeError(message)
    except RuntimeError as exc:
        return exc


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: record("key %s", CLIENT_KEY), id="in the arguments"),
        pytest.param(lambda: record(f"key {ADMIN_KEY} at %d%%", 5), id="in the message"),
        pytest.param(lambda: record("to %(url)s", {"url": with_credentials("http://h")}), id="in mapping arguments"),
        pytest.param(lambda: record(_raised(UPSTREAM_KEY)), id="as the message object"),
        pytest.param(lambda: record("failed", exc=_raised(f"http://{USER}:x@h {PASSWORD}")), id="in a traceback"),
        pytest.param(lambda: record("here", stack=f"Stack: {CLIENT_KEY}"), id="in the stack"),
        pytest.param(lambda: record("bad %d format", CLIENT_KEY), id="in arguments that do not fit"),
    ],
)
def test_the_log_filter_redacts_every_part_of_a_record(make: Any) -> None:
    redactor = SecretRedactor([CLIENT_KEY, ADMIN_KEY, UPSTREAM_KEY, PASSWORD])
    rec = make()
    assert redactor.filter(rec) is True
    text = logging.Formatter().format(rec)
    assert not leaks(text), text
    assert "***" in text


def test_log_redaction_covers_every_logger_until_undone(caplog: pytest.LogCaptureFixture) -> None:
    undo = install_log_redaction(SecretRedactor([CLIENT_KEY]))
    try:
        logging.getLogger("some.library").warning("sent %s", CLIENT_KEY)
    finally:
        undo()
    logging.getLogger("some.library").warning("after: %s", CLIENT_KEY)
    assert [r.getMessage() for r in caplog.records] == ["sent ***", f"after: {CLIENT_KEY}"]


class _ServerThatLogs:
    started = True

    def run(self, sockets: object = None) -> None:
        logging.getLogger("uvicorn.error").info("run %s", ADMIN_KEY)


def test_serve_installs_the_log_redaction(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from gateway.cli import serve
    from gateway.http import serving

    monkeypatch.setattr(serving, "build_server", lambda app, settings: _ServerThatLogs())
    monkeypatch.setattr(serving, "sockets_for", lambda settings, plan: [])  # no port bound
    previous = logging.getLogRecordFactory()
    caplog.set_level(logging.INFO)
    # An earlier uvicorn server in this process may have set its logger to WARNING.
    caplog.set_level(logging.INFO, logger="uvicorn.error")
    try:
        assert serve(Settings(api_key=[CLIENT_KEY], admin_api_key=[ADMIN_KEY])) == 0
        logging.getLogger("gateway.x").warning("key %s", CLIENT_KEY)
    finally:
        logging.setLogRecordFactory(previous)
    assert not leaks(logged(caplog)), logged(caplog)
    assert "run ***" in logged(caplog) and "key ***" in logged(caplog)


# -- settings -------------------------------------------------------------------------------------
def test_url_credentials_and_an_upstream_key_cannot_be_combined() -> None:
    with pytest.raises(ValidationError) as info:
        Settings(upstream=with_credentials("http://h:1"), upstream_api_key=UPSTREAM_KEY)
    assert "give only one" in str(info.value)
    assert not leaks(str(info.value))


def test_a_refused_upstream_url_is_shown_redacted() -> None:
    with pytest.raises(ValidationError) as info:
        Settings(upstream=f"ftp://{USER}:{PASSWORD_IN_URL}@h:1", api_key=[CLIENT_KEY])
    assert "ftp://***@h:1" in str(info.value)
    assert not leaks(str(info.value))


# -- the credentials are still used -----------------------------------------------------------------
async def test_url_credentials_reach_the_upstream_as_basic_auth() -> None:
    seen: list[str | None] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/v1/models", handler)
    async with TestServer(app, host="127.0.0.1") as server:
        upstream = Upstream(Settings(upstream=with_credentials(f"http://127.0.0.1:{server.port}")))
        await upstream.start()
        try:
            reply = await upstream.request("GET", "/v1/models")
        finally:
            await upstream.close()
    assert reply.status == 200
    assert seen == ["Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()]


# -- a working upstream -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sim_config(tokenizer: Any, tokenizer_dir: Any) -> SimConfig:
    return SimConfig(model="tiny", root=str(tokenizer_dir), max_model_len=256, tokenizer=tokenizer)


def shown_by(gw: GatewayServer) -> dict[str, httpx.Response]:
    """Every answer a client can get: successes, each kind of refusal, the status pages and metrics."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(base_url=gw.url, timeout=20) as http:
        return {
            "chat": http.post("/v1/chat/completions", json=chat, headers=AS_CLIENT),
            "stream": http.post("/v1/chat/completions", json={**chat, "stream": True}, headers=AS_CLIENT),
            "completion": http.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=AS_CLIENT),
            "unknown model": http.post("/v1/completions", json={"model": "nope", "prompt": "x"}, headers=AS_CLIENT),
            "too long": http.post("/v1/completions", json={"model": "tiny", "prompt": "w " * 999}, headers=AS_CLIENT),
            "models": http.get("/v1/models", headers=AS_CLIENT),
            "tokenize": http.post("/tokenize", json={"model": "tiny", "prompt": "x"}, headers=AS_CLIENT),
            "wrong key": http.post("/v1/completions", json={}, headers={"authorization": "Bearer wrong"}),
            "wrong admin key": http.post("/guard/restart", headers=AS_CLIENT),
            "restart": http.post("/guard/restart", headers={"authorization": f"Bearer {ADMIN_KEY}"}),
            "health": http.get("/health"),
            "status": http.get("/guard/status", headers=AS_CLIENT),
            "metrics": http.get("/metrics"),
        }


SCRAPE_ERRORS = "vllm_guard_engine_scrape_errors_total"


def until_known_down(gw: GatewayServer, within: float = 10.0) -> None:
    """Until /health says down and the request path would refuse too: ``FAILED_SCRAPES_DOWN`` scrapes have failed.
    /health says down from the start (no model listing read yet), before a request is refused: on a busy host the
    first requests came after one failed scrape, reached the upstream and got its own fault (a 502)."""
    deadline = time.monotonic() + within
    with httpx.Client(base_url=gw.url, timeout=5) as http:
        while (http.get("/health").status_code != 503
               or metric_sum(http.get("/metrics").text, SCRAPE_ERRORS) < FAILED_SCRAPES_DOWN):
            assert time.monotonic() < deadline, f"the engine not yet known down after {within:g} s"
            time.sleep(0.05)


def assert_nothing_leaks(answers: dict[str, httpx.Response], caplog: pytest.LogCaptureFixture) -> None:
    for name, r in answers.items():
        assert not leaks(r.text + json.dumps(dict(r.headers))), f"{name}: {r.text}"
    assert not leaks(logged(caplog)), logged(caplog)


@pytest.mark.parametrize("credentials", ["url", "upstream key"])
def test_a_working_upstream_with_credentials_shows_none(
    credentials: str, sim_config: SimConfig, base_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    config = sim_config if credentials == "url" else dataclasses.replace(sim_config, api_key=UPSTREAM_KEY)
    with run_sim_server(config) as sim:
        upstream = with_credentials(sim.url) if credentials == "url" else sim.url
        extra = {"upstream_api_key": UPSTREAM_KEY} if credentials == "upstream key" else {}
        settings = base_settings.model_copy(
            update={"upstream": upstream, "api_key": [CLIENT_KEY], "admin_api_key": [ADMIN_KEY], **extra}
        )
        with run_gateway(settings) as gw:
            answers = shown_by(gw)
    assert answers["chat"].status_code == 200, answers["chat"].text
    assert answers["stream"].status_code == 200 and "[DONE]" in answers["stream"].text
    assert [answers[k].status_code for k in ("unknown model", "too long", "wrong key", "wrong admin key")] == [
        404, 400, 401, 401
    ]
    assert answers["health"].status_code == 200
    shown_url = answers["health"].json()["upstream"]["url"]
    assert shown_url == (sim.url.replace("http://", "http://***@") if credentials == "url" else sim.url)
    assert answers["status"].json()["upstream"]["url"] == shown_url
    assert_nothing_leaks(answers, caplog)


# -- a misbehaving upstream ---------------------------------------------------------------------------
class _Misbehave(socketserver.BaseRequestHandler):
    REPLIES = {
        "closes": b"",
        "garbage": b"NOT HTTP AT ALL\r\n\r\n",
        "cuts": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"obj",
        "rejects": b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\nContent-Length: 25\r\n\r\n"
                   b'{"error": "Unauthorized"}',
    }

    def handle(self) -> None:
        self.request.settimeout(5)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = self.request.recv(65536)
            if not chunk:
                return
            data += chunk
        self.request.sendall(self.REPLIES[self.server.mode])  # type: ignore[attr-defined]


@contextmanager
def misbehaving_upstream(mode: str) -> Iterator[str]:
    if mode == "refuses":
        yield f"http://127.0.0.1:{free_port()}"
        return
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Misbehave)
    server.daemon_threads = True
    server.mode = mode  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, name=f"upstream-{mode}", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("mode", "status", "code"),
    [
        ("refuses", 503, "upstream_unavailable"),
        ("closes", 503, "upstream_unavailable"),
        # Its scrapes fail too: /health says down, and the request is refused with why, not sent.
        ("garbage", 503, "upstream_unavailable"),
        ("cuts", 503, "upstream_unavailable"),
        ("rejects", 503, "upstream_unavailable"),
    ],
)
def test_no_error_from_a_misbehaving_upstream_shows_a_secret(
    mode: str, status: int, code: str, base_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with misbehaving_upstream(mode) as url:
        settings = base_settings.model_copy(
            update={"upstream": with_credentials(url), "api_key": [CLIENT_KEY], "admin_api_key": [ADMIN_KEY]}
        )
        with run_gateway(settings) as gw:
            # Once its scrapes have failed the engine is known down: a request sent before that reaches the
            # upstream, and gets the upstream's own fault (a garbage answer is a 502) instead.
            until_known_down(gw)
            answers = shown_by(gw)
    failed = answers["completion"]
    assert (failed.status_code, failed.json()["error"]["code"]) == (status, code), failed.text
    if mode == "refuses":
        assert f"{url.replace('http://', 'http://***@')} cannot be reached" in failed.json()["error"]["message"]
    assert answers["health"].status_code == 503
    assert answers["health"].json()["upstream"]["url"] == url.replace("http://", "http://***@")
    assert_nothing_leaks(answers, caplog)


# -- the managed engine ---------------------------------------------------------------------------------
class _NoGpu:
    def memory_mib(self, pids: object) -> float | None:
        return None

    def holders(self) -> list[str]:
        return []


async def test_the_engine_printing_its_api_key_is_redacted(caplog: pytest.LogCaptureFixture) -> None:
    from gateway.managed.supervisor import Supervisor, SupervisorError
    from gateway.metrics import Metrics

    # Like vLLM, which prints its non-default arguments (--api-key among them) as it starts; then it fails.
    script = "import sys; print('INFO non-default args:', sys.argv[1:], flush=True); sys.exit(1)"
    settings = Settings(
        managed=True, model="m", vllm_command=shlex.join([sys.executable, "-c", script]),
        upstream_api_key=UPSTREAM_KEY, startup_timeout=20.0, autofit_attempts=0,
    )
    caplog.set_level(logging.DEBUG)
    sup = Supervisor(settings, Metrics(), gpu=_NoGpu(), stop_grace=2.0)
    try:
        with pytest.raises(SupervisorError) as info:
            await sup.start()
        status = json.dumps(sup.status())
    finally:
        await sup.stop()
    assert "non-default args" in logged(caplog)
    assert not leaks(logged(caplog) + status + info.value.message), logged(caplog)


# -- the doctor -----------------------------------------------------------------------------------------
def _doctor_transport(kind: str) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        if kind == "unreachable":
            raise httpx.ConnectError(f"cannot connect to {request.url}")
        if kind == "rejects":
            return httpx.Response(401 if request.url.path == "/v1/models" else 500)
        return httpx.Response(200, json={"version": "0.32.0", "data": [{"id": "tiny", "max_model_len": 8}]})

    return httpx.MockTransport(handler)


@pytest.mark.parametrize("kind", ["unreachable", "rejects", "answers"])
async def test_the_doctor_report_shows_no_credentials(kind: str) -> None:
    from gateway.gpu import GpuReport
    from gateway.tools.doctor import diagnose, render_report

    report = await diagnose(
        with_credentials("http://vllm.test:8000"), gpu_report=GpuReport(available=False, reason="none"),
        transport=_doctor_transport(kind),
    )
    text = render_report(report) + json.dumps(report.to_dict())
    assert "http://***@vllm.test:8000" in text
    assert not leaks(text), text
