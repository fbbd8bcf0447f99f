"""What vLLM does to a chat request before its chat template runs, reproduced for exact counting.

vLLM 0.32 (``renderers/chat_utils.py``, ``renderers/hf.py``, ``entrypoints/openai/chat_completion``)
does not hand the request's messages to ``apply_chat_template`` as they arrive: it

- resolves the template's content format ("string": text parts joined with newlines; "openai": a list
  of ``{"type": "text", "text": ...}`` parts) by looking for loops over message content in the template;
- rewrites each message (content parts, tool-call arguments parsed into objects, tool results joined,
  ``developer`` turned into ``system`` when the template does not know that role);
- dumps ``tools`` through its pydantic models (missing ``description``/``parameters`` become null);
- merges ``chat_template_kwargs`` with ``add_generation_prompt``, ``continue_final_message``,
  ``documents`` and ``reasoning_effort`` (values that are None or "auto" never override).

Any difference changes the rendered text and so the count. This module validates shapes as it goes,
raising ``InvalidRequest`` with the parameter path, so a bad body never reaches the template; the checks request
parsing also makes (``gateway.guard.prompts``) are the same functions, so each mistake has one message.
How a template takes message content is detected in ``content_format``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.errors import InvalidRequest
from gateway.guard.counting.content_format import ContentFormat, detect_content_format
from gateway.guard.prompts import flag, messages_of, optional_list, optional_object

# Part types vLLM reads as text, and the key holding each one's text.
_TEXT_PART_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# Parts whose missing text vLLM skips instead of failing on.
_SKIP_NONE_TYPES = frozenset({"text", "refusal"})
# Every key of vLLM's content-part TypedDicts; the rest of a text part travels with it in "openai" format.
_KNOWN_PART_FIELDS = frozenset(
    {
        "audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil", "image_url",
        "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text", "thinking", "type", "uuid",
        "video_embeds", "video_url",
    }
)  # fmt: skip
_MEDIA_KEYS = frozenset(
    {"image_url", "input_image", "image_embeds", "audio_embeds", "video_embeds", "prompt_embeds",
     "image_pil", "audio_url", "input_audio", "video_url"}
)  # fmt: skip
_BILLING_HEADER = "x-anthropic-billing-header"
_UNSET = (None, "auto")


class MediaContent(InvalidRequest):
    """A content part (image, audio, video, embeddings) whose tokens only the engine can count."""


@dataclass(frozen=True)
class PreparedChat:
    """Arguments for ``tokenizer.apply_chat_template(conversation, tools=..., **kwargs)``."""

    conversation: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    chat_template: str
    kwargs: dict[str, Any]
    add_special_tokens: bool


def _text_parts(content: str | list[Any] | None, where: str) -> list[tuple[str, dict[str, Any]]]:
    """(text, extra fields) for each text part of ``content``, in order; media parts raise MediaContent."""
    if content is None:
        return []
    if isinstance(content, str):
        return [(content, {})]
    out: list[tuple[str, dict[str, Any]]] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if isinstance(part, str):
            out.append((part, {}))
            continue
        if not isinstance(part, dict):
            raise InvalidRequest(f"{at} must be an object; got {type(part).__name__}", param=at)
        ptype = part.get("type")
        if ptype in _TEXT_PART_KEYS and part.get("uuid") is None:
            text = part.get(_TEXT_PART_KEYS[ptype])
            if text is None and ptype in _SKIP_NONE_TYPES:
                continue
            if not isinstance(text, str):
                key = _TEXT_PART_KEYS[ptype]
                raise InvalidRequest(f"{at}.{key} must be a string", param=f"{at}.{key}")
            out.append((text, {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}))
            continue
        if _is_media(part):
            raise MediaContent(f"{at} is a {ptype or 'media'} part; only the engine can count its tokens", param=at)
        raise InvalidRequest(
            f"{at}.type must be one of {', '.join(sorted(_TEXT_PART_KEYS))} or a media type; got {ptype!r}",
            param=f"{at}.type",
        )
    return out


def _is_media(part: dict[str, Any]) -> bool:
    ptype = part.get("type")
    return bool(
        ptype == "tool_reference"
        or "tool_reference" in part
        or ptype in _MEDIA_KEYS
        or (ptype is None and any(k in part for k in _MEDIA_KEYS))
    )


def has_media(messages: Any) -> bool:
    """Whether a message of ``messages`` has a part whose tokens only the engine knows (image, audio, ...)."""
    for m in messages if isinstance(messages, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and _is_media(p) for p in content):
            return True
    return False


def _strip_billing_header(parts: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    # vLLM drops this per-request attribution line from system text so prompts stay prefix-cacheable.
    out = []
    for text, extra in parts:
        if text.startswith(_BILLING_HEADER):
            text = text.partition("\n")[2]
            if not text:
                continue
        out.append((text, extra))
    return out


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise InvalidRequest(f"{where} must be an array", param=where)
    calls = []
    for k, item in enumerate(value):
        at = f"{where}[{k}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{at} must be an object", param=at)
        fn = item.get("function")
        if item.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidRequest(f"{at} must be a tool call of type 'function' with a function object", param=at)
        if not isinstance(fn.get("name"), str):
            raise InvalidRequest(f"{at}.function.name must be a string", param=f"{at}.function.name")
        # The template sees arguments as an object: a JSON string is parsed, anything else becomes {}.
        raw = fn.get("arguments")
        args: Any = raw
        if not raw:
            args = {}
        elif not isinstance(raw, dict):
            try:
                args = json.loads(raw) if isinstance(raw, str) else raw
            except ValueError:
                args = None
            if not isinstance(args, dict):
                args = {}
        calls.append({**item, "function": {**fn, "arguments": args}})
    return calls


def convert_messages(messages: list[dict[str, Any]], content_format: ContentFormat) -> list[dict[str, Any]]:
    """vLLM's ``parse_chat_messages`` for text content: the conversation its template receives.

    ``messages`` are as ``messages_of`` passed them (objects with a role and a string, list or null content).
    """
    conversation: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        role = msg["role"]
        parts = _text_parts(msg.get("content"), f"messages[{i}].content")
        if role == "system":
            parts = _strip_billing_header(parts)
        out: dict[str, Any] = {"role": role}
        if content_format == "openai":
            out["content"] = [{"type": "text", "text": text, **extra} for text, extra in parts]
        else:
            out["content"] = "\n".join(text for text, _ in parts)
        if role == "assistant":
            calls = msg.get("tool_calls")
            if calls is not None:
                converted = _tool_calls(calls, f"messages[{i}].tool_calls")
                if converted:
                    out["tool_calls"] = converted
            reasoning = msg.get("reasoning")
            if reasoning is not None:
                out["reasoning"] = reasoning
                out["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in msg:
                out["tool_call_id"] = msg["tool_call_id"]
            if isinstance(out["content"], list):
                out["content"] = "\n".join(p["text"] for p in out["content"])
        for key in ("name", "task"):
            if isinstance(msg.get(key), str):
                out[key] = msg[key]
        if role == "developer":
            out["tools"] = msg.get("tools")
        conversation.append(out)
    return conversation


def developer_to_system(conversation: list[dict[str, Any]], chat_template: str) -> list[dict[str, Any]]:
    """Templates that never mention "developer" get it as "system", all system turns merged up front."""
    if not any(m["role"] == "developer" for m in conversation):
        return conversation
    if '"developer"' in chat_template or "'developer'" in chat_template:
        return conversation
    converted = []
    for m in conversation:
        if m["role"] == "developer":
            m = {k: v for k, v in m.items() if k != "tools"}
            m["role"] = "system"
        converted.append(m)
    system_texts: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(converted):
        if m["role"] != "system":
            rest.append(m)
            continue
        merge = merge or i > 0 or bool(system_texts)
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
        if content:
            system_texts.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(system_texts)}, *rest]


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """``[tool.model_dump() for tool in request.tools]`` of vLLM's ChatCompletionToolsParam."""
    tools = optional_list(tools, "tools")
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise InvalidRequest(f"tools[{i}] must be a function tool with a function object", param=f"tools[{i}]")
        if not isinstance(fn.get("name"), str):
            raise InvalidRequest(f"tools[{i}].function.name must be a string", param=f"tools[{i}].function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequest(
                f"tools[{i}].function.parameters must be an object", param=f"tools[{i}].function.parameters"
            )
        defer = tool.get("defer_loading")
        dumped_fn: dict[str, Any] = {"name": fn["name"], "description": fn.get("description"), "parameters": params}
        if fn.get("strict") is not None:
            dumped_fn["strict"] = fn["strict"]
        fn_defer = fn.get("defer_loading")
        if fn_defer is None:
            fn_defer = defer
        if fn_defer is not None:
            dumped_fn["defer_loading"] = fn_defer
        dumped: dict[str, Any] = {"type": "function", "function": dumped_fn}
        if defer is not None:
            dumped["defer_loading"] = defer
        out.append(dumped)
    return out


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments vLLM's chat endpoint passes to ``apply_chat_template`` besides tools."""
    user = optional_object(body.get("chat_template_kwargs"), "chat_template_kwargs") or {}
    for reserved in ("chat_template", "tokenize", "conversation", "messages"):
        if reserved in user:
            raise InvalidRequest(
                f"chat_template_kwargs may not set {reserved!r}", param=f"chat_template_kwargs.{reserved}"
            )
    documents = body.get("documents")
    if documents is not None and (not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents)):
        raise InvalidRequest("documents must be an array of objects", param="documents")
    extra: dict[str, Any] = {
        "add_generation_prompt": flag(body, "add_generation_prompt", True),
        "continue_final_message": flag(body, "continue_final_message", False),
        "documents": documents,
        "reasoning_effort": body.get("reasoning_effort"),
    }
    if extra["reasoning_effort"] is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = extra["reasoning_effort"] != "none"
    merged = {k: v for k, v in user.items() if v not in _UNSET}
    merged.update({k: v for k, v in extra.items() if v is not None})
    return merged


def prepare_chat(body: dict[str, Any], chat_template: str) -> PreparedChat:
    """Validate ``body`` and build the exact arguments vLLM renders ``chat_template`` with."""
    messages = messages_of(body)
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        raise InvalidRequest(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    kwargs = template_kwargs(body)
    tools = normalize_tools(body.get("tools"))
    # chat_template_kwargs are merged over vLLM's defaults, so tools given there win.
    if "tools" in kwargs:
        tools = kwargs.pop("tools")
    conversation = convert_messages(messages, detect_content_format(chat_template))
    conversation = developer_to_system(conversation, chat_template)
    return PreparedChat(
        conversation=conversation,
        tools=tools,
        chat_template=chat_template,
        kwargs=kwargs,
        add_special_tokens=flag(body, "add_special_tokens", False),
    )
