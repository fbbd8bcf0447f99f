"""Paths and methods: no spelling of a path reaches the engine unguarded, and nothing outside vLLM's public API
reaches it at all.

The cases run against the gateway in front of the misbehaving upstream, which records every request it gets:
each case sends its own ``x-request-id`` and then looks at what arrived upstream under it. Whatever arrived
must have gone to a canonical path of the allow-list, and a generating path only through the guard.
"""

from __future__ import annotations

import random
import re

import pytest

from testing.hostile_checks import (
    Case,
    RawResponse,
    Target,
    check_answer,
    dumps,
    raw_exchange,
    request_bytes,
    statuses,
    table,
)
from testing.rogue_engine import Rogue

from .conftest import UPSTREAM_KEY

CHAT_BODY = dumps({"model": "tiny", "messages": [{"role": "user", "content": "rogue:ok"}], "max_tokens": 2})
RESPONSES_BODY = dumps({"model": "tiny", "input": "rogue:ok", "max_output_tokens": 2})
COMPLETION_BODY = dumps({"model": "tiny", "prompt": "rogue:ok", "max_tokens": 2})
# What may ever reach the upstream, exactly as spelled here.
ALLOWED_UPSTREAM = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/pooling", "/score", "/v1/score",
    "/rerank", "/v1/rerank", "/v2/rerank", "/classify", "/v1/models", "/tokenize", "/detokenize", "/version",
})
GENERATING = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
GUARDED_OR_REFUSED = statuses(200, 404)
REFUSED = statuses(404)


def chat_path(id: str, target: str, status: frozenset[int] = GUARDED_OR_REFUSED) -> Case:
    return Case(id, CHAT_BODY, target, status=status)


def completion_path(id: str, target: str, status: frozenset[int] = GUARDED_OR_REFUSED) -> Case:
    return Case(id, COMPLETION_BODY, target, status=status)


def outside(id: str, target: str, method: str = "GET") -> Case:
    return Case(id, CHAT_BODY if method == "POST" else None, target, method, status=REFUSED)


BYPASS_FORMS = [
    chat_path("dot segment in v1", "/v1/./chat/completions"),
    chat_path("dot-dot after a made-up segment", "/v1/x/../chat/completions"),
    chat_path("encoded dot segment", "/v1/%2e/chat/completions"),
    chat_path("encoded dot segment upper case", "/v1/%2E/chat/completions"),
    chat_path("dot segment inside chat", "/v1/chat/./completions"),
    completion_path("dot segment before completions", "/v1/./completions"),
    chat_path("repeated dot segments", "/v1/././././chat/completions"),
    chat_path("double slash inside v1", "/v1//chat/completions"),
    chat_path("double slash at the start", "//v1/chat/completions"),
    chat_path("double slash inside chat", "/v1/chat//completions"),
    chat_path("trailing slash", "/v1/chat/completions/"),
    chat_path("trailing dot segment", "/v1/chat/completions/."),
    chat_path("encoded slash inside chat", "/v1/chat%2fcompletions"),
    chat_path("encoded slash upper case", "/v1/chat%2Fcompletions"),
    chat_path("every slash encoded", "/v1%2fchat%2fcompletions"),
    chat_path("encoded dot-dot back into v1", "/v1/%2e%2e/v1/chat/completions"),
    chat_path("mixed dot and encoded dot", "/v1/.%2e/v1/chat/completions"),
    chat_path("dot-dot and an encoded slash", "/v1/x/..%2fchat/completions"),
    chat_path("double-encoded dot", "/v1/%252e/chat/completions"),
    chat_path("double-encoded slash", "/v1/chat%252fcompletions"),
    chat_path("encoded letter", "/v1/%63hat/completions"),
    chat_path("encoded backslash", "/v1/chat%5ccompletions"),
    chat_path("backslash separators", "/v1\\chat\\completions"),
    chat_path("encoded nul after the path", "/v1/chat/completions%00"),
    chat_path("encoded space after the path", "/v1/chat/completions%20"),
    chat_path("semicolon parameter", "/v1/chat/completions;x=1"),
    chat_path("dot-dot back into chat", "/v1/chat/completions/../completions"),
    chat_path("upper-case route", "/V1/CHAT/COMPLETIONS", REFUSED),
    chat_path("dot-dot past completions", "/v1/chat/completions/..", REFUSED),
    chat_path("absolute-form target", "http://127.0.0.1/v1/./chat/completions"),
    Case("responses behind a dot segment", RESPONSES_BODY, "/v1/./responses", status=GUARDED_OR_REFUSED),
    Case("responses behind an encoded dot", RESPONSES_BODY, "/v1/%2e/responses", status=GUARDED_OR_REFUSED),
]

