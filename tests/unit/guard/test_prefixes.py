"""What of a prompt admission may book as shared: vLLM reads its prefix cache unless the request asks for prompt
logprobs (directly, or through echo with logprobs) or carries KV transfer parameters; the model and cache_salt
key the blocks apart."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.guard.endpoints.table import BY_NAME
from gateway.guard.prefixes import prompt_prefix

IDS = (1, 2, 3)


@pytest.mark.parametrize(
    ("route", "body", "shared"),
    [
        ("chat", {"model": "m"}, True),
        ("completions", {"model": "m"}, True),
        ("responses", {"model": "m"}, True),
        ("completions", {"model": "m", "prompt_logprobs": 0}, False),
        ("chat", {"model": "m", "prompt_logprobs": 1}, False),
        ("completions", {"model": "m", "echo": True, "logprobs": 2}, False),
        ("completions", {"model": "m", "echo": True}, True),
        ("completions", {"model": "m", "logprobs": 2}, True),
        ("chat", {"model": "m", "echo": True, "top_logprobs": 2}, False),
        ("chat", {"model": "m", "echo": True, "logprobs": True}, True),
        ("chat", {"model": "m", "kv_transfer_params": {"do_remote_decode": True}}, False),
    ],
)
def test_a_prompt_is_shared_unless_vllm_skips_reading_the_cache_for_it(
    route: str, body: dict[str, Any], shared: bool
) -> None:
    assert (prompt_prefix(BY_NAME[route], body, IDS) is not None) is shared


def test_unknown_ids_share_nothing() -> None:
    assert prompt_prefix(BY_NAME["chat"], {"model": "m"}, None) is None


@pytest.mark.parametrize(
    ("a", "b"),
    [({"model": "m"}, {"model": "lora-a"}), ({"model": "m"}, {"model": "m", "cache_salt": "s"}),
     ({"model": "m", "cache_salt": "s"}, {"model": "m", "cache_salt": "t"})],
)
def test_the_model_and_the_cache_salt_key_prompts_apart(a: dict[str, Any], b: dict[str, Any]) -> None:
    pa, pb = prompt_prefix(BY_NAME["chat"], a, IDS), prompt_prefix(BY_NAME["chat"], b, IDS)
    assert pa is not None and pb is not None and pa.salt != pb.salt and pa.ids == pb.ids
