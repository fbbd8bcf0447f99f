"""Every shape of vLLM's error answers (nested since 0.10.1, flat before, FastAPI's detail, HTML) becomes one
OpenAI-shaped upstream error."""

from __future__ import annotations

import pytest

from gateway.engine.vllm_api import upstream_error_from


@pytest.mark.parametrize(
    ("status", "payload", "message", "type_", "code", "param"),
    [
        (
            400,
            b'{"error": {"message": "This model\'s maximum context length is 2048 tokens. However, your prompt '
            b'contains at least 2049 input tokens", "type": "BadRequestError", "param": "input_tokens", "code": 400}}',
            "This model's maximum context length is 2048 tokens. However, your prompt contains at least 2049 "
            "input tokens",
            "invalid_request_error",
            "context_length_exceeded",
            "input_tokens",
        ),
        (
            400,
            b'{"object": "error", "message": "bad temperature", "type": "BadRequestError", "param": null, "code": 400}',
            "bad temperature",
            "invalid_request_error",
            None,
            None,
        ),
        (
            404,
            b'{"error": {"message": "The model `x` does not exist.", "type": "NotFoundError", "code": 404}}',
            "The model `x` does not exist.",
            "invalid_request_error",
            "model_not_found",
            None,
        ),
        (500, b"<html>oops</html>", "<html>oops</html>", "server_error", None, None),
        (502, b"", "upstream answered HTTP 502", "server_error", None, None),
    ],
)
def test_upstream_errors_are_normalised(
    status: int, payload: bytes, message: str, type_: str, code: str | None, param: str | None
) -> None:
    err = upstream_error_from(status, payload)
    assert (err.status, err.message, err.type, err.code, err.param) == (status, message, type_, code, param)
