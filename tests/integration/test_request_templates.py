"""Chat templates sent in requests: refused without --trust-request-chat-template, sandboxed with it."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from gateway.config import Settings
from gateway.errors import GatewayError, InvalidRequest
from gateway.guard.counting import LocalCounter, RemoteCounter
from gateway.guard.counting.chatformat import prepare_chat
from gateway.guard.counting.templates import RequestTemplates, TemplateLimits, TemplateSandbox
from gateway.http.errors import status_and_type
from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import SimConfig, SimServer, run_sim_server

TIMEOUT = 0.5
MAX_CHARS = 100_000
LIMITS = TemplateLimits(timeout=TIMEOUT, max_chars=MAX_CHARS, memory_bytes=256 * 1024 * 1024)

U = {"role": "user", "content": "What is the weather in Paris today?"}
A = {"role": "assistant", "content": "Sunny."}
SIMPLE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

# Templates a client could send to hurt the server, each with the refusal it gets.
NESTED_LOOPS = (
    "{% for a in range(600) %}{% for b in range(600) %}{% for c in range(600) %}{{ '' }}"
    "{% endfor %}{% endfor %}{% endfor %}"
)
OUTPUT_BOMB = "{% for a in range(100000) %}{% for b in range(100000) %}{{ 'x' * 90 }}{% endfor %}{% endfor %}"
# One allocation of 1 GB: over every memory limit used here, and refused at once rather than filled slowly.
MEMORY_BOMB = "{% set s = 'x' * 1000000000 %}{{ s | length }}"
HOSTILE: list[tuple[str, str, str]] = [
    ("nested loops stop at the timeout", NESTED_LOOPS, f"took longer than {TIMEOUT:g} s to render"),
    ("an output bomb stops at the size cap", OUTPUT_BOMB, f"rendered more than {MAX_CHARS:,} characters"),
    ("a memory bomb stops at the memory limit", MEMORY_BOMB, "MiB of memory to render"),
    ("a template that raises gives its reason", "{{ raise_exception('roles must alternate') }}", "roles must alt"),
    ("a syntax error gives the parser's message", "{% for %}", "Expected an expression"),
    ("the sandbox refuses unsafe attributes", "{{ messages.__class__.__mro__ }}", "unsafe"),
]

ORDINARY: list[tuple[str, dict[str, Any]]] = [
    ("a simple template", {"messages": [U, A, U], "chat_template": SIMPLE}),
    (
        "special tokens in the template",
        {"messages": [U], "chat_template": "{{ bos_token }}" + SIMPLE + "{{ eos_token }}"},
    ),
    (
        "a generation prompt",
        {
            "messages": [U],
            "chat_template": SIMPLE + "{% if add_generation_prompt %}[assistant] {% endif %}",
            "add_generation_prompt": True,
        },
    ),
    (
        "content parts looped over by the template",
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "One."}, {"type": "text", "text": "2"}]}
            ],
            "chat_template": "{% for m in messages %}{% for p in m['content'] %}<{{ p['text'] }}>{% endfor %}"
            "{% endfor %}",
        },
    ),
    ("tools", {"messages": [U], "tools": TOOLS, "chat_template": "{{ tools | tojson }}" + SIMPLE}),
    ("template kwargs", {"messages": [U], "chat_template_kwargs": {"mood": "calm"}, "chat_template": "{{ mood }}|"}),
    ("a developer turn", {"messages": [{"role": "developer", "content": "Be brief."}, U], "chat_template": SIMPLE}),
    (
        "a continued final message",
        {"messages": [U, A], "chat_template": SIMPLE, "continue_final_message": True, "add_generation_prompt": False},
    ),
    ("special tokens added on request", {"messages": [U], "chat_template": SIMPLE, "add_special_tokens": True}),
]


def ids(cases: list[tuple[Any, ...]]) -> list[str]:
    return [c[0] for c in cases]


async def eventually(condition: Callable[[], bool], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {within} s")
        await asyncio.sleep(0.005)


def in_process_count(tok: Any, body: dict[str, Any]) -> int:
    """The count as the gateway computed it in its own process before templates were sandboxed."""
    template = body["chat_template"]
    prepared = prepare_chat(body, template)
    text = tok.apply_chat_template(
        prepared.conversation, tools=prepared.tools, chat_template=template, tokenize=False, **prepared.kwargs
    )
    return len(tok(text, add_special_tokens=prepared.add_special_tokens)["input_ids"])


def tokenizer_count(tok: Any, messages: list[dict[str, Any]], template: str) -> int:
    text = tok.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    return len(tok(text, add_special_tokens=False)["input_ids"])


# -- the policy ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [U], "chat_template": SIMPLE}, "chat_template"),
        ({"messages": [U], "chat_template": ""}, "chat_template"),
        ({"messages": [U], "chat_template": NESTED_LOOPS}, "chat_template"),
        ({"messages": [U], "chat_template_kwargs": {"chat_template": SIMPLE}}, "chat_template_kwargs.chat_template"),
    ],
    ids=["a template", "an empty template", "a costly template", "a template inside chat_template_kwargs"],
)
async def test_untrusted_request_templates_are_refused_before_anything_renders(
    tokenizer: Any, body: dict[str, Any], param: str
) -> None:
    sent: list[dict[str, Any]] = []

    async def tokenize(payload: dict[str, Any]) -> dict[str, Any]:
        sent.append(payload)
        return {"count": 1}

    counters: list[Any] = [LocalCounter(tokenizer), RemoteCounter(tokenize, "tiny")]
    for counter in counters:
        for call in (counter.count_chat(body), counter.truncate_chat(body, 10)):
            with pytest.raises(InvalidRequest) as info:
                await call
            assert info.value.param == param
            assert "--trust-request-chat-template" in info.value.message
    assert sent == []


def test_a_request_without_a_template_is_not_affected_by_the_policy() -> None:
    assert RequestTemplates(trusted=False).requested({"messages": [U]}) is None
    assert RequestTemplates(trusted=False).requested({"messages": [U], "chat_template": None}) is None
    with pytest.raises(InvalidRequest, match="must be a string"):
        RequestTemplates(trusted=True).requested({"messages": [U], "chat_template": 42})


def test_the_limits_come_from_the_settings(tokenizer_dir: Path) -> None:
    settings = Settings(
        tokenizer=str(tokenizer_dir),
        trust_request_chat_template=True,
        request_template_timeout=2.5,
        request_template_max_chars=5000,
        request_template_memory_mib=128,
        request_template_workers=2,
    )
    templates = RequestTemplates.from_settings(settings)
    assert templates.trusted
    assert templates.limits == TemplateLimits(timeout=2.5, max_chars=5000, memory_bytes=128 * 1024 * 1024, workers=2)
    assert not RequestTemplates.from_settings(Settings(tokenizer=str(tokenizer_dir))).trusted


# -- the sandbox, with one worker shared by the cases below ----------------------------------------------
@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def trusted(tokenizer: Any) -> AsyncIterator[tuple[LocalCounter, RequestTemplates]]:
    templates = RequestTemplates(trusted=True, limits=LIMITS)
    try:
        yield LocalCounter(tokenizer, templates=templates), templates
    finally:
        await templates.close()


async def assert_healthy(counter: LocalCounter, tokenizer: Any) -> None:
    body = {"messages": [U, A, U], "chat_template": SIMPLE}
    assert await counter.count_chat(body) == tokenizer_count(tokenizer, body["messages"], SIMPLE)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(("case", "body"), ORDINARY, ids=ids(ORDINARY))
async def test_a_trusted_request_template_is_counted_exactly(
    trusted: tuple[LocalCounter, RequestTemplates], tokenizer: Any, case: str, body: dict[str, Any]
) -> None:
    counter, _ = trusted
    assert await counter.count_chat(body) == in_process_count(tokenizer, body)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_trusted_request_template_counts_as_the_tokenizer_renders_it(
    trusted: tuple[LocalCounter, RequestTemplates], tokenizer: Any
) -> None:
    counter, _ = trusted
    for template in (SIMPLE, "{{ bos_token }}" + SIMPLE, "{% for m in messages %}{{ m.content | upper }}{% endfor %}"):
        body = {"messages": [U, A, U], "chat_template": template}
        assert await counter.count_chat(body) == tokenizer_count(tokenizer, body["messages"], template)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(("case", "template", "message"), HOSTILE, ids=ids(HOSTILE))
async def test_a_hostile_template_is_refused_and_the_worker_recovers(
    trusted: tuple[LocalCounter, RequestTemplates], tokenizer: Any, case: str, template: str, message: str
) -> None:
    counter, _ = trusted
    await assert_healthy(counter, tokenizer)  # the worker is up: what follows times the render alone
    t0 = time.monotonic()
    with pytest.raises(InvalidRequest) as info:
        await counter.count_chat({"messages": [U], "chat_template": template})
    elapsed = time.monotonic() - t0
    assert message in info.value.message
    assert status_and_type(info.value)[0] == 400 and info.value.param == "chat_template"
    assert elapsed < LIMITS.kill_after
    await assert_healthy(counter, tokenizer)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"continue_final_message": True}, None, "not compatible"),
        ({"chat_template_kwargs": {"return_assistant_tokens_mask": True}}, None, "requires `return_dict=True`"),
        ({"chat_template_kwargs": {"chat_template": SIMPLE}}, "chat_template_kwargs.chat_template", "may not set"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "must be a string"),
    ],
    ids=["continue and generation prompt together", "an assistant mask", "a second template in the kwargs",
         "malformed content"],
)
async def test_a_trusted_request_template_meets_the_same_checks_as_the_models_own(
    trusted: tuple[LocalCounter, RequestTemplates], tokenizer: Any, fields: dict[str, Any], param: str | None,
    message: str,
) -> None:
    counter, templates = trusted
    renders = templates.sandbox.renders
    with pytest.raises(InvalidRequest, match=message) as info:
        await counter.count_chat({"messages": [U, A], "chat_template": SIMPLE, **fields})
    assert info.value.param == param
    assert templates.sandbox.renders == renders  # refused before the worker saw it


@pytest.mark.asyncio(loop_scope="module")
async def test_truncation_renders_the_request_template_in_the_sandbox(
    trusted: tuple[LocalCounter, RequestTemplates], tokenizer: Any
) -> None:
    counter, templates = trusted
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "old " * 200}, A, U]
    body = {"messages": messages, "chat_template": SIMPLE}
    renders = templates.sandbox.renders
    cut = await counter.truncate_chat(body, 40)
    assert templates.sandbox.renders > renders
    assert cut.prompt_tokens <= 40 and cut.messages[0] == messages[0] and cut.messages[-1] == U
    assert cut.prompt_tokens == tokenizer_count(tokenizer, cut.messages, SIMPLE)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_caller_that_goes_away_mid_render_leaves_a_fresh_worker(
    trusted: tuple[LocalCounter, RequestTemplates], tokenizer: Any
) -> None:
    counter, templates = trusted
    await assert_healthy(counter, tokenizer)
    restarts = templates.sandbox.restarts
    task = asyncio.ensure_future(counter.count_chat({"messages": [U], "chat_template": NESTED_LOOPS}))
    await eventually(lambda: templates.sandbox.busy > 0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_healthy(counter, tokenizer)
    assert templates.sandbox.restarts == restarts + 1


@pytest.mark.asyncio(loop_scope="module")
async def test_renders_queue_for_the_worker_in_arrival_order(
    trusted: tuple[LocalCounter, RequestTemplates], tokenizer: Any
) -> None:
    counter, _ = trusted
    await assert_healthy(counter, tokenizer)
    done: list[str] = []

    async def run(name: str, template: str) -> None:
        with contextlib.suppress(InvalidRequest):
            await counter.count_chat({"messages": [U], "chat_template": template})
        done.append(name)

    await asyncio.gather(run("costly", NESTED_LOOPS), run("ordinary", SIMPLE))
    assert done == ["costly", "ordinary"]


# -- a worker that never answers is killed ------------------------------------------------------------
SILENT_WORKER = """
import os, struct, sys, time
out = os.fdopen(1, "wb")
body = b'{"status": "ready"}'
out.write(struct.pack(">I", len(body)) + body); out.flush()
time.sleep(600)
"""


async def test_a_worker_that_does_not_answer_is_killed_and_replaced() -> None:
    limits = TemplateLimits(timeout=0.2, max_chars=1000)
    sandbox = TemplateSandbox(limits, command=[sys.executable, "-c", SILENT_WORKER])
    try:
        t0 = time.monotonic()
        with pytest.raises(InvalidRequest, match=r"took longer than 0\.2 s"):
            await sandbox.render(b"{}")
        assert limits.kill_after <= time.monotonic() - t0 < limits.kill_after + 2
        assert sandbox.restarts == 0  # the replacement starts in the background ...
        with pytest.raises(InvalidRequest, match="took longer than"):
            await sandbox.render(b"{}")  # ... and takes the next job
        assert sandbox.restarts >= 1
    finally:
        await sandbox.close()
    assert sandbox.live_workers() == 0


async def test_a_worker_that_cannot_start_gives_a_server_error() -> None:
    sandbox = TemplateSandbox(TemplateLimits(), command=[sys.executable, "-c", "import sys; sys.exit(3)"])
    try:
        for _ in range(2):  # and is tried again for the next request
            with pytest.raises(GatewayError, match="could not start") as info:
                await sandbox.render(b"{}")
            assert status_and_type(info.value)[0] == 500
    finally:
        await sandbox.close()


# -- over HTTP: the gateway in front of the vLLM simulator ------------------------------------------------
@pytest.fixture(scope="module")
def sim(tokenizer: Any, tokenizer_dir: Path) -> Iterator[SimServer]:
    config = SimConfig(model="tiny", root=str(tokenizer_dir), max_model_len=512, num_blocks=256, tokenizer=tokenizer)
    with run_sim_server(config) as server:
        yield server


def settings_for(tokenizer_dir: Path, sim: SimServer, **extra: Any) -> Settings:
    return Settings(tokenizer=str(tokenizer_dir), upstream=sim.url, scrape_interval=0.05, queue_timeout=5.0, **extra)


@pytest.fixture(scope="module")
def untrusting(sim: SimServer, tokenizer_dir: Path) -> Iterator[GatewayServer]:
    with run_gateway(settings_for(tokenizer_dir, sim)) as gw:
        yield gw


@pytest.fixture(scope="module")
def trusting(sim: SimServer, tokenizer_dir: Path) -> Iterator[GatewayServer]:
    settings = settings_for(
        tokenizer_dir, sim, trust_request_chat_template=True, request_template_timeout=1.0,
        request_template_max_chars=MAX_CHARS,
    )
    with run_gateway(settings) as gw:
        yield gw


def chat(gw: GatewayServer, **fields: Any) -> httpx.Response:
    body = {"model": "tiny", "messages": [U], "max_tokens": 4, **fields}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30)


def assert_refused(response: httpx.Response, param: str, message: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert message in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"chat_template": SIMPLE}, "chat_template"),
        ({"chat_template": NESTED_LOOPS, "stream": True}, "chat_template"),
        ({"chat_template_kwargs": {"chat_template": SIMPLE}}, "chat_template_kwargs.chat_template"),
    ],
    ids=["a template", "a costly template, streamed", "a template inside chat_template_kwargs"],
)
def test_without_the_flag_a_request_template_gets_400_and_never_reaches_the_engine(
    untrusting: GatewayServer, sim: SimServer, fields: dict[str, Any], param: str
) -> None:
    seen = sim.sim.request_count
    t0 = time.monotonic()
    response = chat(untrusting, **fields)
    assert time.monotonic() - t0 < 1.0
    assert_refused(response, param, "--trust-request-chat-template")
    assert sim.sim.request_count == seen
    untrusting.wait_ledger_empty()
    assert chat(untrusting).status_code == 200


def test_with_the_flag_a_request_template_is_counted_exactly(
    trusting: GatewayServer, tokenizer: Any
) -> None:
    for template in (SIMPLE, "{{ bos_token }}" + SIMPLE + "<|im_start|>assistant\n"):
        response = chat(trusting, chat_template=template, messages=[U, A, U])
        assert response.status_code == 200, response.text
        assert int(response.headers["x-guard-prompt-tokens"]) == tokenizer_count(tokenizer, [U, A, U], template)
    trusting.wait_ledger_empty()


@pytest.mark.parametrize(("case", "template", "message"), HOSTILE[1:], ids=ids(HOSTILE[1:]))
def test_with_the_flag_a_hostile_template_gets_400_and_the_gateway_stays_healthy(
    trusting: GatewayServer, sim: SimServer, tokenizer: Any, case: str, template: str, message: str
) -> None:
    seen = sim.sim.request_count
    assert_refused(chat(trusting, chat_template=template), "chat_template", message)
    assert sim.sim.request_count == seen
    trusting.wait_ledger_empty()
    healthy = chat(trusting, chat_template=SIMPLE)
    assert healthy.status_code == 200, healthy.text
    assert int(healthy.headers["x-guard-prompt-tokens"]) == tokenizer_count(tokenizer, [U], SIMPLE)


async def test_an_ordinary_chat_is_answered_while_a_costly_template_renders(
    trusting: GatewayServer, sim: SimServer
) -> None:
    timeout = trusting.parts.settings.request_template_timeout
    async with httpx.AsyncClient(base_url=trusting.url, timeout=30) as client:
        body = {"model": "tiny", "messages": [U], "max_tokens": 4}
        assert (await client.post("/v1/chat/completions", json={**body, "chat_template": SIMPLE})).status_code == 200
        t0 = time.monotonic()
        costly = asyncio.ensure_future(
            client.post("/v1/chat/completions", json={**body, "chat_template": NESTED_LOOPS})
        )
        sandbox = trusting.parts.models.templates.sandbox
        await eventually(lambda: sandbox.busy > 0 or costly.done())
        t1 = time.monotonic()
        ordinary = await client.post("/v1/chat/completions", json=body)
        ordinary_s = time.monotonic() - t1
        refused = await costly
        costly_s = time.monotonic() - t0
    assert ordinary.status_code == 200, ordinary.text
    assert_refused(refused, "chat_template", f"took longer than {timeout:g} s")
    # The ordinary chat did not wait for the render: it was answered well within the template's timeout.
    assert ordinary_s < timeout / 2 < costly_s
    trusting.wait_ledger_empty()
