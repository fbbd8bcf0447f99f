"""The access log through the real gateway in front of the simulator: one line per guarded request on every exit
(answered whole or streamed, refused by the gateway or by the engine's queue cap, failed upstream, its client
gone before the answer or in the middle of a stream), in both formats, parsed back; the keys never appear."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shlex
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.clip import digest
from gateway.config import Settings
from gateway.observe.access_log import FIELDS, LOGGER_NAME
from gateway.redact import SecretRedactor, install_log_redaction
from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import Fault, SimConfig, SimServer, run_sim_server

KEY = "sk-access-log-key-0123456789"
WRONG_KEY = "sk-not-a-key-but-secret-anyway"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module", params=["text", "json"])
def rig(
    request: pytest.FixtureRequest, tokenizer: Any, tokenizer_dir: Path
) -> Iterator[tuple[SimServer, GatewayServer]]:
    """A gateway started with ``--access-log`` in each format: with workers, each process formats its own lines."""
    config = SimConfig(model="tiny", root=str(tokenizer_dir), tokenizer=tokenizer, max_model_len=512,
                       token_delay=0.001)
    settings = Settings(tokenizer=str(tokenizer_dir), scrape_interval=0.05, queue_timeout=5.0, read_timeout=5.0,
                        api_key=[KEY], access_log=request.param)
    with run_sim_server(config) as sim, run_gateway(settings, upstream=sim.url) as gw:
        # As the command line does: every record has the configured secrets replaced.
        undo = install_log_redaction(SecretRedactor(settings.secrets()))
        try:
            yield sim, gw
        finally:
            undo()


def format_of(gw: GatewayServer) -> str:
    return gw.parts.settings.access_log


@dataclass
class Case:
    """One way a request ends, and the fields its line must have."""

    name: str
    body: dict[str, Any]
    expect: dict[str, object]
    headers: dict[str, str] = field(default_factory=lambda: dict(AUTH))
    route: str = "/v1/completions"
    fault: Fault | None = None
    cap: int | None = None  # the engine's --max-num-queued-reqs for this case
    leave_after_events: int | None = None  # the client goes away after reading this many events
    leave_before_answer: bool = False


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "hello there", "max_tokens": 8, "ignore_eos": True, **extra}


CASES = [
    Case("answered whole", completion(max_tokens=600), {
        "status": 200, "outcome": "ok", "reason": None, "route": "completions", "model": "tiny",
        "max_tokens_asked": 600, "engine": "0", "ttft_ms": None, "trace_id": TRACE,
    }, headers={**AUTH, "traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"}),
    Case("streamed", completion(stream=True), {
        "status": 200, "outcome": "ok", "reason": None, "max_tokens_asked": 8, "max_tokens": 8,
        "completion_tokens": 8, "trace_id": None,
    }),
    Case("chat streamed", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                           "max_completion_tokens": 4, "ignore_eos": True},
         {"status": 200, "outcome": "ok", "route": "chat", "max_tokens_asked": 4}, route="/v1/chat/completions"),
    Case("prompt over the context", completion(prompt="word " * 600, max_tokens=4), {
        "status": 400, "outcome": "refused", "reason": "context_length", "engine": None, "completion_tokens": None,
    }),
    Case("max_tokens beyond 64 bits, clamped to the context", completion(max_tokens=10**30), {
        "status": 200, "outcome": "ok", "max_tokens_asked": 10**30, "truncated_tokens": 0,
    }),
    Case("a malformed traceparent", completion(), {"status": 200, "trace_id": None},
         headers={**AUTH, "traceparent": f"00-{TRACE}-00f067aa0ba902b7-01garbage"}),
    Case("wrong key", completion(), {
        "status": 401, "outcome": "refused", "reason": "auth", "tenant": None, "model": None, "prompt_tokens": None,
    }, headers={"authorization": f"Bearer {WRONG_KEY}"}),
    Case("the key as the model", completion(model=KEY), {
        "status": 404, "outcome": "refused", "reason": "model_not_found", "model": "***",
    }),
    Case("the engine's queue cap", completion(), {
        "status": 503, "outcome": "refused", "reason": "engine_queue_full", "engine": "0",
    }, cap=0),
    Case("upstream failure", completion(), {"status": 500, "outcome": "error", "reason": "upstream_error"},
         fault=Fault.ERROR_500),
    Case("client gone mid-stream", completion(stream=True, max_tokens=400), {
        "status": 200, "outcome": "cancelled",
    }, leave_after_events=2),
    Case("client gone before the answer", completion(), {"status": 499, "outcome": "cancelled"},
         fault=Fault.HANG, leave_before_answer=True),
]


def parse(line: str, fmt: str) -> dict[str, object]:
    if fmt == "json":  # the standard library's parser keeps an integer beyond 64 bits whole (orjson's does not)
        data: dict[str, object] = json.loads(line)
        return data
    pairs = [token.split("=", 1) for token in shlex.split(line)]
    return {key: None if value == "" else NUMBERS.get(key, str)(value) for key, value in pairs}


NUMBERS: dict[str, Callable[[str], object]] = {
    **dict.fromkeys(("status", "prompt_tokens", "max_tokens_asked", "max_tokens", "truncated_tokens",
                     "completion_tokens"), int),
    **dict.fromkeys(("queue_ms", "ttft_ms", "duration_ms"), float),
}


async def send(gw: GatewayServer, case: Case) -> None:
    async with httpx.AsyncClient(base_url=gw.url, timeout=10.0) as client:
        if case.leave_after_events is not None:
            async with client.stream("POST", case.route, json=case.body, headers=case.headers) as response:
                lines = response.aiter_lines()
                seen = 0
                while seen < case.leave_after_events:
                    seen += (await anext(lines)).startswith("data:")
            return
        request = client.post(case.route, json=case.body, headers=case.headers)
        if case.leave_before_answer:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(request, 0.5)
            return
        await request


def lines_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME]


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 5.0
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_request_ends_in_one_line_that_parses_back(
    rig: tuple[SimServer, GatewayServer], caplog: pytest.LogCaptureFixture, case: Case,
) -> None:
    sim, gw = rig
    fmt = format_of(gw)
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    sim.sim.config.fault, sim.sim.config.max_num_queued_reqs = case.fault, case.cap
    try:
        asyncio.run(send(gw, case))
        wait_for(lambda: len(lines_of(caplog)) >= 1, "the request's line is written")
        gw.wait_ledger_empty()
    finally:
        sim.sim.config.fault, sim.sim.config.max_num_queued_reqs = None, None
    [line] = lines_of(caplog)
    fields = parse(line, fmt)
    assert tuple(fields) == FIELDS
    assert {key: fields[key] for key in case.expect} == case.expect, line
    assert fields["tenant"] == (None if case.name == "wrong key" else "default")
    assert isinstance(fields["duration_ms"], float) and isinstance(fields["request_id"], str)
    if fields["outcome"] == "ok":  # every request asks ignore_eos: it generates what it was sent
        generated, sent = fields["completion_tokens"], fields["max_tokens"]
        assert isinstance(generated, int) and isinstance(sent, int) and fields["queue_ms"] is not None
        # A stream's count is its events with content; a chat stream's first event may carry only the role.
        assert sent <= generated <= sent + (case.route.endswith("chat/completions") and "stream" in case.body)
    assert KEY not in line and WRONG_KEY not in line


def test_the_key_sent_as_the_request_id_is_redacted(
    rig: tuple[SimServer, GatewayServer], caplog: pytest.LogCaptureFixture,
) -> None:
    _, gw = rig
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    httpx.post(gw.url + "/v1/completions", json=completion(), headers={**AUTH, "x-request-id": KEY})
    wait_for(lambda: len(lines_of(caplog)) >= 1, "the request's line is written")
    [line] = lines_of(caplog)
    assert KEY not in line and parse(line, format_of(gw))["request_id"] == "***"


def test_off_writes_nothing(tokenizer: Any, tokenizer_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    config = SimConfig(model="tiny", root=str(tokenizer_dir), tokenizer=tokenizer, max_model_len=512)
    settings = Settings(tokenizer=str(tokenizer_dir), access_log="off", api_key=[KEY])
    with run_sim_server(config) as sim, run_gateway(settings, upstream=sim.url) as gw:
        for _ in range(4):  # on every process, with workers
            assert httpx.post(gw.url + "/v1/completions", json=completion(), headers=AUTH).status_code == 200
        gw.wait_ledger_empty()
    assert lines_of(caplog) == []  # every process has stopped: a line would have come by now


def test_a_model_name_of_megabytes_is_logged_cut_and_holds_no_request_back(
    rig: tuple[SimServer, GatewayServer], caplog: pytest.LogCaptureFixture,
) -> None:
    """A chat whose model is ~8 MiB of text (under --max-body-bytes) is answered 404; its line was 8 MB long and
    held the event loop 2.55 s (text: escaped a character at a time), /health and every stream with it. Now the
    line is a few hundred characters and /health answers meanwhile as it does any time."""
    _, gw = rig
    fmt = format_of(gw)
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    # Quotes and '=' to escape, a letter beyond ASCII: 6 bytes of JSON each 4 characters, ~7.9 MiB in all.
    model = "m\u00e9\"=" * (1300 * 1024)
    chat = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert len(chat) < Settings().max_body_bytes
    slowest, stop = [0.0], threading.Event()

    def watch_health() -> None:
        with httpx.Client(base_url=gw.url, timeout=30) as client:
            while not stop.is_set():
                t0 = time.monotonic()
                client.get("/health")
                slowest[0] = max(slowest[0], time.monotonic() - t0)
                time.sleep(0.01)

    watcher = threading.Thread(target=watch_health, daemon=True)
    watcher.start()
    try:
        time.sleep(0.2)  # the watcher's connection is open and warm
        answer = httpx.post(gw.url + "/v1/chat/completions", content=chat,
                            headers={**AUTH, "content-type": "application/json"}, timeout=60)
        wait_for(lambda: len(lines_of(caplog)) >= 1, "the request's line is written")
        time.sleep(0.2)
    finally:
        stop.set()
        watcher.join(10)
    assert answer.status_code == 404, answer.text[:200]
    [line] = lines_of(caplog)
    assert len(line) < 2048, len(line)
    logged = parse(line, fmt)["model"]
    assert isinstance(logged, str)
    assert logged.endswith(f"...[cut: {len(model)} chars, {digest(model)}]") and model.startswith(logged[:100])
    assert slowest[0] < 1.0, f"/health took {slowest[0]:.2f} s while the request was logged"
