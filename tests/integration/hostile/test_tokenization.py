"""/tokenize and /detokenize are bounded like the guarded routes: a prompt past the context is a 400 before any
tokenizer of the engine's runs (the gateway answers /tokenize itself when it has the tokenizer), ids past it never
reach the engine, and an engine answer past --max-answer-bytes is not read whole. Before, a 7.8 MB /tokenize
held vLLM's API server ~9 s a call (the gateway then called the engine hung) and its 19.5 MB answer was read
whole."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from testing.bad_upstream import BadUpstream, chunked, full, run_bad_upstream
from testing.gateway_thread import run_gateway
from testing.hostile_checks import Case, Target, check_answer, dumps, statuses, table
from testing.vllm_sim import SimServer

from .conftest import BODY_LIMIT, MAX_MODEL_LEN, UPSTREAM_KEY, hostile_settings

# Far more tokens than the context holds, well within the body limit.
LONG_TEXT = "hello world " * (MAX_MODEL_LEN * 2)
USER = [{"role": "user", "content": "hi"}]


def tokenize(body: Any, **case: Any) -> Case:
    return Case(body=dumps(body), path="/tokenize", **case)


def detokenize(body: Any, **case: Any) -> Case:
    return Case(body=dumps(body), path="/detokenize", **case)


CASES = [
    tokenize({"model": "tiny", "prompt": LONG_TEXT}, id="tokenize a prompt past the context",
             code="context_length_exceeded", param="prompt"),
    tokenize({"model": "tiny", "messages": [{"role": "user", "content": LONG_TEXT}]},
             id="tokenize messages past the context", code="context_length_exceeded", param="messages"),
    tokenize({"model": "tiny", "prompt": "x" * (BODY_LIMIT + 1)}, id="tokenize a body past the body limit",
             status=statuses(413), code="request_too_large"),
    tokenize({"model": "tiny", "prompt": [1, 2, 3]}, id="tokenize prompt ids (vLLM takes a string)", param="prompt"),
    tokenize({"model": "tiny"}, id="tokenize with neither prompt nor messages", param="prompt"),
    tokenize({"model": "tiny", "prompt": "hi", "messages": USER}, id="tokenize with both prompt and messages",
             param="messages"),
    tokenize({"model": "nope", "prompt": "hi"}, id="tokenize an unknown model", status=statuses(404),
             code="model_not_found"),
    tokenize({"model": 7, "prompt": "hi"}, id="tokenize a model that is not a string", param="model"),
    tokenize({"model": "tiny", "messages": USER, "continue_final_message": True, "add_generation_prompt": True},
             id="tokenize continuing and prompting at once", param="continue_final_message"),
    tokenize({"model": "tiny", "prompt": "hi", "return_token_strs": "yes"}, id="tokenize token strs not a boolean",
             param="return_token_strs"),
    tokenize({"model": "tiny", "messages": USER, "chat_template": "{{ 7 * 7 }}"},
             id="tokenize with its own chat template", param="chat_template"),
    tokenize({"model": "tiny", "messages": "hi"}, id="tokenize messages that are not a list", param="messages"),
    Case("tokenize a body that is not JSON", b"{not json", "/tokenize"),
    Case("tokenize a JSON array", b"[1, 2]", "/tokenize"),
    detokenize({"model": "tiny", "tokens": list(range(MAX_MODEL_LEN + 1))}, id="detokenize ids past the context",
               code="context_length_exceeded", param="tokens"),
    detokenize({"model": "tiny", "tokens": [1] * (BODY_LIMIT // 4)}, id="detokenize past the context, compact",
               code="context_length_exceeded", param="tokens"),
    detokenize({"model": "tiny", "tokens": "1 2 3"}, id="detokenize tokens that are not a list", param="tokens"),
    detokenize({"model": "tiny", "tokens": [1, -2]}, id="detokenize a negative id", param="tokens"),
    detokenize({"model": "tiny", "tokens": [1, 2**64]}, id="detokenize an id past 64 bits", param="tokens"),
    detokenize({"model": "tiny", "tokens": [1, True]}, id="detokenize a boolean id", param="tokens"),
    tokenize({"model": "tiny", "prompt": "hello"}, id="tokenize within the limits", status=statuses(200)),
    tokenize({"model": "tiny", "messages": USER, "return_token_strs": True}, id="tokenize a chat with token strs",
             status=statuses(200)),
    detokenize({"model": "tiny", "tokens": [1, 2, 3]}, id="detokenize within the limits", status=statuses(200)),
]


@pytest.mark.parametrize("case", table(CASES))
def test_tokenization_is_bounded_like_the_guarded_routes(gw: Target, case: Case) -> None:
    r = gw.send(case)
    check_answer(r.status_code, r.content, case)
    if r.status_code == 200 and case.path == "/tokenize":
        answer = r.json()
        assert set(answer) == {"count", "max_model_len", "tokens", "token_strs"}, answer
        assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == MAX_MODEL_LEN
        assert (answer["token_strs"] is not None) == ("return_token_strs" in json.loads(case.body or b"{}"))
    gw.ledger_at_zero()


@pytest.fixture(scope="module")
def remote_gw(sim: SimServer, tokenizer_dir: Path) -> Iterator[Target]:
    """A gateway without a tokenizer of its own: it counts with the engine's /tokenize."""
    settings = hostile_settings(tokenizer_dir, upstream=sim.url, upstream_api_key=UPSTREAM_KEY)
    settings = settings.model_copy(update={"tokenizer": str(tokenizer_dir / "no-such-tokenizer")})
    with run_gateway(settings) as server:
        target = Target(server, None, dumps({"model": "tiny", "messages": USER, "max_tokens": 2}))
        yield target
        target.close()


