"""What clients see besides completions: the model list, and errors in OpenAI's one shape."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from testing.payloads import token_ids
from testing.servers import API_KEY, DEFAULT_MAX_MODEL_LEN, GATEWAY_MAX_MODEL_LEN, ServerProcess, get_json

pytestmark = pytest.mark.e2e

AUTH = {"authorization": f"Bearer {API_KEY}"}


def test_the_model_list_shows_the_gateways_limit_not_vllms(client: openai.OpenAI, vllm: ServerProcess) -> None:
    through_gateway = client.models.list().data
    direct = get_json(f"{vllm.url}/v1/models")["data"]

    assert [m.id for m in through_gateway] == [m["id"] for m in direct] == ["tiny"]
    assert direct[0]["max_model_len"] == DEFAULT_MAX_MODEL_LEN
    assert through_gateway[0].model_dump()["max_model_len"] == GATEWAY_MAX_MODEL_LEN


def test_without_a_lower_limit_the_model_list_shows_vllms_own(truncating_client: openai.OpenAI) -> None:
    model = truncating_client.models.list().data[0]

    assert model.model_dump()["max_model_len"] == DEFAULT_MAX_MODEL_LEN


ERROR_CASES: list[tuple[str, str, dict[str, str], bytes, int, str, str | None]] = [
    # case, path, headers, body, status, type, code
    ("a body that is not JSON", "/v1/completions", AUTH, b"{not json", 400, "invalid_request_error", None),
    (
        "messages of the wrong type",
        "/v1/chat/completions",
        AUTH,
        b'{"model": "tiny", "messages": "hello"}',
        400,
        "invalid_request_error",
        None,
    ),
    (
        "no API key",
        "/v1/completions",
        {},
        b'{"model": "tiny", "prompt": "hi"}',
        401,
        "authentication_error",
        "invalid_api_key",
    ),
    (
        "a wrong API key",
        "/v1/completions",
        {"authorization": "Bearer not-the-key"},
        b'{"model": "tiny", "prompt": "hi"}',
        401,
        "authentication_error",
        "invalid_api_key",
    ),
    (
        "a prompt over the limit",
        "/v1/completions",
        AUTH,
        b'{"model": "tiny", "max_tokens": 4, "prompt": %s}'
        % str(token_ids(GATEWAY_MAX_MODEL_LEN + 1, seed=30)).encode(),
        400,
        "invalid_request_error",
        "context_length_exceeded",
    ),
]


@pytest.mark.parametrize(
    ("case", "path", "headers", "body", "status", "error_type", "code"),
    ERROR_CASES,
    ids=[c[0] for c in ERROR_CASES],
)
def test_errors_have_openais_shape(
    reject_gateway: ServerProcess,
    case: str,
    path: str,
    headers: dict[str, str],
    body: bytes,
    status: int,
    error_type: str,
    code: str | None,
) -> None:
    response = httpx.post(
        reject_gateway.url + path,
        content=body,
        headers={"content-type": "application/json", **headers},
        timeout=60,
    )

    assert response.status_code == status, (case, response.text)
    payload: Any = response.json()
    assert set(payload) == {"error"}
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["type"] == error_type
    assert payload["error"]["message"]
    if code is not None:
        assert payload["error"]["code"] == code


def test_an_unknown_model_is_answered_with_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)

    assert isinstance(caught.value.body, dict)
    assert set(caught.value.body) >= {"message", "type"}