TRAVERSALS = [
    outside("metrics through encoded dot-dot", "/v1/%2e%2e/metrics"),
    outside("metrics through upper-case encoded dot-dot", "/v1/%2E%2E/metrics"),
    outside("metrics through half-encoded dot-dot", "/v1/.%2e/metrics"),
    outside("metrics through an encoded slash", "/v1/..%2fmetrics"),
    outside("metrics two levels up", "/v1/x/%2e%2e/%2e%2e/metrics"),
    outside("openapi through encoded dot-dot", "/v1/%2e%2e/openapi.json"),
    outside("docs through encoded dot-dot", "/v1/%2e%2e/docs"),
    outside("server_info through encoded dot-dot", "/v1/%2e%2e/server_info"),
    outside("invocations through encoded dot-dot", "/v1/%2e%2e/invocations", "POST"),
    outside("scale_elastic_ep through encoded dot-dot", "/v1/%2e%2e/scale_elastic_ep", "POST"),
    outside("reset_prefix_cache through encoded dot-dot", "/v1/%2e%2e/reset_prefix_cache", "POST"),
    outside("sleep through encoded dot-dot", "/v1/%2e%2e/sleep", "POST"),
    outside("collective_rpc through encoded dot-dot", "/v1/%2e%2e/collective_rpc", "POST"),
    outside("generate through encoded dot-dot", "/v1/%2e%2e/inference/v1/generate", "POST"),
    outside("lora loading through encoded dot-dot", "/v1/%2e%2e/v1/load_lora_adapter", "POST"),
    outside("root escape", "/v1/%2e%2e/%2e%2e/%2e%2e/etc/passwd"),
    outside("plain dot-dot above the root", "/../../metrics"),
    outside("invocations", "/invocations", "POST"),
    outside("inference generate", "/inference/v1/generate", "POST"),
    outside("anthropic messages", "/v1/messages", "POST"),
    outside("audio transcriptions", "/v1/audio/transcriptions", "POST"),
    outside("audio translations", "/v1/audio/translations", "POST"),
    outside("scale_elastic_ep", "/scale_elastic_ep", "POST"),
    outside("openapi", "/openapi.json"),
    outside("docs", "/docs"),
    outside("server_info", "/server_info"),
    outside("reset_prefix_cache", "/reset_prefix_cache", "POST"),
    outside("sleep", "/sleep", "POST"),
    outside("lora loading", "/v1/load_lora_adapter", "POST"),
    outside("unknown v1 route", "/v1/unknown"),
    outside("path of 5000 bytes", "/v1/" + "a" * 5000),
]

METHODS = [
    Case("GET on chat", None, "/v1/chat/completions", "GET", status=statuses(405)),
    Case("PUT on chat", CHAT_BODY, "/v1/chat/completions", "PUT", status=statuses(405)),
    Case("PATCH on chat", CHAT_BODY, "/v1/chat/completions", "PATCH", status=statuses(405)),
    Case("DELETE on completions", None, "/v1/completions", "DELETE", status=statuses(405)),
    Case("GET on tokenize", None, "/tokenize", "GET", status=statuses(405)),
    Case("POST on models", CHAT_BODY, "/v1/models", "POST", status=statuses(405)),
    Case("DELETE on models", None, "/v1/models", "DELETE", status=statuses(405)),
    Case("TRACE on models", None, "/v1/models", "TRACE", status=statuses(405)),
    Case("POST on guard status", CHAT_BODY, "/guard/status", "POST", status=statuses(405)),
    Case("GET on guard restart", None, "/guard/restart", "GET", status=statuses(405)),
    Case("OPTIONS on chat", None, "/v1/chat/completions", "OPTIONS", status=statuses(200, 204, 405)),
    Case("unknown method", None, "/v1/models", "FOO", status=statuses(400, 405, 501)),
    Case("method with a dot-segment path", CHAT_BODY, "/v1/./chat/completions", "PUT", status=statuses(404, 405)),
]

ALLOWED = [
    Case("tokenize passes through", dumps({"model": "tiny", "prompt": "rogue:ok"}), "/tokenize", status=statuses(200)),
    Case("detokenize passes through", dumps({"model": "tiny", "tokens": [1, 2], "x": "rogue:ok"}), "/detokenize",
         status=statuses(200)),
    Case("models listing", None, "/v1/models", "GET", status=statuses(200)),
    Case("tokenize behind a dot segment", dumps({"model": "tiny", "prompt": "rogue:ok"}), "/./tokenize",
         status=statuses(200, 404)),
]

_SEGMENTS = ["v1", "chat", "completions", "responses", "tokenize", "metrics", "invocations", ".", "..", "", "x",
             "%2e", "%2E", "%2e%2e", ".%2e", "%2f", "%5c", "%252e", "%00", ";a", "models"]


def _fuzz(count: int, seed: int = 1234) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        path = "/" + "/".join(rng.choices(_SEGMENTS, k=rng.randint(2, 6)))
        # The invariants below, not a status, are what matters for a random path.
        cases.append(chat_path(f"fuzz {i:02d} {path}", path, statuses(200, 400, 404, 405)))
    return cases


CASES = [*BYPASS_FORMS, *TRAVERSALS, *METHODS, *ALLOWED, *_fuzz(40)]


def _request_id(case: Case) -> str:
    return "path-" + re.sub(r"[^A-Za-z0-9]+", "-", case.id)[:100]


@pytest.mark.parametrize("case", table(CASES))
async def test_no_path_reaches_the_engine_unguarded(rogue_gw: Target, rogue: Rogue, case: Case) -> None:
    rid = _request_id(case)
    headers = {"x-request-id": rid, "connection": "close"}
    if case.body is not None:
        headers["content-type"] = "application/json"
    r = await raw_exchange(rogue_gw.url, request_bytes(case.method, case.path, headers, case.body or b""))
    assert r is not None, f"{case.id}: the gateway closed the connection without an answer"
    check_answer(r.status, r.body, case)
    assert_only_canonical_and_guarded(rogue, rid, r)
    rogue_gw.still_well()


def assert_only_canonical_and_guarded(rogue: Rogue, rid: str, r: RawResponse) -> None:
    for seen in rogue.requests_with_id(rid):
        assert seen.target.split("?")[0] in ALLOWED_UPSTREAM, f"reached the upstream at {seen.target!r}"
        if seen.target in GENERATING:
            assert "x-guard-prompt-tokens" in r.headers, f"{seen.target} reached the engine without the guard"
        assert seen.headers.get("authorization") == f"Bearer {UPSTREAM_KEY}"
    if r.status == 200 and r.headers.get("x-guard-prompt-tokens") is None:
        # Served without the guard: only a route that generates nothing may answer that way.
        assert all(s.target not in GENERATING for s in rogue.requests_with_id(rid))

