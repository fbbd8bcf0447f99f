"""Chat templates sent in requests: refused unless trusted (as vLLM does), and when trusted, rendered in a
sandbox bounded in time, output and memory, so that one request never holds the gateway for others."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from testing.gateway_thread import run_gateway
from testing.hostile_checks import Case, Target, check_answer, dumps, statuses, table
from testing.vllm_sim import SimServer

from .conftest import NORMAL_CHAT, UPSTREAM_KEY, hostile_settings

CHAT = "/v1/chat/completions"
PLAIN = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
LOOPS = ("{% for a in range(600) %}{% for b in range(600) %}{% for c in range(600) %}"
         "{% endfor %}{% endfor %}{% endfor %}")
HUGE = "{% for i in range(10000000) %}xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx{% endfor %}"
ESCAPE = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
RAISES = "{{ raise_exception('refused by the template') }}"
SYNTAX = "{% for %}"
RECURSES = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"
MEMORY = "{% set x = 'a' * 2000000000 %}{{ x | length }}"
TEMPLATE_TIMEOUT = 0.5


def chat(**fields: Any) -> bytes:
    return dumps({**NORMAL_CHAT, **fields})


UNTRUSTED = [
    Case("a request template is refused", chat(chat_template=PLAIN), param="chat_template"),
    Case("a template in chat_template_kwargs is refused", chat(chat_template_kwargs={"chat_template": PLAIN})),
    Case("an expensive template is refused before rendering", chat(chat_template=LOOPS), param="chat_template"),
    Case("a huge template output is refused before rendering", chat(chat_template=HUGE), param="chat_template"),
    Case("a template that is not a string is refused", chat(chat_template=5)),
    Case("an empty template is refused", chat(chat_template=""), param="chat_template"),
    Case("a null template is no template", chat(chat_template=None), status=statuses(200)),
    Case("other template kwargs are fine", chat(chat_template_kwargs={"enable_thinking": False}),
         status=statuses(200)),
]


@pytest.mark.parametrize("case", table(UNTRUSTED))
def test_request_templates_are_refused_unless_trusted(gw: Target, case: Case) -> None:
    t0 = time.monotonic()
    r = gw.send(case)
    check_answer(r.status_code, r.content, case)
    assert time.monotonic() - t0 < 2.0, "refusing must not render first"
    gw.still_well()


def _trust_settings_exist() -> bool:
    from gateway.config import Settings

    names = ("trust_request_chat_template", "request_template_timeout", "request_template_max_chars")
    return all(n in Settings.model_fields for n in names)


@pytest.fixture(scope="module")
def trusting_gw(sim: SimServer, tokenizer_dir: Path) -> Iterator[Target]:
    if not _trust_settings_exist():
        pytest.skip("gateway.config.Settings has no trust_request_chat_template / request_template_* yet")
    settings = hostile_settings(
        tokenizer_dir, upstream=sim.url, upstream_api_key=UPSTREAM_KEY, trust_request_chat_template=True,
        request_template_timeout=TEMPLATE_TIMEOUT, request_template_max_chars=100_000,
    )
    with run_gateway(settings) as server:
        target = Target(server, None, dumps(NORMAL_CHAT))
        yield target
        target.close()


TRUSTED = [
    Case("a plain template renders and is counted", chat(chat_template=PLAIN), status=statuses(200)),
    Case("three nested loops run out of time", chat(chat_template=LOOPS), param="chat_template"),
    Case("millions of characters of output are cut off", chat(chat_template=HUGE), param="chat_template"),
    Case("a sandbox escape is refused", chat(chat_template=ESCAPE), param="chat_template"),
    Case("a template that raises is refused", chat(chat_template=RAISES), param="chat_template"),
    Case("a template with a syntax error is refused", chat(chat_template=SYNTAX), param="chat_template"),
    Case("a template that recurses forever is refused", chat(chat_template=RECURSES), param="chat_template"),
    Case("a template that allocates gigabytes is refused", chat(chat_template=MEMORY), param="chat_template"),
    Case("an expensive template in chat_template_kwargs runs out of time",
         chat(chat_template_kwargs={"chat_template": LOOPS})),
]
# The first render starts a worker process (it imports transformers): seconds on a busy machine.
COLD_START = 30.0


@pytest.mark.parametrize("case", table(TRUSTED))
def test_a_trusted_template_is_bounded(trusting_gw: Target, case: Case) -> None:
    trusting_gw.client.post(CHAT, content=chat(chat_template=PLAIN), headers={"content-type": "application/json"},
                            timeout=COLD_START)  # warm: the bound below is about the render, not the start
    t0 = time.monotonic()
    r = trusting_gw.send(case)
    elapsed = time.monotonic() - t0
    check_answer(r.status_code, r.content, case)
    if r.status_code == 200:
        assert int(r.headers["x-guard-prompt-tokens"]) > 0
    # Within the render's time bound, the kill that backs it, and the gateway's own work.
    assert elapsed < TEMPLATE_TIMEOUT * 1.5 + 0.25 + 2.0, elapsed
    trusting_gw.still_well()


def test_an_ordinary_chat_is_not_held_by_a_costly_template(trusting_gw: Target) -> None:
    trusting_gw.client.post(CHAT, content=chat(chat_template=PLAIN), headers={"content-type": "application/json"},
                            timeout=COLD_START)
    results: list[int] = []

    def costly() -> None:
        with httpx.Client(base_url=trusting_gw.url, timeout=10) as c:
            results.append(c.post(CHAT, content=chat(chat_template=LOOPS),
                                  headers={"content-type": "application/json"}).status_code)

    threads = [threading.Thread(target=costly) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    r = trusting_gw.client.post(CHAT, content=json.dumps(NORMAL_CHAT), headers={"content-type": "application/json"})
    waited = time.monotonic() - t0
    for t in threads:
        t.join(15)
    assert r.status_code == 200
    assert waited < 1.0, f"an ordinary chat waited {waited:.2f} s behind request templates"
    assert results == [400, 400, 400]
    trusting_gw.still_well()
