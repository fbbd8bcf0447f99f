"""The vLLM simulator speaks vLLM 0.32's API, error texts, metrics and KV-block behaviour."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from gateway.tools.tinymodel import build_tokenizer
from testing.vllm_sim import Fault, SimConfig, Simulator, create_sim_app, run_sim_server
from testing.vllm_sim.engine import Sequence

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    path = build_tokenizer(Path(tmp_path_factory.mktemp("tok")))
    tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(path))
    return tok


def make_client(config: SimConfig) -> tuple[httpx.AsyncClient, Simulator]:
    app = create_sim_app(config)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim")
    return client, app.state.sim


@pytest.fixture
async def sim_client(tokenizer: PreTrainedTokenizerBase) -> AsyncIterator[tuple[httpx.AsyncClient, Simulator]]:
    client, sim = make_client(SimConfig(tokenizer=tokenizer, max_model_len=256, num_blocks=64, block_size=16))
    async with client:
        yield client, sim


def chat_prompt_tokens(tok: PreTrainedTokenizerBase, messages: list[dict[str, Any]], **kwargs: Any) -> int:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return len(tok.encode(text, add_special_tokens=False))


def sse_events(text: str) -> list[Any]:
    assert text.endswith("data: [DONE]\n\n")
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [orjson.loads(e[6:]) for e in events[:-1]]


async def until(condition: Callable[[], bool], spins: int = 1000) -> None:
    """Let the loop run until ``condition`` holds (no wall-clock waiting)."""
    for _ in range(spins):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


# -- token counting ---------------------------------------------------------------------------------------

TOOL: dict[str, Any] = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize(
    "messages",
    [
        HELLO,
        [{"role": "system", "content": "Be brief."}, *HELLO, {"role": "assistant", "content": "Fine."},
         {"role": "user", "content": "And the weather?"}],
        [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}],
    ],
)
async def test_chat_prompt_tokens_are_what_the_tokenizer_counts(
    sim_client: tuple[httpx.AsyncClient, Simulator], tokenizer: PreTrainedTokenizerBase, messages: list[Any]
) -> None:
    client, _ = sim_client
    r = await client.post(CHAT, json={"messages": messages, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == chat_prompt_tokens(tokenizer, messages)


async def test_chat_tools_are_rendered_as_vllm_dumps_them(tokenizer: PreTrainedTokenizerBase) -> None:
    client, _ = make_client(SimConfig(tokenizer=tokenizer, max_model_len=512, num_blocks=64,
                                      enable_auto_tool_choice=True))
    async with client:
        r = await client.post(CHAT, json={"messages": HELLO, "tools": [TOOL], "max_tokens": 2})
    dumped = {"type": "function", "function": {**TOOL["function"]}}
    assert r.json()["usage"]["prompt_tokens"] == chat_prompt_tokens(tokenizer, HELLO, tools=[dumped])


async def test_tools_without_auto_tool_choice_are_refused_like_vllm(
    sim_client: tuple[httpx.AsyncClient, Simulator]
) -> None:
    client, _ = sim_client
    r = await client.post(CHAT, json={"messages": HELLO, "tools": [TOOL]})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith('"auto" tool choice requires --enable-auto-tool-choice')


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("Hello there, how are you?", lambda tok: [len(tok.encode("Hello there, how are you?"))]),
        ([5, 6, 7, 8, 9], lambda tok: [5]),
        (["one two", "three four five six"], lambda tok: [len(tok.encode("one two")),
                                                           len(tok.encode("three four five six"))]),
        ([[1, 2], [3, 4, 5]], lambda tok: [2, 3]),
    ],
)
async def test_completion_prompts_count_as_vllm_counts_them(
    sim_client: tuple[httpx.AsyncClient, Simulator], tokenizer: PreTrainedTokenizerBase,
    prompt: Any, expected: Callable[[Any], list[int]],
) -> None:
    client, _ = sim_client
    r = await client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 3, "n": 2})
    body = r.json()
    counts = expected(tokenizer)
    assert body["usage"]["prompt_tokens"] == sum(counts)
    assert len(body["choices"]) == 2 * len(counts)
    assert body["usage"]["completion_tokens"] == 3 * 2 * len(counts)


async def test_tokenize_agrees_with_chat_usage(sim_client: tuple[httpx.AsyncClient, Simulator]) -> None:
    client, _ = sim_client
    tokenized = (await client.post("/tokenize", json={"messages": HELLO})).json()
    usage = (await client.post(CHAT, json={"messages": HELLO, "max_tokens": 1})).json()["usage"]
    assert tokenized["count"] == usage["prompt_tokens"] == len(tokenized["tokens"])
    assert tokenized["max_model_len"] == 256
    text = (await client.post("/detokenize", json={"tokens": tokenized["tokens"]})).json()["prompt"]
    assert "Hello there, how are you?" in text


async def test_without_a_tokenizer_counting_is_deterministic_and_invertible() -> None:
    client, _ = make_client(SimConfig(max_model_len=512))
    async with client:
        first = (await client.post("/tokenize", json={"prompt": "abcdefgh ij"})).json()
        second = (await client.post("/tokenize", json={"prompt": "abcdefgh ij"})).json()
        text = (await client.post("/detokenize", json={"tokens": first["tokens"]})).json()["prompt"]
    assert first == second
    assert first["count"] == 4  # BOS, "abcd", "efgh", " ij"
    assert text == "abcdefgh ij"


# -- limits and error texts -------------------------------------------------------------------------------

LONG = "word " * 400


@pytest.mark.parametrize(
    ("path", "body", "status", "message", "param"),
    [
        (COMPLETIONS, {"prompt": LONG}, 400,
         "This model's maximum context length is 256 tokens. However, your prompt contains at least 257 input "
         "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
         "prompt.", "input_tokens"),
        (COMPLETIONS, {"prompt": list(range(300))}, 400,
         "This model's maximum context length is 256 tokens. However, your prompt contains 300 input tokens, which "
         "exceeds this limit even without any output tokens. Please reduce the length of the input prompt.",
         "input_tokens"),
        (CHAT, {"messages": HELLO, "max_tokens": 5000}, 400,
         "max_tokens=5000 cannot be greater than max_model_len=256. Please request fewer output tokens.",
         "max_tokens"),
        (CHAT, {"messages": HELLO, "max_completion_tokens": 300}, 400,
         "max_completion_tokens=300 cannot be greater than max_model_len=256. Please request fewer output tokens.",
         "max_completion_tokens"),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be at least 1, got 0.",
         "max_tokens"),
        (CHAT, {"messages": HELLO, "model": "gpt-4"}, 404, "The model `gpt-4` does not exist. Valid aliases: tiny.",
         "model"),
    ],
)
async def test_rejections_carry_vllm_texts(
    sim_client: tuple[httpx.AsyncClient, Simulator], path: str, body: dict[str, Any], status: int, message: str,
    param: str,
) -> None:
    client, sim = sim_client
    r = await client.post(path, json=body)
    assert r.status_code == status
    error = r.json()["error"]
    assert (error["message"], error["param"], error["code"]) == (message, param, status)
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert sim.used_blocks == 0 and sim.running == 0


@pytest.mark.parametrize(
    ("content", "headers", "param", "fragment"),
    [
        (b"{not json", {"content-type": "application/json"}, "body.1", "'type': 'json_invalid'"),
        (b'{"prompt": "hi", "max_tokens": "many"}', {"content-type": "application/json"}, "body.max_tokens",
         "'type': 'int_parsing'"),
        (b'{"prompt": "hi"}', {"content-type": "text/plain"}, None, "Unsupported Media Type"),
        (b'{"prompt": "hi", "stream_options": {"include_usage": true}}', {"content-type": "application/json"},
         "stream_options", "Stream options can only be defined when `stream=True`."),
    ],
)
async def test_malformed_requests_get_vllm_validation_errors(
    sim_client: tuple[httpx.AsyncClient, Simulator], content: bytes, headers: dict[str, str], param: str | None,
    fragment: str,
) -> None:
    client, _ = sim_client
    r = await client.post(COMPLETIONS, content=content, headers=headers)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "Bad Request"
    assert error["message"].startswith("1 validation error:\n")
    assert fragment in error["message"]
    assert error["param"] == param


async def test_prompt_plus_max_tokens_over_the_limit_is_clamped(
    sim_client: tuple[httpx.AsyncClient, Simulator]
) -> None:
    client, _ = sim_client
    r = await client.post(COMPLETIONS, json={"prompt": list(range(250)), "max_tokens": 100})
    body = r.json()
    assert body["usage"]["completion_tokens"] == 6
    assert body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("path", "body", "completion"), [
    (CHAT, {"messages": HELLO}, None),  # whatever context is left
    (COMPLETIONS, {"prompt": "hi"}, 16),
])
async def test_omitted_max_tokens_defaults_like_vllm(
    sim_client: tuple[httpx.AsyncClient, Simulator], path: str, body: dict[str, Any], completion: int | None
) -> None:
    client, _ = sim_client
    usage = (await client.post(path, json=body)).json()["usage"]
    assert usage["completion_tokens"] == (completion if completion is not None else 256 - usage["prompt_tokens"])


async def test_older_vllm_rejects_prompt_plus_max_tokens_in_the_flat_error_shape() -> None:
    client, _ = make_client(SimConfig(max_model_len=256, num_blocks=32, error_style="flat",
                                      reject_prompt_plus_max_tokens=True))
    async with client:
        r = await client.post(COMPLETIONS, json={"prompt": list(range(250)), "max_tokens": 100})
    assert r.status_code == 400
    assert r.json() == {
        "object": "error", "type": "BadRequestError", "param": None, "code": 400,
        "message": "This model's maximum context length is 256 tokens. However, you requested 350 tokens (250 in "
                   "the messages, 100 in the completion). Please reduce the length of the messages or completion.",
    }


@pytest.mark.parametrize(("headers", "status"), [
    ({}, 401), ({"Authorization": "Bearer wrong"}, 401), ({"Authorization": "Bearer sk-sim"}, 200),
])
async def test_api_key_guards_v1_like_vllm(headers: dict[str, str], status: int) -> None:
    client, _ = make_client(SimConfig(api_key="sk-sim"))
    async with client:
        r = await client.get("/v1/models", headers=headers)
        health = await client.get("/health")
    assert r.status_code == status
    if status == 401:
        assert r.json() == {"error": "Unauthorized"}
    assert health.status_code == 200


async def test_models_and_version_describe_the_server() -> None:
    client, _ = make_client(SimConfig(model="tiny-chat", root="/models/tiny", max_model_len=1024, num_blocks=64))
    async with client:
        card = (await client.get("/v1/models")).json()["data"][0]
        version = (await client.get("/version")).json()
    assert (card["id"], card["root"], card["max_model_len"], card["owned_by"]) == (
        "tiny-chat", "/models/tiny", 1024, "vllm")
    assert version == {"version": "0.32.0"}


# -- streaming --------------------------------------------------------------------------------------------

async def test_chat_streams_role_first_then_tokens_then_usage(sim_client: tuple[httpx.AsyncClient, Simulator]) -> None:
    client, _ = sim_client
    r = await client.post(CHAT, json={"messages": HELLO, "max_tokens": 3, "stream": True,
                                      "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["finish_reason"] for e in events[1:4]] == [None, None, "length"]
    assert all(e["object"] == "chat.completion.chunk" and "usage" not in e for e in events[:4])
    assert events[4]["choices"] == []
    assert events[4]["usage"]["completion_tokens"] == 3
    assert len({e["id"] for e in events}) == 1


async def test_completions_stream_every_choice_without_usage_unless_asked(
    sim_client: tuple[httpx.AsyncClient, Simulator]
) -> None:
    client, _ = sim_client
    r = await client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2, "n": 2, "stream": True})
    events = sse_events(r.text)
    assert sorted(e["choices"][0]["index"] for e in events) == [0, 0, 1, 1]
    assert all(e["object"] == "text_completion" and "usage" not in e for e in events)
    finished = [e["choices"][0]["text"] for e in events if e["choices"][0]["finish_reason"] == "length"]
    assert len(finished) == 2


@pytest.mark.parametrize(("ignore_eos", "completion", "finish"), [(False, 5, "stop"), (True, 20, "length")])
async def test_stop_early_ends_with_eos_unless_ignored(ignore_eos: bool, completion: int, finish: str) -> None:
    client, _ = make_client(SimConfig(max_model_len=512, stop_early=lambda index, max_tokens: 5))
    async with client:
        body = (await client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 20,
                                                     "ignore_eos": ignore_eos})).json()
    assert body["usage"]["completion_tokens"] == completion
    assert body["choices"][0]["finish_reason"] == finish


# -- the engine: blocks and preemption --------------------------------------------------------------------

def submit(sim: Simulator, prompt: int, max_tokens: int, n: int = 1) -> list[Sequence]:
    return sim.submit(prompt, n, max_tokens, max_tokens, lambda seq: None)


def run_to_completion(sim: Simulator, seqs: list[Sequence], limit: int = 10_000) -> None:
    for _ in range(limit):
        if all(s.done for s in seqs):
            return
        sim.step()
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize(("requests", "preempts"), [
    (4, False),  # 4 x ceil((30 + 34) / 16) = 16 blocks: exactly the cache
    (6, True),  # 6 x 4 = 24 blocks wanted of 16: overcommitted
])
def test_preemption_happens_exactly_when_overcommitted(requests: int, preempts: bool) -> None:
    sim = Simulator(SimConfig(max_model_len=256, num_blocks=16, block_size=16))
    sim.paused = True  # the test steps the engine itself
    seqs = [s for _ in range(requests) for s in submit(sim, 30, 34)]
    run_to_completion(sim, seqs)
    assert (sim.preemptions_total > 0) is preempts
    assert all(s.generated == 34 and s.finish_reason == "length" for s in seqs)
    assert sim.peak_used_blocks <= 16
    assert sim.used_blocks == 0 and sim.running == 0 and sim.waiting == 0


def test_a_preempted_sequence_resumes_first_and_keeps_its_tokens() -> None:
    sim = Simulator(SimConfig(max_model_len=64, num_blocks=4, block_size=16))
    sim.paused = True
    first, second = submit(sim, 15, 40)[0], submit(sim, 15, 40)[0]
    sim.step()  # both admitted: 1 block each
    while sim.preemptions_total == 0:
        sim.step()
    assert sim.waiting == 1 and not second.running and second.generated > 0
    kept = second.generated
    run_to_completion(sim, [first, second])
    assert second.generated == 40 and kept < 40


def test_sibling_choices_share_their_prompt_blocks() -> None:
    sim = Simulator(SimConfig(max_model_len=128, num_blocks=16, block_size=16))
    sim.paused = True
    seqs = submit(sim, 40, 8, n=3)
    sim.step()
    # 2 shared full prompt blocks + 3 x (ceil(41 / 16) - 2) own tail blocks, not 3 x 3
    assert sim.used_blocks == 2 + 3 * 1
    run_to_completion(sim, seqs)
    assert sim.used_blocks == 0


def test_kv_usage_counts_blocks_of_running_sequences() -> None:
    sim = Simulator(SimConfig(max_model_len=128, num_blocks=10, block_size=16))
    sim.paused = True
    submit(sim, 31, 8)
    sim.step()
    assert sim.kv_cache_usage == pytest.approx(0.2)


async def test_zero_delay_requests_finish_without_the_scheduler(
    sim_client: tuple[httpx.AsyncClient, Simulator]
) -> None:
    client, sim = sim_client
    r = await client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 8})
    assert r.json()["usage"]["completion_tokens"] == 8
    assert sim._task is None
    assert sim.peak_used_blocks == 1  # ceil((2 + 8) / 16)


async def test_delayed_requests_are_scheduled_concurrently() -> None:
    client, sim = make_client(SimConfig(max_model_len=128, num_blocks=8, block_size=16, token_delay=0.001))
    async with client:
        bodies = await asyncio.gather(*(client.post(COMPLETIONS, json={"prompt": list(range(20)), "max_tokens": 30})
                                        for _ in range(4)))
    assert all(b.json()["usage"]["completion_tokens"] == 30 for b in bodies)
    assert sim.preemptions_total > 0  # 4 x 4 blocks wanted of 8
    assert sim.used_blocks == 0


# -- client disconnects ----------------------------------------------------------------------------------

class AsgiCall:
    """Drives the ASGI app by hand so a test decides when the client goes away."""

    def __init__(self, app: Any, path: str, body: dict[str, Any]) -> None:
        self.app, self.path, self.body = app, path, orjson.dumps(body)
        self.sent: list[dict[str, Any]] = []
        self.gone = asyncio.Event()
        self.body_read = False

    async def receive(self) -> dict[str, Any]:
        if not self.body_read:
            self.body_read = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def start(self) -> asyncio.Task[None]:
        scope = {"type": "http", "method": "POST", "path": self.path, "raw_path": self.path.encode(),
                 "query_string": b"", "root_path": "", "scheme": "http", "server": ("sim", 80),
                 "headers": [(b"content-type", b"application/json")], "http_version": "1.1", "asgi": {"version": "3.0"}}
        return asyncio.ensure_future(self.app(scope, self.receive, self.send))


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_goes_away_frees_its_blocks(stream: bool) -> None:
    app = create_sim_app(SimConfig(max_model_len=256, num_blocks=32, block_size=16))
    sim: Simulator = app.state.sim
    sim.paused = True
    call = AsgiCall(app, COMPLETIONS, {"prompt": list(range(40)), "max_tokens": 100, "stream": stream})
    task = call.start()
    await until(lambda: sim.waiting == 1)
    sim.step()
    sim.step()
    assert sim.used_blocks == 3
    if stream:
        await until(lambda: any(m.get("body", b"").startswith(b"data: ") for m in call.sent))
    call.gone.set()
    await task
    assert (sim.cancelled, sim.used_blocks, sim.running, sim.waiting) == (1, 0, 0, 0)
    assert not any(m.get("more_body") is False for m in call.sent)


# -- metrics ---------------------------------------------------------------------------------------------

async def test_metrics_parse_and_carry_vllm_series(sim_client: tuple[httpx.AsyncClient, Simulator]) -> None:
    client, _ = sim_client
    await client.post(COMPLETIONS, json={"prompt": [1, 2, 3], "max_tokens": 7})
    text = (await client.get("/metrics")).text
    samples = {s.name: s for family in text_string_to_metric_families(text) for s in family.samples}
    info = samples["vllm:cache_config_info"]
    assert info.value == 1
    # 64 blocks for requests and vLLM's null block, which vLLM counts in its tokens too (4096 = 32 x 128 on a
    # real 0.32 engine: tests/fixtures/vllm/v1-0.32.0).
    assert (info.labels["block_size"], info.labels["num_gpu_blocks"], info.labels["kv_cache_size_tokens"]) == (
        "16", "65", "1040")
    assert samples["vllm:generation_tokens_total"].value == 7
    assert samples["vllm:prompt_tokens_total"].value == 3
    assert samples["vllm:prompt_tokens_total"].labels == {"model_name": "tiny", "engine": "0"}
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:num_preemptions_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count"):
        assert name in samples


async def test_disabled_log_stats_expose_no_vllm_series() -> None:
    client, _ = make_client(SimConfig(disable_log_stats=True))
    async with client:
        text = (await client.get("/metrics")).text
    assert "vllm:" not in text


# -- faults and the real server --------------------------------------------------------------------------

@pytest.mark.parametrize(("fault", "status", "check"), [
    (Fault.ERROR_500, 500, lambda r: r.json()["error"]["type"] == "InternalServerError"),
    (Fault.ENGINE_DEAD, 500, lambda r: r.json()["error"]["message"].startswith("EngineCore encountered an issue")),
    (Fault.GARBAGE, 200, lambda r: r.text.startswith("<html>")),
])
def test_faults_answer_like_a_broken_server(fault: Fault, status: int, check: Callable[[httpx.Response], bool]) -> None:
    with run_sim_server(SimConfig(fault=fault)) as server:
        r = httpx.post(server.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == status
    assert check(r)


def test_reset_and_hang_faults_break_the_transport() -> None:
    with run_sim_server(SimConfig(fault=Fault.RESET)) as server:
        with pytest.raises(httpx.TransportError):
            httpx.post(server.url + COMPLETIONS, json={"prompt": "hi"})
        server.sim.config.fault = Fault.HANG
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + COMPLETIONS, json={"prompt": "hi"}, timeout=0.2)
        server.sim.config.fault = None
        assert httpx.post(server.url + COMPLETIONS, json={"prompt": "hi"}).status_code == 200
        assert httpx.get(server.url + "/health").status_code == 200


def test_dying_mid_stream_sends_some_chunks_then_drops_the_connection() -> None:
    chunks: list[str] = []
    config = SimConfig(fault=Fault.DIE_MID_STREAM, fault_after_chunks=2)
    body = {"prompt": "hi", "max_tokens": 10, "stream": True}
    with run_sim_server(config) as server, pytest.raises(httpx.TransportError), httpx.stream(
        "POST", server.url + COMPLETIONS, json=body
    ) as r:
        chunks.extend(line for line in r.iter_lines() if line)
    assert len(chunks) == 2
    assert all(c.startswith("data: {") for c in chunks)


async def test_the_async_server_serves_on_the_running_loop() -> None:
    async with run_sim_server(SimConfig()) as server, httpx.AsyncClient(base_url=server.url) as client:
        r = await client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 3})
        assert r.json()["usage"]["completion_tokens"] == 3
        assert server.sim.requests_seen[-1] == {"prompt": "hi", "max_tokens": 3}
