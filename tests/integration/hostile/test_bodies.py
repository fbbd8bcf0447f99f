"""Malformed and hostile request bodies: each is refused with a 400 (413 past the size limit, 404 for an unknown
model) in OpenAI's shape, or served exactly, and the gateway stays well with its ledger at zero."""

from __future__ import annotations

import json
from typing import Any

import pytest

from testing.hostile_checks import Case, Target, check_answer, dumps, statuses, table

from .conftest import BODY_LIMIT, MAX_MODEL_LEN

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
OK = statuses(200)
BIG = 2**64 + 1  # needs more than 64 bits: read and written by the exact (slow) path


def chat(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    body.update(fields)
    return {k: v for k, v in body.items() if v is not DROP}


def completion(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    body.update(fields)
    return {k: v for k, v in body.items() if v is not DROP}


DROP: Any = object()


def nested(depth: int) -> bytes:
    """Objects nested ``depth`` deep, written directly (encoders recurse, and stop near 1,000 levels)."""
    return b'{"k": ' * depth + b'"leaf"' + b"}" * depth


def with_temperature(raw: bytes, body: dict[str, Any]) -> bytes:
    """``body`` with a ``temperature`` written as ``raw`` (a literal JSON itself does not allow)."""
    return dumps(body).replace(b'"max_tokens": 2', b'"temperature": ' + raw + b', "max_tokens": 2')


def with_raw(body: dict[str, Any], name: str, raw: bytes) -> bytes:
    """``body`` with one more field whose value is the raw JSON ``raw``."""
    return dumps(body)[:-1] + b', "' + name.encode() + b'": ' + raw + b"}"


def bad(id: str, body: bytes | dict[str, Any], path: str = CHAT, *, param: str | None = None,
        code: str | None = None, status: frozenset[int] = statuses(400)) -> Case:
    raw = body if isinstance(body, bytes) else dumps(body)
    return Case(id, raw, path, status=status, param=param, code=code)


def good(id: str, body: bytes | dict[str, Any], path: str = CHAT, headers: tuple[tuple[str, str], ...] = ()) -> Case:
    raw = body if isinstance(body, bytes) else dumps(body)
    return Case(id, raw, path, headers=headers, status=OK)


MALFORMED = [
    bad("empty body", b""),
    bad("whitespace only", b"  \n\t "),
    bad("truncated object", b'{"model": "tiny", "messages": ['),
    bad("trailing comma", b'{"model": "tiny",}'),
    bad("not json at all", b"model=tiny&messages=hi"),
    bad("single quotes", b"{'model': 'tiny'}"),
    bad("comment inside", b'{"model": "tiny" // comment\n}'),
    bad("two objects", dumps(chat()) + b" {}"),
    bad("NaN literal", with_temperature(b"NaN", chat())),
    bad("Infinity literal", with_temperature(b"Infinity", chat())),
    bad("number beyond double", with_temperature(b"1e400", chat())),
    bad("top-level array", b"[1, 2, 3]"),
    bad("top-level string", b'"hello"'),
    bad("top-level number", b"42"),
    bad("top-level null", b"null"),
    bad("byte order mark", b"\xef\xbb\xbf" + dumps(chat())),
    bad("utf-16 body", json.dumps(chat()).encode("utf-16")),
    bad("invalid utf-8 in a string", dumps(chat()).replace(b'"hi"', b'"h\xff\xfei"')),
    bad("overlong utf-8 encoding", dumps(chat()).replace(b'"hi"', b'"h\xc0\xafi"')),
    bad("raw control character in a string", dumps(chat()).replace(b'"hi"', b'"h\x01i"')),
    bad("lone surrogate escape", dumps(chat()).replace(b'"hi"', b'"\\ud800"')),
    # The same hostile values beside an integer past 64 bits, which takes the exact (standard library) reader.
    bad("lone surrogate beside a big integer", dumps(chat(seed=BIG)).replace(b'"hi"', b'"\\ud800"')),
    bad("NaN beside a big integer", with_temperature(b"NaN", chat(seed=BIG))),
    bad("1e400 beside a big integer", with_temperature(b"1e400", chat(seed=BIG))),
    bad("deep nesting beside a big integer", b'{"seed": %d, "x": ' % BIG + b"[" * 30_000 + b"]" * 30_000 + b"}"),
    good("escaped nul character in content", dumps(chat()).replace(b'"hi"', b'"h\\u0000i"')),
]

CHAT_TYPES = [
    bad("model a number", chat(model=5), param="model"),
    bad("model empty", chat(model=""), param="model"),
    bad("model a list", chat(model=["tiny"]), param="model"),
    bad("model an object", chat(model={"id": "tiny"}), param="model"),
    bad("model a boolean", chat(model=True), param="model"),
    bad("messages missing", chat(messages=DROP), param="messages"),
    bad("messages null", chat(messages=None), param="messages"),
    bad("messages a string", chat(messages="hi"), param="messages"),
    bad("messages an object", chat(messages={"role": "user", "content": "hi"}), param="messages"),
    bad("messages empty", chat(messages=[]), param="messages"),
    bad("message a number", chat(messages=[1])),
    bad("message null", chat(messages=[None])),
    bad("message a list", chat(messages=[[]])),
    bad("role missing", chat(messages=[{"content": "hi"}])),
    bad("role a number", chat(messages=[{"role": 5, "content": "hi"}])),
    bad("role empty", chat(messages=[{"role": "", "content": "hi"}])),
    bad("role null", chat(messages=[{"role": None, "content": "hi"}])),
    bad("content a number", chat(messages=[{"role": "user", "content": 5}])),
    bad("content an object", chat(messages=[{"role": "user", "content": {"text": "hi"}}])),
    bad("content a boolean", chat(messages=[{"role": "user", "content": True}])),
    bad("tools an object", chat(tools={"type": "function"}), param="tools"),
    bad("tools a string", chat(tools="none"), param="tools"),
    bad("chat_template_kwargs a list", chat(chat_template_kwargs=[]), param="chat_template_kwargs"),
    bad("chat_template_kwargs a string", chat(chat_template_kwargs="x"), param="chat_template_kwargs"),
    bad("add_generation_prompt a string", chat(add_generation_prompt="yes"), param="add_generation_prompt"),
    bad("add_generation_prompt a number", chat(add_generation_prompt=1), param="add_generation_prompt"),
    bad("continue_final_message a string", chat(continue_final_message="no"), param="continue_final_message"),
    bad("max_tokens a string", chat(max_tokens="5"), param="max_tokens"),
    bad("max_tokens a float", chat(max_tokens=5.5), param="max_tokens"),
    bad("max_tokens a boolean", chat(max_tokens=True), param="max_tokens"),
    bad("max_tokens a list", chat(max_tokens=[5]), param="max_tokens"),
    bad("max_tokens zero", chat(max_tokens=0), param="max_tokens"),
    bad("max_tokens negative", chat(max_tokens=-1), param="max_tokens"),
    bad("max_tokens most negative int64", chat(max_tokens=-(2**63)), param="max_tokens"),
    bad("max_tokens negative beyond 64 bits", chat(max_tokens=-BIG), param="max_tokens"),
    bad("max_completion_tokens a string", chat(max_completion_tokens="5"), param="max_completion_tokens"),
    bad("max_completion_tokens zero", chat(max_completion_tokens=0), param="max_completion_tokens"),
    bad("max_completion_tokens negative", chat(max_completion_tokens=-5), param="max_completion_tokens"),
    bad("n zero", chat(n=0), param="n"),
    bad("n negative", chat(n=-1), param="n"),
    bad("n a string", chat(n="2"), param="n"),
    bad("n a float", chat(n=1.5), param="n"),
    bad("n above 128", chat(n=129), param="n"),
    bad("n beyond 64 bits", chat(n=BIG), param="n"),
    bad("stream a string", chat(stream="true"), param="stream"),
    bad("stream a number", chat(stream=1), param="stream"),
    bad("stream_options a string", chat(stream=True, stream_options="x"), param="stream_options"),
    bad("stream_options without stream", chat(stream_options={"include_usage": True}), param="stream_options"),
]

COMPLETION_TYPES = [
    bad("prompt missing", completion(prompt=DROP), COMPLETIONS, param="prompt"),
    bad("prompt null", completion(prompt=None), COMPLETIONS, param="prompt"),
    bad("prompt a number", completion(prompt=5), COMPLETIONS, param="prompt"),
    bad("prompt an empty list", completion(prompt=[]), COMPLETIONS, param="prompt"),
    bad("prompt an empty id list", completion(prompt=[[]]), COMPLETIONS, param="prompt"),
    bad("prompt ids and text mixed", completion(prompt=[1, "a"]), COMPLETIONS, param="prompt"),
    bad("prompt an object", completion(prompt={"text": "hi"}), COMPLETIONS, param="prompt"),
    bad("prompt id lists with an empty one", completion(prompt=[[1], []]), COMPLETIONS, param="prompt"),
    bad("prompt a boolean", completion(prompt=True), COMPLETIONS, param="prompt"),
    bad("prompt ids holding booleans", completion(prompt=[True, False]), COMPLETIONS, param="prompt"),
    bad("suffix a number", completion(suffix=5), COMPLETIONS, param="suffix"),
    bad("best_of zero", completion(best_of=0), COMPLETIONS, param="best_of"),
    bad("best_of a string", completion(best_of="2"), COMPLETIONS, param="best_of"),
    bad("best_of below n", completion(n=3, best_of=2), COMPLETIONS, param="best_of"),
    bad("completion max_tokens negative", completion(max_tokens=-1), COMPLETIONS, param="max_tokens"),
    bad("completion max_tokens zero", completion(max_tokens=0), COMPLETIONS, param="max_tokens"),
    bad("completion n zero", completion(n=0), COMPLETIONS, param="n"),
]

# The Responses API and the pooling routes are guarded too: the fields the gateway reads are checked.
OTHER_ROUTES = [
    bad("responses input a number", {"model": "tiny", "input": 5}, RESPONSES),
    bad("responses input missing", {"model": "tiny"}, RESPONSES),
    bad("responses input null", {"model": "tiny", "input": None}, RESPONSES),
    bad("responses instructions a number", {"model": "tiny", "input": "hi", "instructions": 5}, RESPONSES),
    bad("responses max_output_tokens zero", {"model": "tiny", "input": "hi", "max_output_tokens": 0}, RESPONSES),
    bad("responses max_output_tokens negative", {"model": "tiny", "input": "hi", "max_output_tokens": -1},
        RESPONSES),
    bad("responses max_output_tokens a string", {"model": "tiny", "input": "hi", "max_output_tokens": "5"},
        RESPONSES),
    bad("responses previous_response_id", {"model": "tiny", "input": "hi", "previous_response_id": "resp_1"},
        RESPONSES),
    bad("responses conversation", {"model": "tiny", "input": "hi", "conversation": "conv_1"}, RESPONSES),
    bad("responses background", {"model": "tiny", "input": "hi", "background": True}, RESPONSES),
    bad("responses body an array", b"[]", RESPONSES),
    bad("score text_1 a number", {"model": "tiny", "text_1": 5, "text_2": "b"}, "/score"),
    bad("rerank documents a string", {"model": "tiny", "query": "q", "documents": 5}, "/v1/rerank"),
    bad("pooling input a boolean", {"model": "tiny", "input": True}, "/pooling"),
    bad("embeddings input a number", {"model": "tiny", "input": 5}, "/v1/embeddings"),
    bad("embeddings input missing", {"model": "tiny"}, "/v1/embeddings"),
    bad("embeddings input an object", {"model": "tiny", "input": {"text": "hi"}}, "/v1/embeddings"),
    bad("embeddings body not json", b"{", "/v1/embeddings"),
]

HUGE_NUMBERS = [
    good("max_tokens 10^30 is clamped", chat(max_tokens=10**30)),
    good("max_tokens 2^63 is clamped", chat(max_tokens=2**63)),
    good("max_tokens beyond 64 bits is clamped", chat(max_tokens=BIG)),
    good("max_completion_tokens 10^30 is clamped", chat(max_tokens=DROP, max_completion_tokens=10**30)),
    good("completion max_tokens 10^30 is clamped", completion(max_tokens=10**30), COMPLETIONS),
    good("a 20-digit number inside a string", chat(user="12345678901234567890123")),
    # The engine judges token ids; the gateway only must not fail on one that big.
    bad("token id beyond 64 bits", completion(prompt=[1, BIG]), COMPLETIONS, status=statuses(200, 400)),
]

DEPTH = [
    good("pass-through field nested 50 deep", with_raw(chat(), "metadata", nested(50))),
    bad("pass-through field nested 300 deep", with_raw(chat(), "metadata", nested(300))),
    bad("pass-through field nested 1000 deep", with_raw(chat(), "metadata", nested(1000))),
    bad("pass-through list nested 30000 deep", with_raw(chat(), "x", b"[" * 30_000 + b"]" * 30_000)),
    bad("content parts nested 300 deep", with_raw(chat(messages=DROP), "messages",
                                                  b'[{"role": "user", "content": [' + nested(300) + b"]}]")),
    bad("completion pass-through nested 300 deep", with_raw(completion(), "logit_bias", nested(300)), COMPLETIONS),
]


def _at_limit(content_bytes: int) -> bytes:
    body = dumps(chat(messages=[{"role": "user", "content": "x"}]))
    filler = "ab " * ((content_bytes - len(body)) // 3)
    return dumps(chat(messages=[{"role": "user", "content": filler}]))


SIZES = [
    bad("body one byte over the limit", b" " * (BODY_LIMIT - len(dumps(chat()))) + dumps(chat()) + b" ",
        status=statuses(413), code=None),
    bad("body of one megabyte", _at_limit(1024 * 1024), status=statuses(413)),
    bad("prompt near the body limit is too long", _at_limit(BODY_LIMIT - 64), code="context_length_exceeded"),
    Case("prompt near the body limit is truncated", _at_limit(BODY_LIMIT - 64),
         headers=(("x-guard-on-overflow", "truncate"),), status=OK),
    bad("many small messages", chat(messages=[{"role": "user", "content": "x"}] * 1500),
        code="context_length_exceeded"),
    bad("model name of 60 KB", chat(model="m" * 60_000), status=statuses(404), code="model_not_found"),
    good("four thousand unknown fields pass through", {**chat(), **{f"f{i}": i for i in range(4000)}}),
]

DUPLICATES = [
    good("duplicate messages, the last valid", b'{"model": "tiny", "max_tokens": 2, "messages": "bad", '
         b'"messages": [{"role": "user", "content": "hi"}]}'),
    bad("duplicate messages, the last invalid", b'{"model": "tiny", "max_tokens": 2, '
        b'"messages": [{"role": "user", "content": "hi"}], "messages": "bad"}', param="messages"),
    bad("duplicate max_tokens, the last zero", dumps(chat())[:-1] + b', "max_tokens": 0}', param="max_tokens"),
    bad("duplicate model, the last unknown", dumps(chat())[:-1] + b', "model": "other"}', status=statuses(404),
        code="model_not_found"),
]

CASES = [*MALFORMED, *CHAT_TYPES, *COMPLETION_TYPES, *OTHER_ROUTES, *HUGE_NUMBERS, *DEPTH, *SIZES, *DUPLICATES]


@pytest.mark.parametrize("case", table(CASES))
def test_a_hostile_body_is_answered_in_openai_shape_and_leaves_the_gateway_well(gw: Target, case: Case) -> None:
    r = gw.send(case)
    check_answer(r.status_code, r.content, case)
    if r.status_code == 200 and case.path == CHAT:
        assert 1 <= int(r.headers["x-guard-max-tokens"]) <= MAX_MODEL_LEN
        assert r.json()["choices"]
    gw.still_well()
