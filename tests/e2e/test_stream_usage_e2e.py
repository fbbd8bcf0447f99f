"""On the real vLLM: a stream with ``stream_interval: 1000`` carries its whole output in one or two events; the
gateway asks vLLM for usage on every chunk, counts the engine's figure, and relays the bytes vLLM would have
sent the client for the options it asked (no usage chunk, no per-chunk usage, the fingerprint on the last
chunk)."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

from .servers import API_KEY, ServerProcess, metric_sum

pytestmark = pytest.mark.e2e

GENERATED = 64


def _body(route: str, options: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": GENERATED, "stream": True, "stream_interval": 1000,
                            "temperature": 0.0, "ignore_eos": True}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "Count the tokens of this answer."}]
    else:
        body["prompt"] = "Count the tokens of this answer."
    if options is not None:
        body["stream_options"] = options
    return body


def _normalised(body: bytes) -> list[bytes]:
    """The events, with what differs between two runs of the same request (its id, the clock) blanked."""
    body = re.sub(rb'"id":"[^"]*"', b'"id":""', body)
    body = re.sub(rb'"created":\d+', b'"created":0', body)
    return [e for e in body.split(b"\n\n") if e]


@pytest.mark.parametrize("route,options", [
    ("chat", None), ("chat", {"include_usage": True}), ("completions", None),
], ids=["chat without usage", "chat with usage", "completions without usage"])
def test_the_client_gets_vllms_own_bytes_and_the_gateway_counts_every_token(
    reject_gateway: ServerProcess, vllm: ServerProcess, route: str, options: dict[str, Any] | None
) -> None:
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    metrics = f"{reject_gateway.url}/metrics"
    counted = metric_sum(httpx.get(metrics).text, "vllm_guard_output_tokens_sum")
    through = httpx.post(reject_gateway.url + path, json=_body(route, options), timeout=120,
                         headers={"authorization": f"Bearer {API_KEY}"})
    direct = httpx.post(vllm.url + path, json=_body(route, options), timeout=120)
    assert through.status_code == direct.status_code == 200, through.text[:300]
    events = _normalised(through.content)
    assert events == _normalised(direct.content)
    assert len(events) <= 5, "stream_interval 1000 should send the output in very few events"
    assert (b'"choices":[]' in through.content) == bool(options)
    assert metric_sum(httpx.get(metrics).text, "vllm_guard_output_tokens_sum") - counted == GENERATED
