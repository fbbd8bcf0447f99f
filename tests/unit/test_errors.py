from __future__ import annotations

import orjson
import pytest

from gateway.errors import (
    AuthenticationFailed,
    ContextLengthExceeded,
    GatewayError,
    KVBudgetExceeded,
    ModelNotFound,
    PayloadTooLarge,
    QueueFull,
    QueueTimeout,
    UpstreamUnavailable,
    error_response,
    upstream_error_from,
)


@pytest.mark.parametrize(
    ("err", "status", "type_", "code"),
    [
        (ContextLengthExceeded("x"), 400, "invalid_request_error", "context_length_exceeded"),
        (KVBudgetExceeded("x"), 400, "invalid_request_error", "kv_budget_exceeded"),
        (ModelNotFound("x"), 404, "invalid_request_error", "model_not_found"),
        (PayloadTooLarge("x"), 413, "invalid_request_error", "request_too_large"),
        (AuthenticationFailed("x"), 401, "authentication_error", "invalid_api_key"),
        (QueueFull("x", retry_after=2.2), 429, "rate_limit_error", "queue_full"),
        (QueueTimeout("x", retry_after=1), 503, "server_error", "queue_timeout"),
        (UpstreamUnavailable("x", retry_after=5), 503, "server_error", "upstream_unavailable"),
    ],
)
def test_each_error_renders_in_openais_nested_shape(err: GatewayError, status: int, type_: str, code: str) -> None:
    response = error_response(err)
    body = orjson.loads(response.body)
    assert response.status_code == status
    assert body == {"error": {"message": "x", "type": type_, "param": None, "code": code}}


@pytest.mark.parametrize(("seconds", "header"), [(0.1, "1"), (2.2, "3"), (30, "30")])
def test_retry_after_is_whole_seconds_and_at_least_one(seconds: float, header: str) -> None:
    assert error_response(QueueFull("x", retry_after=seconds)).headers["retry-after"] == header


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
