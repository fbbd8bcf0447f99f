"""POST /v1/responses against the real vLLM: counted exactly as vLLM counts it, streamed, clamped, refused where
the gateway cannot count; and what a guarded pooling route does in front of an engine that serves none."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from testing.servers import API_KEY, GATEWAY_MAX_MODEL_LEN, ServerProcess
from tests.integration.test_responses import CASES

pytestmark = pytest.mark.e2e

AUTH = {"authorization": f"Bearer {API_KEY}"}


def ledger(gateway: ServerProcess) -> tuple[int, int, int]:
    status = httpx.get(gateway.url + "/guard/status", headers=AUTH, timeout=30).json()
    return status["committed_blocks"], status["in_flight"], status["queued"]


@pytest.mark.parametrize(("case", "fields"), CASES, ids=[c for c, _ in CASES])
def test_response_input_count_matches_vllm_usage(client: openai.OpenAI, case: str, fields: dict[str, Any]) -> None:
    raw = client.responses.with_raw_response.create(model="tiny", max_output_tokens=1, temperature=0.0, **fields)
    response = raw.parse()

    assert response.usage is not None
    assert int(raw.headers["x-guard-prompt-tokens"]) == response.usage.input_tokens, case


def test_gateway_and_direct_vllm_agree_on_the_same_response(
    client: openai.OpenAI, vllm_client: openai.OpenAI
) -> None:
    fields: dict[str, Any] = dict(CASES[6][1])  # a function call and its output, with tools

    through_gateway = client.responses.with_raw_response.create(model="tiny", max_output_tokens=1, **fields)
    direct = vllm_client.responses.create(model="tiny", max_output_tokens=1, **fields)

    assert direct.usage is not None
    assert int(through_gateway.headers["x-guard-prompt-tokens"]) == direct.usage.input_tokens


def test_a_streamed_response_arrives_whole_with_its_usage(
    client: openai.OpenAI, reject_gateway: ServerProcess
) -> None:
    raw = client.responses.with_raw_response.create(
        model="tiny", input="Tell me a story.", instructions="Be brief.", max_output_tokens=8, stream=True
    )
    events = list(raw.parse())

    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    final = events[-1].response  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.input_tokens == int(raw.headers["x-guard-prompt-tokens"])
    assert ledger(reject_gateway) == (0, 0, 0)


def test_max_output_tokens_is_clamped_to_what_the_gateways_context_leaves(
    client: openai.OpenAI, reject_gateway: ServerProcess
) -> None:
    raw = client.responses.with_raw_response.create(
        model="tiny", input="word " * 700, max_output_tokens=5000, temperature=0.0
    )
    response = raw.parse()

    prompt = int(raw.headers["x-guard-prompt-tokens"])
    assert response.usage is not None and response.usage.input_tokens == prompt
    assert int(raw.headers["x-guard-max-tokens"]) == GATEWAY_MAX_MODEL_LEN - prompt
    # vLLM reports the bound it generated under: the gateway's, not the client's 5000.
    assert response.max_output_tokens == GATEWAY_MAX_MODEL_LEN - prompt
    assert ledger(reject_gateway) == (0, 0, 0)


def test_an_input_vllm_would_take_is_refused_over_the_gateways_limit(
    client: openai.OpenAI, vllm_client: openai.OpenAI
) -> None:
    long_input = "word " * 1000  # between the gateway's 1536 tokens and vLLM's 2048

    direct = vllm_client.responses.create(model="tiny", input=long_input, max_output_tokens=1)
    assert direct.usage is not None and GATEWAY_MAX_MODEL_LEN < direct.usage.input_tokens < 2048
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input=long_input, max_output_tokens=1)
    assert info.value.code == "context_length_exceeded"
    assert f"{direct.usage.input_tokens} tokens" in info.value.message


@pytest.mark.parametrize(
    ("field", "value"), [("previous_response_id", "resp_0123"), ("background", True)], ids=["stored", "background"]
)
def test_what_the_gateway_cannot_count_is_refused_with_a_clear_400(
    reject_gateway: ServerProcess, field: str, value: Any
) -> None:
    answer = httpx.post(
        reject_gateway.url + "/v1/responses", headers=AUTH, json={"model": "tiny", "input": "Hi", field: value},
        timeout=30,
    )

    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == field
    assert "not supported through this gateway" in answer.json()["error"]["message"]


def test_a_pooling_route_is_guarded_and_relays_an_engine_that_serves_none(
    reject_gateway: ServerProcess, vllm: ServerProcess
) -> None:
    # The tiny model generates: vLLM serves no pooling route for it (404), so pooling counts are proven
    # against the simulator; here the gateway still counts, books and releases, and relays the engine's answer.
    direct = httpx.post(vllm.url + "/v1/embeddings", json={"model": "tiny", "input": "hello"}, timeout=30)
    answer = httpx.post(
        reject_gateway.url + "/v1/embeddings", headers=AUTH, json={"model": "tiny", "input": "hello"}, timeout=30
    )

    assert direct.status_code == answer.status_code == 404
    assert set(answer.json()["error"]) >= {"message", "type", "param", "code"}
    assert int(answer.headers["x-guard-prompt-tokens"]) > 0
    assert ledger(reject_gateway) == (0, 0, 0)
