"""On the real vLLM: a stream with ``stream_interval: 1000`` carries its whole output in one or two events; the
gateway asks vLLM for usage on every chunk, counts the engine's figure, and relays the bytes vLLM would have
sent the client for the options it asked (no usage chunk, no per-chunk usage, the fingerprint on the last
chunk), options that are not JSON booleans read as vLLM reads them, and several choices ending apart in vLLM's
own order, from the first stream a gateway relays (its engine's fingerprint not yet known) on."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from testing.servers import API_KEY, GATEWAY_READY_PATHS, ServerProcess, gateway_server, metric_sum

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
    ("chat", None), ("chat", {"include_usage": True}), ("completions", None), ("chat", {"include_usage": "no"}),
    ("completions", {"include_usage": 0, "continuous_usage_stats": 1}),
], ids=["chat without usage", "chat with usage", "completions without usage", "chat, usage declined as 'no'",
        "completions, usage declined as 0"])
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
    assert (b'"choices":[]' in through.content) == (options == {"include_usage": True})
    assert metric_sum(httpx.get(metrics).text, "vllm_guard_output_tokens_sum") - counted == GENERATED


def _eos_id(model: Path) -> int:
    tokens = json.loads((model / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    return int(next(t["id"] for t in tokens if t["content"] == "</s>"))


def _choices(events: list[bytes]) -> dict[int, list[dict[str, Any]]]:
    """Each choice's chunks, parsed, in the stream's order."""
    out: dict[int, list[dict[str, Any]]] = {}
    for event in events:
        if event.startswith(b"data: {"):
            data = json.loads(event[6:])
            for choice in data["choices"]:
                out.setdefault(choice["index"], []).append(data)
    return out


def _text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or "" for c in chunks)


def _without_text(chunk: dict[str, Any]) -> dict[str, Any]:
    choice = {k: v for k, v in chunk["choices"][0].items() if k not in ("text", "delta")}
    return {**chunk, "choices": [choice]}


def _apart(route: str, model: Path) -> dict[str, Any]:
    """Three choices sampled with a seed (vLLM gives choice i the seed + i) and a bias on EOS: they end at
    different steps, the same in every run."""
    body = {**_body(route, None), "n": 3, "max_tokens": 48, "temperature": 1.0, "seed": 11,
            "logit_bias": {str(_eos_id(model)): 4}, "ignore_eos": False}
    del body["stream_interval"]
    return body


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_several_choices_ending_apart_end_as_vllm_ends_them(
    reject_gateway: ServerProcess, vllm: ServerProcess, tiny_model: Path, route: str
) -> None:
    """Three choices ending apart (``_apart``), the same in both runs; without include_usage vLLM stamps each
    one's last chunk with its fingerprint as that choice ends. The gateway, which asks for usage and so gets no
    stamp, stamps the fingerprint it learned from an earlier stream as each choice ends: the first choice's end
    comes before the others' tokens, as in vLLM's stream, not held to the end of the request. (Two runs of one
    request need not frame their events alike: vLLM merges the outputs of a step its API server read late.
    The simulator's tests compare the bytes.)"""
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    auth = {"authorization": f"Bearer {API_KEY}"}
    warm = httpx.post(reject_gateway.url + path, json=_body(route, None), timeout=120, headers=auth)
    assert warm.status_code == 200  # an earlier stream: its usage chunk told the engine's fingerprint
    body = _apart(route, tiny_model)
    through = httpx.post(reject_gateway.url + path, json=body, timeout=120, headers=auth)
    direct = httpx.post(vllm.url + path, json=body, timeout=120)
    assert through.status_code == direct.status_code == 200, through.text[:300]
    mine, vllms = _normalised(through.content), _normalised(direct.content)
    assert b'"usage"' not in through.content and b'"choices":[]' not in through.content
    ours, theirs = _choices(mine), _choices(vllms)
    assert sorted(ours) == sorted(theirs) == [0, 1, 2]
    for i in range(3):  # each choice: the same answer, and the same last chunk (its fingerprint included)
        assert _text(ours[i]) == _text(theirs[i])
        assert _without_text(ours[i][-1]) == _without_text(theirs[i][-1])
        assert ours[i][-1].get("system_fingerprint", "") == theirs[i][-1]["system_fingerprint"] != ""
    lengths = sorted((len(_text(theirs[i])), i) for i in range(3))
    first = lengths[0][1]
    assert lengths[0][0] < lengths[-1][0], "the seed should end the choices apart"
    # The first choice to end: in both streams, other choices' tokens follow its last chunk.
    for events in (mine, vllms):
        end = next(k for k, e in enumerate(events) if b'"finish_reason":"' in e and b'"index":%d,' % first in e)
        assert any(b'"finish_reason":null' in e for e in events[end + 1:]), "held to the end of the request"


@pytest.fixture
def fresh_gateway(vllm: ServerProcess, tmp_path: Path) -> Iterator[ServerProcess]:
    """A gateway that has relayed no stream yet: no usage chunk has told it the engine's fingerprint."""
    server = gateway_server(vllm.url, tmp_path / "fresh-gateway.log", ["--api-key", API_KEY], name="fresh-gateway")
    try:
        server.start()
        server.wait_ready(GATEWAY_READY_PATHS, 90.0)
        yield server
    finally:
        server.stop()


def _ends(events: list[bytes]) -> list[int]:
    """The choices in the order their last chunks come."""
    return [int(json.loads(e[6:])["choices"][0]["index"]) for e in events if b'"finish_reason":"' in e]


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_the_first_stream_a_gateway_relays_ends_each_choice_where_vllm_ends_it(
    fresh_gateway: ServerProcess, vllm: ServerProcess, tiny_model: Path, route: str
) -> None:
    """Before the engine's fingerprint is known, a choice that ends while others still run is relayed at once,
    not held behind their text until the usage chunk tells the fingerprint: it comes without the fingerprint;
    the last choice's end waits only for that usage chunk, right behind it, and carries vLLM's."""
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    body = _apart(route, tiny_model)
    through = httpx.post(fresh_gateway.url + path, json=body, timeout=120,
                         headers={"authorization": f"Bearer {API_KEY}"})
    direct = httpx.post(vllm.url + path, json=body, timeout=120)
    assert through.status_code == direct.status_code == 200, through.text[:300]
    mine, vllms = _normalised(through.content), _normalised(direct.content)
    assert b'"usage"' not in through.content and b'"choices":[]' not in through.content
    ours, theirs = _choices(mine), _choices(vllms)
    assert sorted(ours) == sorted(theirs) == [0, 1, 2]
    order = _ends(vllms)
    assert _ends(mine) == order
    # The first choice to end: other choices' tokens follow its last chunk, as in vLLM's stream.
    end = next(k for k, e in enumerate(mine) if b'"finish_reason":"' in e)
    assert any(b'"finish_reason":null' in e for e in mine[end + 1:]), "held to the end of the request"
    fingerprint = theirs[order[-1]][-1]["system_fingerprint"]
    for i in range(3):
        assert _text(ours[i]) == _text(theirs[i])
        assert _without_text(ours[i][-1]) | {"system_fingerprint": fingerprint} == _without_text(theirs[i][-1])
    assert ours[order[-1]][-1]["system_fingerprint"] == fingerprint != ""
    assert "system_fingerprint" not in ours[order[0]][-1]  # not known yet when it ended
