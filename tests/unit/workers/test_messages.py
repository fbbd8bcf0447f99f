"""A refusal crosses from the authority to a worker as the same error, with the same fields; a prompt's ids
cross as they are, or not at all when no engine would accept them."""

from __future__ import annotations

import pytest

from gateway import errors
from gateway.admission.prefix import PromptPrefix
from gateway.workers.messages import error_from_json, error_to_json, prefix_from_json, prefix_to_json

ERRORS = [
    errors.QueueFull("The queue is full (1024 waiting).", retry_after=3.0),
    errors.TenantRateLimited("Rate limit reached for tenant 'a'.", limit="tokens_per_minute", retry_after=12.0),
    errors.KVBudgetExceeded("This request needs 40 KV blocks, more than the engine's whole budget of 28."),
    errors.UpstreamUnavailable("The engine is restarting; retry shortly.", code="upstream_restarting", retry_after=5),
    errors.InvalidRequest("x-guard-deadline-ms is below 1 ms.", param="x-guard-deadline-ms"),
]


@pytest.mark.parametrize("error", ERRORS, ids=[type(e).__name__ for e in ERRORS])
def test_an_error_crosses_as_the_same_class_with_the_same_fields(error: errors.GatewayError) -> None:
    back = error_from_json(error_to_json(error))
    assert type(back) is type(error)
    assert vars(back) == vars(error) and str(back) == str(error)
    assert (back.code, back.reason, back.client_fault) == (error.code, error.reason, error.client_fault)


def test_an_unknown_class_becomes_a_retryable_unavailable() -> None:
    back = error_from_json({"class": "SomethingElse", "fields": {"message": "boom"}})
    assert isinstance(back, errors.UpstreamUnavailable) and back.retry_after == 1 and back.message == "boom"


@pytest.mark.parametrize(
    ("prefix", "crosses"),
    [
        (None, None),
        (PromptPrefix((1, 2, 3), "tiny"), PromptPrefix((1, 2, 3), "tiny")),
        (PromptPrefix((1, 2**64), "tiny"), None),  # no engine accepts it; its blocks are never shared
    ],
)
def test_a_prompts_ids_cross_as_they_are(prefix: PromptPrefix | None, crosses: PromptPrefix | None) -> None:
    assert prefix_from_json(prefix_to_json(prefix)) == crosses
