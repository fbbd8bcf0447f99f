"""The request fields a prompt is made of, and their shape checks: one check and one message per mistake.

Request parsing (``protocol``) runs these checks first; prompt counting (``counting``) runs the same functions
again for the requests that reach it by other paths (pooling chats, Responses conversations), so a mistake
reads the same whichever path found it. Errors name the field and say which JSON type was sent instead.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import InvalidRequest

# One prompt of a completions request, as text or as token ids.
Prompt = str | list[int]

_PROMPT_SHAPES = (
    "'prompt' must be a string, a non-empty list of strings, a list of token ids, or a list of non-empty token id "
    "lists"
)


def is_int(v: Any) -> bool:
    return bool(isinstance(v, int) and not isinstance(v, bool))


def is_ids(v: Any) -> bool:
    """A non-empty list of token ids."""
    return isinstance(v, list) and bool(v) and all(is_int(t) for t in v)


def json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int | float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an empty list" if not v else "a list"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def messages_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat request's messages: a non-empty list of objects, each with a role and a string, list or null content."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidRequest(
            f"'messages' must be a list of message objects, not {json_type(messages)}.", param="messages"
        )
    if not messages:
        raise InvalidRequest("'messages' must contain at least one message.", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object, not {json_type(m)}.", param=f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"messages[{i}] needs a 'role' string.", param=f"messages[{i}].role")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise InvalidRequest(
                f"messages[{i}].content must be a string, a list of content parts or null, "
                f"not {json_type(content)}.",
                param=f"messages[{i}].content",
            )
    return messages


def flag(body: dict[str, Any], name: str, default: bool) -> bool:
    """A boolean field; absent or null reads as ``default``."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{name}' must be a boolean, not {json_type(value)}.", param=name)
    return value


def optional_list(value: Any, name: str) -> list[Any] | None:
    """Field ``name``'s ``value``: a list, or None when absent."""
    if value is not None and not isinstance(value, list):
        raise InvalidRequest(f"'{name}' must be a list, not {json_type(value)}.", param=name)
    return value


def optional_object(value: Any, name: str) -> dict[str, Any] | None:
    """Field ``name``'s ``value``: an object, or None when absent."""
    if value is not None and not isinstance(value, dict):
        raise InvalidRequest(f"'{name}' must be an object, not {json_type(value)}.", param=name)
    return value


def prompt_shape_error(raw: Any) -> InvalidRequest:
    return InvalidRequest(f"{_PROMPT_SHAPES}; got {json_type(raw)}.", param="prompt")


def prompt_list(raw: Any) -> list[Prompt]:
    """The prompts of a ``prompt`` field: one string or id list, or a non-empty list of such prompts."""
    if isinstance(raw, str) or is_ids(raw):
        return [raw]
    if isinstance(raw, list) and raw and all(isinstance(p, str) or is_ids(p) for p in raw):
        return list(raw)
    raise prompt_shape_error(raw)
