"""The default policy on real vLLM (CPU build): it learns the answers' lengths from the engine's own usage figures
(per model, route and max_tokens bucket), shows its preemption budget in /guard/status and its booking quantile
on /metrics, honours the OpenAI SDK's x-stainless-read-timeout, and refuses a bad x-guard-deadline-ms with a 400
naming it."""

from __future__ import annotations

import httpx
import openai
import pytest

from testing.servers import API_KEY, SERVED_MODEL_NAME, ServerProcess

pytestmark = pytest.mark.e2e

ANSWERS = 10
MAX_TOKENS = 40  # the <=64 bucket


def test_the_default_policy_learns_real_lengths_and_shows_its_budget(reject_gateway: ServerProcess) -> None:
    # The SDK sends x-stainless-read-timeout on every request: accepted as the client's deadline.
    sdk = openai.OpenAI(base_url=f"{reject_gateway.url}/v1", api_key=API_KEY, timeout=60.0, max_retries=0)
    for i in range(ANSWERS):
        stream = sdk.completions.create(
            model=SERVED_MODEL_NAME, prompt=f"answer number {i}", max_tokens=MAX_TOKENS, stream=True,
            stream_options={"include_usage": True},
        )
        assert any(chunk.usage is not None for chunk in stream)
    headers = {"authorization": f"Bearer {API_KEY}"}
    status = httpx.get(f"{reject_gateway.url}/guard/status", headers=headers, timeout=10.0).json()
    assert status["policy"] == "adaptive"
    assert status["output_lengths"].get(f"{SERVED_MODEL_NAME}/completions/<=64", 0) >= ANSWERS, status
    budget = status["preemption_budget"]
    assert budget["budget_per_100"] == 3.0 and 0.7 <= budget["quantile"] <= 1.0
    assert budget["reach"] == 0.0  # nothing ever waited in the gateway's queue: no room to reach for
    page = httpx.get(f"{reject_gateway.url}/metrics", headers=headers, timeout=10.0).text
    assert "vllm_guard_admission_booking_quantile" in page and "vllm_guard_admission_reach 0.0" in page


def test_a_bad_deadline_header_is_a_400_naming_it(reject_gateway: ServerProcess) -> None:
    answer = httpx.post(
        f"{reject_gateway.url}/v1/completions", timeout=30.0,
        headers={"authorization": f"Bearer {API_KEY}", "x-guard-deadline-ms": "-1"},
        json={"model": SERVED_MODEL_NAME, "prompt": "hello", "max_tokens": 4},
    )
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "x-guard-deadline-ms"
