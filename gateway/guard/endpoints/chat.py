"""``POST /v1/chat/completions``: a conversation the engine renders with the model's chat template.

The conversation is counted as rendered (``counting``); under the truncate policy the oldest turns are cut
to fit (``Plan.messages``), and the bound sent is written to each of ``max_completion_tokens`` and
``max_tokens`` the client used.
"""

from __future__ import annotations

from typing import Any

from gateway.guard import fields
from gateway.guard.endpoints.base import Endpoint, GuardedRequest, model_field, output_bound, sequences, stream_flag
from gateway.guard.prompts import flag, messages_of, optional_list, optional_object


def parse_chat(body: dict[str, Any]) -> GuardedRequest:
    messages_of(body)
    fields.check(CHAT.name, body)
    optional_list(body.get("tools"), "tools")
    optional_object(body.get("chat_template_kwargs"), "chat_template_kwargs")
    for name in ("add_generation_prompt", "continue_final_message"):
        flag(body, name, False)
    max_tokens = output_bound(body, CHAT.bound_fields)
    return GuardedRequest(
        endpoint=CHAT, body=body, model=model_field(body), stream=stream_flag(body), n=sequences(body, best_of=False),
        max_tokens=max_tokens, conversation=body,
    )


CHAT = Endpoint(
    "chat", ("/v1/chat/completions",), "generating", parse_chat,
    bound_fields=("max_completion_tokens", "max_tokens"), prompt_field="messages", asks_usage=True,
    echo_logprobs="top_logprobs", operation="chat",
)
