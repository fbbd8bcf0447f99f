"""The fast fake engine speaks vLLM's wire format: its stream chunks are byte for byte the simulator's (which holds
vLLM 0.32's shapes) but for the id and the time, one chunk per event; its full answers carry every field vLLM
writes; its /metrics page tells a gateway of a cache that never fills."""

from __future__ import annotations

import asyncio
import re
import types
from collections.abc import AsyncIterator

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.servers.fake_engine import Connection, Engine
from testing.vllm_sim.wire import Plan, SseWriter, full_body

IDS = re.compile(rb'"id":"[a-z]+-[0-9a-f]+","object":"([a-z._]+)","created":\d+')


@pytest.fixture
async def engine() -> AsyncIterator[tuple[Engine, int]]:
    eng = Engine("tiny", 4096, 0.001)
    server = await asyncio.get_running_loop().create_server(lambda: Connection(eng), "127.0.0.1", 0)
    try:
        yield eng, server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def exchange(port: int, method: str, path: str, body: bytes = b"") -> tuple[bytes, list[bytes]]:
    """The head and the body's chunks (one item when the body has a content-length) of one request."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
                 .encode() + body)
    raw = await asyncio.wait_for(reader.read(-1), 10)
    writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" not in head:
        return head, [rest]
    chunks = []
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        chunks.append(rest[:n])
        rest = rest[n + 2:]
    return head, chunks


def anonymous(data: bytes) -> bytes:
    return IDS.sub(rb'"id":"ID","object":"\1","created":0', data)


def simulated(chat: bool, n: int, prompt: int, include: bool, continuous: bool) -> list[bytes]:
    plan = Plan(chat=chat, request_id="cmpl-0", prompts=[prompt], max_tokens=[n], n=1, stream=True,
                include_usage=include, continuous_usage=continuous, ignore_eos=True)
    writer = SseWriter(plan, "tiny", 0, 1)
    events = [e for k in range(1, n + 1) for e in writer.token_chunks(0, k, "length" if k == n else None)]
    if include:
        events.append(writer.usage_chunk())
    return [anonymous(e) for e in [*events, b"data: [DONE]\n\n"]]


def body_of(chat: bool, n: int, usage: dict[str, bool] | None, stream: bool = True) -> bytes:
    body: dict[str, object] = {"model": "tiny", "max_tokens": n, "stream": stream}
    body |= {"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Once upon"}
    if usage is not None:
        body["stream_options"] = usage
    return orjson.dumps(body)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize(
    "usage",
    [None, {"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True}],
    ids=["no usage", "final usage", "usage on every chunk"],
)
async def test_a_stream_is_the_simulators_chunk_for_chunk(engine: tuple[Engine, int], chat: bool,
                                                          usage: dict[str, bool] | None) -> None:
    _, port = engine
    body = body_of(chat, 4, usage)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    head, chunks = await exchange(port, "POST", path, body)
    assert head.startswith(b"HTTP/1.1 200 OK") and b"text/event-stream" in head
    include = bool(usage and usage.get("include_usage"))
    continuous = include and bool(usage and usage.get("continuous_usage_stats"))
    assert [anonymous(c) for c in chunks] == simulated(chat, 4, len(body) // 4, include, continuous)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_a_full_answer_carries_every_field_the_simulator_writes_in_its_order(engine: tuple[Engine, int],
                                                                                   chat: bool) -> None:
    _, port = engine
    body = body_of(chat, 3, None, stream=False)
    _, (raw,) = await exchange(port, "POST", "/v1/chat/completions" if chat else "/v1/completions", body)
    got = orjson.loads(raw)
    plan = Plan(chat=chat, request_id="x", prompts=[len(body) // 4], max_tokens=[3], n=1, stream=False,
                include_usage=False, continuous_usage=False, ignore_eos=True)
    seq = types.SimpleNamespace(index=0, generated=3, finish_reason="length")
    want = full_body(plan, [seq], "tiny")  # type: ignore[list-item]
    assert list(got) == list(want)
    assert list(got["choices"][0]) == list(want["choices"][0])
    assert got["choices"] == want["choices"] and got["usage"] == want["usage"]


async def test_an_answer_biased_to_stop_ends_after_min_tokens_as_vllm_ends_it(engine: tuple[Engine, int]) -> None:
    _, port = engine
    body = orjson.dumps({"model": "tiny", "prompt": "x", "max_tokens": 50, "min_tokens": 2, "logit_bias": {"2": 100},
                         "stream": True, "stream_options": {"include_usage": True}})
    _, chunks = await exchange(port, "POST", "/v1/completions", body)
    last_token = orjson.loads(chunks[-3].removeprefix(b"data: "))
    assert last_token["choices"][0]["finish_reason"] == "stop"
    assert orjson.loads(chunks[-2].removeprefix(b"data: "))["usage"]["completion_tokens"] == 3


async def test_a_request_may_set_its_own_pace(engine: tuple[Engine, int]) -> None:
    _, port = engine
    body = orjson.dumps({"model": "tiny", "prompt": "x", "max_tokens": 5, "stream": True, "fake_token_delay": 0.05})
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await exchange(port, "POST", "/v1/completions", body)
    assert loop.time() - t0 >= 0.2  # four waits between five tokens


@pytest.mark.parametrize("size", [1, 7, 16384])
async def test_a_request_may_ask_for_tokens_of_its_own_size(engine: tuple[Engine, int], size: int) -> None:
    _, port = engine
    body = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                         "stream": True, "fake_token_bytes": size})
    _, chunks = await exchange(port, "POST", "/v1/chat/completions", body)
    texts = [orjson.loads(c.removeprefix(b"data: "))["choices"][0]["delta"].get("content") for c in chunks[1:-1]]
    assert [len(t) for t in texts] == [size] * 3


async def test_the_metrics_page_tells_of_a_cache_that_never_fills_and_counts_what_was_generated(
        engine: tuple[Engine, int]) -> None:
    eng, port = engine
    await exchange(port, "POST", "/v1/chat/completions", body_of(True, 3, None, stream=False))
    _, (page,) = await exchange(port, "GET", "/metrics")
    samples = {s.name: s for f in text_string_to_metric_families(page.decode()) for s in f.samples}
    assert int(samples["vllm:cache_config_info"].labels["num_gpu_blocks"]) > 1_000_000
    assert samples["vllm:generation_tokens_total"].value == 3.0
    assert samples["vllm:num_requests_running"].value == 0.0
    assert eng.requests == 1


async def test_models_health_version_and_an_unknown_path(engine: tuple[Engine, int]) -> None:
    _, port = engine
    _, (models,) = await exchange(port, "GET", "/v1/models")
    assert orjson.loads(models)["data"][0] | {"created": 0} == {
        "id": "tiny", "object": "model", "created": 0, "owned_by": "vllm", "root": "tiny", "parent": None,
        "max_model_len": 4096, "permission": []}
    head, _ = await exchange(port, "GET", "/health")
    assert head.startswith(b"HTTP/1.1 200 OK")
    _, (version,) = await exchange(port, "GET", "/version")
    assert orjson.loads(version) == {"version": "0.32.0"}
    head, _ = await exchange(port, "GET", "/nowhere")
    assert head.startswith(b"HTTP/1.1 404")


async def test_a_body_that_is_not_json_is_refused_with_400(engine: tuple[Engine, int]) -> None:
    _, port = engine
    head, (body,) = await exchange(port, "POST", "/v1/chat/completions", b"{not json")
    assert head.startswith(b"HTTP/1.1 400") and b"error" in body


async def test_a_keep_alive_connection_carries_one_request_after_another(engine: tuple[Engine, int]) -> None:
    _, port = engine
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(3):
        writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200 OK")
    writer.close()
