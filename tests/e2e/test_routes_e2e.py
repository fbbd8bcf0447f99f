"""Against the real engine: every form of a path that once went around the guard is now guarded or 404, and
the engine finishes exactly the requests the gateway counted."""

from __future__ import annotations

import http.client
import itertools
import json
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import pytest

from testing.servers import API_KEY, SERVED_MODEL_NAME, ServerProcess, scrape_counter

pytestmark = pytest.mark.e2e

CHAT = {"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": SERVED_MODEL_NAME, "prompt": "hi", "max_tokens": 2}
RESPONSE = {"model": SERVED_MODEL_NAME, "input": "hi", "max_output_tokens": 2}

# form, body, expected: "guarded" (counted, booked, answered by the engine) or 404 (from the gateway)
CASES: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/./chat/completions", CHAT, "guarded"),
    ("/v1/x/../chat/completions", CHAT, "guarded"),
    ("/v1/chat/./completions", CHAT, "guarded"),
    ("/v1/./completions", COMPLETION, "guarded"),
    ("//v1//chat/completions/", CHAT, "guarded"),
    ("/v1/./responses", RESPONSE, "guarded"),
    ("/v1/%2e/chat/completions", CHAT, "404"),
    ("/v1/%2E/completions", COMPLETION, "404"),
    ("/v1/%2e%2e/metrics", {}, "404"),
    ("/v1/%2e%2e/openapi.json", {}, "404"),
    ("/v1/%2e%2e/invocations", CHAT, "404"),
    ("/v1/%2e%2e/scale_elastic_ep", {}, "404"),
    ("/v1/..%2f..%2finvocations", CHAT, "404"),
    ("/invocations", CHAT, "404"),
    ("/v1/messages", CHAT, "404"),
    ("/inference/v1/generate", {"token_ids": [1, 2, 3]}, "404"),
    ("/v1/chat/completions/batch", CHAT, "404"),
    ("/scale_elastic_ep", {}, "404"),
    ("/../v1/chat/completions", CHAT, "404"),
]

_IDS = itertools.count(1)


def send_raw(url: str, method: str, target: str, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    """One request with its target written as given (an HTTP client would normalise the path first)."""
    parts = urlsplit(url)
    data = json.dumps(body).encode() if method == "POST" else b""
    head = (f"{method} {target} HTTP/1.1\r\nhost: {parts.netloc}\r\nauthorization: Bearer {API_KEY}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(data)}\r\n"
            f"x-request-id: e2e-route-{next(_IDS)}\r\nconnection: close\r\n\r\n")
    with socket.create_connection((parts.hostname, parts.port), timeout=120) as sock:
        sock.sendall(head.encode() + data)
        response = http.client.HTTPResponse(sock, method=method)
        response.begin()
        raw = response.read()
        headers = {k.lower(): v for k, v in response.getheaders()}
        return response.status, headers, json.loads(raw) if raw else None


def finished(vllm: ServerProcess) -> float:
    return scrape_counter(f"{vllm.url}/metrics", "vllm:request_success_total")


def test_every_bypass_form_is_guarded_or_404_and_the_engine_runs_only_what_was_counted(
    reject_gateway: ServerProcess, vllm: ServerProcess
) -> None:
    before = finished(vllm)
    guarded = 0
    for form, body, expected in CASES:
        status, headers, answer = send_raw(reject_gateway.url, "POST", form, body)
        if expected == "guarded":
            assert status == 200 and "x-guard-prompt-tokens" in headers, (form, status, answer)
            assert int(headers["x-guard-prompt-tokens"]) > 0
            guarded += 1
        else:
            assert status == 404, (form, status, answer)
            assert answer["error"]["code"] == "not_found" and answer["error"]["type"] == "invalid_request_error"
            assert "x-guard-prompt-tokens" not in headers

    # The engine counts a request as finished a moment after answering it.
    deadline = time.monotonic() + 10
    while finished(vllm) - before < guarded and time.monotonic() < deadline:
        time.sleep(0.1)
    assert finished(vllm) - before == guarded

    status, _, status_body = send_raw(reject_gateway.url, "GET", "/guard/status", {})
    assert status == 200
    assert (status_body["committed_blocks"], status_body["in_flight"], status_body["queued"]) == (0, 0, 0)


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_the_engines_metrics_are_not_reachable_through_v1(reject_gateway: ServerProcess, method: str) -> None:
    status, _, answer = send_raw(reject_gateway.url, method, "/v1/%2e%2e/metrics", {})
    assert status == 404 and answer["error"]["code"] == "not_found"
    assert "vllm:" not in json.dumps(answer)
