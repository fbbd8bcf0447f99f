"""Chat requests and reference counts shared by the counting tests."""

from __future__ import annotations

from typing import Any

from gateway.guard.counting import LocalCounter

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
# What vLLM hands the template for TOOLS and for a bare tool (its pydantic dump fills in nulls).
DUMPED_BARE_TOOL = {"type": "function", "function": {"name": "noop", "description": None, "parameters": None}}
U = {"role": "user", "content": "What is the weather in Paris today?"}
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ],
}
ANSWER = {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21 degrees"}


def reference(tok: Any, body: dict[str, Any]) -> int:
    """The count by the tokenizer itself, the way vLLM calls it for a chat request."""
    return len(reference_ids(tok, body))


def reference_ids(tok: Any, body: dict[str, Any]) -> tuple[int, ...]:
    """The ids by the tokenizer itself, the way vLLM calls it for a chat request."""
    kwargs = {
        "tools": body.get("tools"),
        "documents": body.get("documents"),
        "add_generation_prompt": body.get("add_generation_prompt", True),
        "continue_final_message": body.get("continue_final_message", False),
        "chat_template": body.get("chat_template"),
        **(body.get("chat_template_kwargs") or {}),
    }
    text = tok.apply_chat_template(body["messages"], tokenize=False, **kwargs)
    ids = tok(text, add_special_tokens=body.get("add_special_tokens", False))["input_ids"]
    if not body.get("add_special_tokens"):
        assert ids == tok.apply_chat_template(body["messages"], tokenize=True, return_dict=False, **kwargs)
    return tuple(ids)


def turn(role: str, words: int, tag: str) -> dict[str, Any]:
    return {"role": role, "content": " ".join(f"{tag}{i}" for i in range(words))}


SYS = {"role": "system", "content": "You are terse."}
U1 = turn("user", 60, "u")
A1 = turn("assistant", 60, "a")
U2 = turn("user", 60, "v")
A2 = turn("assistant", 60, "b")
U3 = turn("user", 20, "w")
TCALL = {**CALL, "content": "checking"}


async def counted(counter: LocalCounter, messages: list[dict[str, Any]]) -> int:
    return await counter.count_chat({"messages": messages})
