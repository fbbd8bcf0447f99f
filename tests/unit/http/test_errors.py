"""Every domain error is answered in OpenAI's nested shape with its status, type and Retry-After."""

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
)
from gateway.http.errors import error_response, status_and_type


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
    "err",
    [ContextLengthExceeded("x"), KVBudgetExceeded("x"), QueueFull("x"), UpstreamUnavailable("x"), GatewayError("x")],
    ids=lambda e: type(e).__name__,
)
def test_a_domain_error_knows_nothing_of_http(err: GatewayError) -> None:
    assert not hasattr(err, "status") and not hasattr(err, "type") and not hasattr(err, "headers")


def test_a_client_mistake_is_4xx_and_ours_or_the_upstreams_is_5xx() -> None:
    for err in (ContextLengthExceeded("x"), AuthenticationFailed("x"), QueueFull("x"), PayloadTooLarge("x")):
        assert err.client_fault and status_and_type(err)[0] < 500
    for err in (QueueTimeout("x"), UpstreamUnavailable("x"), GatewayError("x")):
        assert not err.client_fault and status_and_type(err)[0] >= 500
