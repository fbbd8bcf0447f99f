"""What admission may share of a request's prompt: its token ids, salted with what else keys vLLM's prefix cache.

vLLM reads the prefix cache for a request unless it asks for prompt logprobs (``SamplingParams``:
``skip_reading_prefix_cache`` defaults to ``prompt_logprobs is not None``; the OpenAI protocols set
``prompt_logprobs`` from ``echo`` with ``logprobs`` / ``top_logprobs`` too), or it carries KV transfer parameters
(disaggregated prefill, refused by ``fields``): such a request computes its whole prompt into blocks of its
own, and is booked whole. So is a prompt the engine truncates (``truncate_prompt_tokens``): the tokens it keeps
need not start with the prefix the gateway counted.
Its block keys carry the LoRA adapter (served under its own model name) and a ``cache_salt``
(``vllm/v1/core/kv_cache_utils.py: generate_block_hash_extra_keys``), so both go into the salt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.admission.prefix import PromptPrefix
from gateway.guard.endpoints.base import Endpoint, Validated


def prompt_prefix(
    endpoint: Endpoint[Validated], body: dict[str, Any], ids: Sequence[int] | None
) -> PromptPrefix | None:
    """The prefix admission may book as shared, or None when the engine will not share this prompt's blocks."""
    if ids is None or not reads_prefix_cache(endpoint, body):
        return None
    model = body.get("model")
    salt = body.get("cache_salt")
    return PromptPrefix(ids, f"{model if isinstance(model, str) else ''}\0{salt if isinstance(salt, str) else ''}")


def reads_prefix_cache(endpoint: Endpoint[Validated], body: dict[str, Any]) -> bool:
    # A truncated prompt keeps tokens that need not start with the prefix the gateway counted from.
    if any(body.get(k) is not None for k in ("prompt_logprobs", "truncate_prompt_tokens")) or body.get(
        "kv_transfer_params"
    ):
        return False
    echo_field = endpoint.echo_logprobs  # the field that turns on prompt logprobs when ``echo`` is set
    return not (echo_field is not None and body.get("echo") and body.get(echo_field) is not None)