@pytest.mark.parametrize("case", table([
    tokenize({"model": "tiny", "prompt": LONG_TEXT}, id="the engine's count past the context",
             code="context_length_exceeded", param="prompt"),
    tokenize({"model": "tiny", "prompt": "hello"}, id="the engine's count within it", status=statuses(200)),
]))
def test_without_a_tokenizer_the_engines_count_is_held_to_the_same_limit(remote_gw: Target, case: Case) -> None:
    r = remote_gw.send(case)
    check_answer(r.status_code, r.content, case)
    remote_gw.still_well()


@pytest.fixture(scope="module")
def bad() -> Iterator[BadUpstream]:
    with run_bad_upstream() as upstream:
        yield upstream


ANSWER_LIMIT = 64 * 1024
BIG = dumps({"prompt": "x" * ANSWER_LIMIT})


@pytest.mark.parametrize(
    ("case", "answer"),
    [
        pytest.param("declared past the limit", full(200, BIG), id="content-length past the limit"),
        pytest.param("chunked past the limit", chunked([BIG[:40_000], BIG[40_000:]], ctype="application/json"),
                     id="chunked past the limit"),
        pytest.param("an error past the limit", full(500, BIG), id="an error answer past the limit"),
    ],
)
def test_an_engine_answer_past_the_bound_is_not_read_whole(
    bad: BadUpstream, tokenizer_dir: Path, case: str, answer: Any
) -> None:
    settings = hostile_settings(tokenizer_dir, upstream=bad.url, max_answer_bytes=ANSWER_LIMIT)
    bad.answer = answer
    with run_gateway(settings) as server:
        r = httpx.post(server.url + "/detokenize", json={"model": "tiny", "tokens": [1, 2]}, timeout=10)
    err = check_answer(r.status_code, r.content, Case(case, status=statuses(502), code="bad_upstream_response"))
    assert err is not None and "--max-answer-bytes" in err["message"]


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"model": "tiny", "prompt": "Hello, world!"}, id="a prompt"),
        pytest.param({"model": "tiny", "prompt": "Hello", "add_special_tokens": False}, id="without special tokens"),
        pytest.param({"prompt": "no model named"}, id="no model named"),
        pytest.param({"model": "tiny", "messages": [{"role": "system", "content": "Be brief."}, *USER]}, id="a chat"),
        pytest.param({"model": "tiny", "messages": USER, "add_generation_prompt": False}, id="a chat, no prompt"),
    ],
)
def test_the_gateways_own_tokenize_answers_what_the_engine_would(gw: Target, sim: SimServer, body: Any) -> None:
    mine = gw.client.post("/tokenize", json=body, headers=gw.auth())
    engine = httpx.post(sim.url + "/tokenize", json=body, headers={"authorization": f"Bearer {UPSTREAM_KEY}"})
    assert mine.status_code == engine.status_code == 200, (mine.text, engine.text)
    assert mine.json() == engine.json()
