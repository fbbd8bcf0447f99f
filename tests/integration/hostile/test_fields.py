"""Fields that would make the engine run another prompt than the one counted, a longer output than the one
booked, or hold blocks the gateway cannot see: each is refused with a 400 naming it, before anything is booked,
on every guarded route that has it; the values vLLM treats as absent pass. The gateway stays well after each."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from testing.hostile_checks import Case, Target, check_answer, dumps, error_of, statuses, table

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
# 1,900 ids where the message says "hi": what vLLM 0.32 runs instead of the rendered messages.
REPLACED = {"prompt_token_ids": [5 + i % 200 for i in range(1900)]}
BASES: dict[str, dict[str, Any]] = {
    CHAT: {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    COMPLETIONS: {"model": "tiny", "prompt": "hi", "max_tokens": 2},
    RESPONSES: {"model": "tiny", "input": "hi", "max_output_tokens": 2},
    "/v1/embeddings": {"model": "tiny", "input": "hi"},
    "/pooling": {"model": "tiny", "input": "hi"},
    "/classify": {"model": "tiny", "input": "hi"},
    "/score": {"model": "tiny", "text_1": "a", "text_2": ["b", "c"]},
    "/v1/rerank": {"model": "tiny", "query": "a", "documents": ["b", "c"]},
}
GENERATE = (CHAT, COMPLETIONS, RESPONSES)
POOLING = ("/v1/embeddings", "/pooling", "/classify", "/score", "/v1/rerank")
# field -> (a refused value, the routes it is refused on)
REFUSED: dict[str, tuple[Any, tuple[str, ...]]] = {
    "kv_transfer_params": (REPLACED, GENERATE),
    "ec_transfer_params": ({"do_remote_encode": True}, GENERATE),
    "vllm_xargs": ({"kv_transfer_params": REPLACED}, GENERATE),
    "priority": (-100, GENERATE + POOLING),
    "mm_processor_kwargs": ({"max_pixels": 10**9}, (CHAT, RESPONSES, *POOLING)),
    "media_io_kwargs": ({"video": {"num_frames": 10**6}}, (CHAT, RESPONSES, "/v1/embeddings")),
    "min_tokens": (500, (CHAT, COMPLETIONS)),
    "use_beam_search": (True, (CHAT, COMPLETIONS)),
    "prompt_embeds": ("AAAAAAAA", (COMPLETIONS,)),
    "suffix": ("    return x\n" * 200, (COMPLETIONS,)),
    "previous_input_messages": ([{"role": "user", "content": "x"}], (RESPONSES,)),
    "prompt": ({"id": "pmpt_1"}, (RESPONSES,)),
    "instruction": ("Judge relevance. " * 100, ("/score", "/v1/rerank")),
    "chat_template_kwargs": ({"instruction": "x" * 1000}, ("/score", "/v1/rerank")),
}
ALLOWED = [
    (CHAT, "kv_transfer_params", {}),
    (CHAT, "priority", 0),
    (CHAT, "use_beam_search", False),
    (CHAT, "min_tokens", 1),
    (COMPLETIONS, "vllm_xargs", {"my_processor_arg": 1}),
    (RESPONSES, "kv_transfer_params", None),
]


def refused_cases() -> list[Case]:
    return [
        Case(f"{field} on {path}", dumps({**BASES[path], field: value}), path, code="unsupported_field", param=field)
        for field, (value, paths) in REFUSED.items()
        for path in paths
    ]


def allowed_cases() -> list[Case]:
    return [Case(f"{field}={value!r} on {path}", dumps({**BASES[path], field: value}), path, status=statuses(200))
            for path, field, value in ALLOWED]  # fmt: skip


@pytest.mark.parametrize("case", table(refused_cases()))
def test_a_field_that_changes_what_the_engine_runs_is_refused_by_name(gw: Target, case: Case) -> None:
    r = gw.send(case)

    err = check_answer(r.status_code, r.content, case)
    assert err is not None and err["type"] == "invalid_request_error"
    assert f"'{case.param}' is not supported through this gateway" in err["message"]
    gw.still_well()


@pytest.mark.parametrize("case", table(allowed_cases()))
def test_values_the_engine_treats_as_absent_are_served(gw: Target, case: Case) -> None:
    r = gw.send(case)

    check_answer(r.status_code, r.content, case)
    gw.ledger_at_zero()


@pytest.mark.parametrize("path", [CHAT, RESPONSES])
def test_six_prompt_replacing_requests_at_once_book_nothing(gw: Target, path: str) -> None:
    body = dumps({**BASES[path], "kv_transfer_params": REPLACED})
    headers = {"content-type": "application/json", **gw.auth()}

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: gw.client.post(path, content=body, headers=headers), range(6)))

    assert [r.status_code for r in answers] == [400] * 6
    assert {error_of(r.content)["param"] for r in answers} == {"kv_transfer_params"}
    assert "prompt_token_ids" in error_of(answers[0].content)["message"]
    gw.ledger_at_zero()
