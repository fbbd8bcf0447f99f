"""Secrets never shown: credentials in the upstream URL and the upstream key stay out of every answer, status
page, metric, error message and log line, whether the upstream is well, failing or down."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from testing.gateway_thread import free_port, run_gateway
from testing.hostile_checks import Target
from testing.rogue_engine import Rogue

from .conftest import ROGUE_OK_CHAT, UPSTREAM_KEY, hostile_settings

USER, PASSWORD = "guard-user", "hunter2-url-secret"
BASIC = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()


class Collect(logging.Handler):
    """Every log record of the process, formatted as a handler would write it (tracebacks included)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@dataclass
class Setup:
    target: Target
    secrets: list[str]
    up: bool
    logs: Collect = field(default_factory=Collect)


@pytest.fixture(scope="module", params=["credentials in the url", "credentials in the url, upstream down",
                                        "upstream key"])
def setup(request: pytest.FixtureRequest, rogue: Rogue, tokenizer_dir: Path) -> Iterator[Setup]:
    from gateway.redact import SecretRedactor, install_log_redaction

    host_port = rogue.url.removeprefix("http://")
    if request.param == "upstream key":
        overrides: dict[str, object] = {"upstream": rogue.url, "upstream_api_key": UPSTREAM_KEY}
        secrets = [UPSTREAM_KEY]
    else:
        if request.param.endswith("down"):
            host_port = f"127.0.0.1:{free_port()}"
        overrides = {"upstream": f"http://{USER}:{PASSWORD}@{host_port}"}
        secrets = [PASSWORD, BASIC]
    settings = hostile_settings(tokenizer_dir, read_timeout=1.0, **overrides)
    logs = Collect()
    root = logging.getLogger()
    levels = {name: logging.getLogger(name).level for name in ("gateway", "aiohttp", "uvicorn", "asyncio")}
    for name in levels:
        logging.getLogger(name).setLevel(logging.DEBUG)
    root.addHandler(logs)
    # As `vllm-guard serve` does before it starts the server.
    undo = install_log_redaction(SecretRedactor(settings.secrets()))
    try:
        with run_gateway(settings) as server:
            target = Target(server, None, json.dumps(ROGUE_OK_CHAT).encode())
            yield Setup(target, secrets, up=not request.param.endswith("down"), logs=logs)
            target.close()
    finally:
        undo()
        root.removeHandler(logs)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def chat(mode: str, stream: bool = False) -> dict[str, object]:
    return {"model": "tiny", "messages": [{"role": "user", "content": f"rogue:{mode}"}], "max_tokens": 2,
            "stream": stream}


PROBES = [
    pytest.param("GET", "/health", None, id="health"),
    pytest.param("GET", "/guard/status", None, id="guard status"),
    pytest.param("GET", "/metrics", None, id="metrics"),
    pytest.param("GET", "/v1/models", None, id="models"),
    pytest.param("POST", "/v1/chat/completions", chat("ok"), id="an ordinary chat"),
    pytest.param("POST", "/v1/chat/completions", chat("reset"), id="a chat the upstream resets"),
    pytest.param("POST", "/v1/chat/completions", chat("garbage"), id="a chat the upstream answers with garbage"),
    pytest.param("POST", "/v1/chat/completions", chat("hang"), id="a chat the upstream never answers"),
    pytest.param("POST", "/v1/chat/completions", chat("error_500_text"), id="a chat the upstream fails"),
    pytest.param("POST", "/v1/chat/completions", chat("broken_stream", True), id="a stream the upstream breaks"),
    pytest.param("POST", "/detokenize", {"model": "tiny", "tokens": [1], "x": "rogue:reset"},
                 id="a detokenize the upstream resets"),
    pytest.param("POST", "/v1/%2e%2e/metrics", None, id="a traversal"),
]


@pytest.mark.parametrize(("method", "path", "body"), PROBES)
def test_no_secret_is_shown_anywhere(setup: Setup, method: str, path: str, body: object) -> None:
    t = setup.target
    r = t.client.request(method, path, json=body)
    shown = r.text + "\n" + "\n".join(f"{k}: {v}" for k, v in r.headers.items())
    for secret in setup.secrets:
        assert secret not in shown, f"a secret is shown in the answer to {method} {path}"
        logged = [line for line in setup.logs.lines if secret in line]
        assert not logged, f"a secret is in the log: {logged[0][:300]}"
    if r.status_code >= 400 and path != "/health":  # /health answers 503 with its own document when down
        assert isinstance(r.json()["error"]["message"], str)
    if setup.up:
        t.still_well()
    else:
        t.ledger_at_zero()
