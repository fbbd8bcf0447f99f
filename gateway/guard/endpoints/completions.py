"""``POST /v1/completions``: one prompt or a batch of them, each text or token ids.

Each prompt is counted on its own and, under the truncate policy, cut to fit on its own; the prompts as cut
are sent back in the shape the client used (``engine_body``). ``best_of`` generates that many sequences per
prompt, and is booked so.
"""

from __future__ import annotations

from typing import Any, Literal

from gateway.guard import fields
from gateway.guard.endpoints.base import Endpoint, GuardedRequest, model_field, output_bound, sequences, stream_flag
from gateway.guard.prompts import is_ids, prompt_list, prompt_shape_error


def parse_completion(body: dict[str, Any]) -> GuardedRequest:
    fields.check(COMPLETIONS.name, body)
    raw = body.get("prompt")
    prompts = [list(p) if isinstance(p, list) else p for p in prompt_list(raw)]
    kind: Literal["text", "texts", "ids", "ids_list"]
    if isinstance(raw, str):
        kind = "text"
    elif is_ids(raw):
        kind = "ids"
    elif all(isinstance(p, str) for p in prompts):
        kind = "texts"
    elif all(isinstance(p, list) for p in prompts):
        kind = "ids_list"
    else:  # vLLM takes a list of prompts of one shape only
        raise prompt_shape_error(raw)
    return GuardedRequest(
        endpoint=COMPLETIONS, body=body, model=model_field(body), stream=stream_flag(body),
        n=sequences(body, best_of=True), max_tokens=output_bound(body, COMPLETIONS.bound_fields), prompts=prompts,
        prompt_kind=kind,
    )


COMPLETIONS = Endpoint(
    "completions", ("/v1/completions",), "generating", parse_completion, asks_usage=True, echo_logprobs="logprobs",
    operation="text_completion",
)
