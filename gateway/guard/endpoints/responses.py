"""OpenAI's Responses API (``POST /v1/responses``): its request, and the chat request vLLM 0.32 renders for one,
to count it.

vLLM does not tokenize a Responses request on its own terms: it turns ``instructions`` and ``input`` into
chat messages (``entrypoints/openai/responses/utils.py``: ``construct_input_messages``), its function tools
into chat tools (``construct_tool_dicts``), and renders them with the model's chat template exactly like a
chat completion (``renderers/online_renderer.py``: ``render_responses``). The one difference in tokenizing:
the rendered text is encoded with special tokens added (``ResponsesRequest.build_tok_params`` keeps
``TokenizeParams``' default), where a chat completion adds none by default.

So the gateway builds that chat request here and counts it with the chat counter. The mapping, item by item:

- ``instructions`` (when not empty) -> a first ``system`` message; a string ``input`` -> one ``user`` message;
- a message item with role user/system/developer -> the item itself as a chat message (its content parts,
  ``input_text`` among them, read like chat content parts);
- an assistant message -> ``{"role": "assistant", "content": <its first part's text>}``;
- ``function_call`` / ``custom_tool_call`` -> a tool call, appended to the previous assistant message when
  there is one (``<namespace>__<name>`` for namespaced functions; a custom tool's input as ``{"input": ...}``);
- ``reasoning`` -> ``reasoning`` on the previous assistant message, or a new one;
- ``function_call_output`` / ``custom_tool_call_output`` -> a ``tool`` message.

A last message or reasoning item whose status is ``in_progress``/``incomplete`` is continued rather than
answered (``continue_final_message``). Harmony models (gpt-oss) are rendered another way, which this module
does not reproduce.

State the gateway cannot see is refused with a 400 rather than guessed at: ``previous_response_id``,
``conversation``, a stored ``prompt``, ``item_reference`` items, ``previous_input_messages``, and
``background`` (the engine would go on generating after the gateway released the request's KV blocks).
"""

from __future__ import annotations

import json
from typing import Any

from gateway.config import PromptOverflowPolicy
from gateway.errors import ContextLengthExceeded, InvalidRequest, UnsupportedField
from gateway.guard import fields
from gateway.guard.endpoints.base import Endpoint, GuardedRequest, model_field, output_bound
from gateway.guard.fields import BACKGROUND, STATEFUL_FIELDS
from gateway.guard.policy import Limits
from gateway.guard.prompts import json_type

# vLLM's schema for a custom (free-form text) tool, shown to the model as a one-argument function
# (tool_parsers/utils.py: custom_tool_parameters).
CUSTOM_TOOL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The freeform text payload for this tool."}},
    "required": ["input"],
    "additionalProperties": False,
}
_NAMESPACE_SEPARATOR = "__"
_MESSAGE_ROLES = ("user", "assistant", "system", "developer")
_CONTINUED = ("in_progress", "incomplete")


def parse_responses(body: dict[str, Any]) -> GuardedRequest:
    """One generation from ``instructions`` and ``input``, counted as the chat request vLLM renders for it."""
    refuse_stateful(body)
    fields.check(RESPONSES.name, body)
    conversation = chat_request(body)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest(f"'stream' must be a boolean, not {json_type(stream)}.", param="stream")
    truncation = body.get("truncation")
    if truncation not in (None, "auto", "disabled"):
        raise InvalidRequest(f"'truncation' must be 'auto' or 'disabled'; got {truncation!r}.", param="truncation")
    return GuardedRequest(
        endpoint=RESPONSES, body=body, model=model_field(body), stream=bool(stream), n=1,
        max_tokens=output_bound(body, RESPONSES.bound_fields), conversation=conversation,
    )


def refuse_stateful(body: dict[str, Any]) -> None:
    """400 for the fields whose tokens live outside the request (or whose generation outlives it)."""
    for name, why in STATEFUL_FIELDS.items():
        if body.get(name) is not None:
            raise UnsupportedField(f"'{name}' is not supported through this gateway: {why}.", param=name)
    if body.get("background"):
        raise UnsupportedField(f"'background' is not supported through this gateway: {BACKGROUND}.", param="background")


def check_fits(prompt_tokens: int, limits: Limits, policy: PromptOverflowPolicy) -> None:
    """A Responses prompt over the limit is refused whatever the policy: dropping input items could split a
    tool call from its output, and vLLM's own ``truncation: "auto"`` cuts the rendered prompt's end (the turn
    the model should answer), so no cut of it is both valid and faithful."""
    if prompt_tokens <= limits.prompt_cap:
        return
    if limits.max_prompt_tokens is not None and limits.max_prompt_tokens < limits.max_model_len - 1:
        head = (
            f"This gateway accepts prompts of at most {limits.max_prompt_tokens} tokens (the model's maximum "
            f"context length is {limits.max_model_len} tokens)"
        )
    else:
        head = f"This model's maximum context length is {limits.max_model_len} tokens"
    why = (
        " /v1/responses input is never truncated by this gateway (x-guard-on-overflow: truncate applies to chat "
        "and completions only)." if policy == "truncate" else ""
    )
    raise ContextLengthExceeded(
        f"{head}; your instructions and input use {prompt_tokens} tokens as rendered, leaving no room for the "
        f"output. Shorten 'input' or 'instructions'.{why}",
        param="input",
    )


RESPONSES = Endpoint(
    "responses", ("/v1/responses",), "generating", parse_responses, bound="max_output_tokens",
    bound_fields=("max_output_tokens",), prompt_field="input", min_tokens=False, fits=check_fits, operation="chat",
)


def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request whose rendering vLLM tokenizes for the Responses request ``body``."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest(f"'instructions' must be a string, not {json_type(instructions)}.", param="instructions")
    items = body.get("input")
    if isinstance(items, str):
        pass
    elif isinstance(items, list):
        if not items:
            raise InvalidRequest("'input' must not be an empty list.", param="input")
    else:
        raise InvalidRequest(
            f"'input' must be a string or a list of input items, not {json_type(items)}.", param="input"
        )
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise InvalidRequest(f"'reasoning' must be an object, not {json_type(reasoning)}.", param="reasoning")
    continued = continues_final_message(items)
    chat: dict[str, Any] = {
        "messages": input_messages(instructions, items),
        "add_generation_prompt": not continued,
        "continue_final_message": continued,
        # TokenizeParams' default for Responses: unlike a chat completion's default of False.
        "add_special_tokens": True,
    }
    tools = chat_tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    effort = reasoning.get("effort") if reasoning is not None else None
    if effort is not None:
        chat["reasoning_effort"] = effort
    # The engine's /tokenize renders media with the same processor options (fields.py refuses them without media).
    for key in ("chat_template_kwargs", "mm_processor_kwargs", "media_io_kwargs"):
        if body.get(key) is not None:
            chat[key] = body[key]
    return chat


def continues_final_message(items: Any) -> bool:
    """vLLM's ``should_continue_final_message``: the input ends in a partial assistant message or reasoning."""
    if not isinstance(items, list) or not items or not isinstance(items[-1], dict):
        return False
    last = items[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in _CONTINUED


def input_messages(instructions: str | None, items: str | list[Any]) -> list[dict[str, Any]]:
    """vLLM's ``construct_input_messages`` for a request without stored history."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return messages
    converted: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        message = _item_message(item, f"input[{i}]", converted[-1] if converted else None)
        if message is not None:
            converted.append(message)
    return messages + converted


def _item_message(item: Any, at: str, prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """The chat message one input item becomes, or None when it was merged into ``prev``."""
    if not isinstance(item, dict):
        raise InvalidRequest(f"{at} must be an object, not {json_type(item)}.", param=at)
    kind = item.get("type")
    assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    if kind in ("function_call", "custom_tool_call"):
        call = _tool_call(item, at)
        if assistant is None:
            return {"role": "assistant", "tool_calls": [call]}
        assistant["tool_calls"] = [*(assistant.get("tool_calls") or []), call]
        return None
    if kind == "reasoning":
        text = _reasoning_text(item, at)
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = text
            return None
        return {"role": "assistant", "reasoning": text}
    if kind in ("function_call_output", "custom_tool_call_output"):
        _string(item, "call_id", at)
        output = item.get("output")
        if not isinstance(output, str | list):
            raise InvalidRequest(
                f"{at}.output must be a string or a list of content parts, not {json_type(output)}.",
                param=f"{at}.output",
            )
        return {"role": "tool", "content": output, "tool_call_id": item["call_id"]}
    if kind == "item_reference":
        raise InvalidRequest(
            f"{at} refers to a stored item by id, which is not supported through this gateway: the gateway "
            "cannot count tokens it cannot see. Send the item itself.",
            param=at,
        )
    if kind not in (None, "message"):
        raise InvalidRequest(f"Unsupported input item type: {kind}.", param=f"{at}.type")
    role = item.get("role")
    if role not in _MESSAGE_ROLES:
        raise InvalidRequest(
            f"{at}.role must be one of {', '.join(_MESSAGE_ROLES)}; got {role!r}.", param=f"{at}.role"
        )
    content = item.get("content")
    if not isinstance(content, str | list):
        raise InvalidRequest(
            f"{at}.content must be a string or a list of content parts, not {json_type(content)}.",
            param=f"{at}.content",
        )
    if role == "assistant":
        text = _assistant_text(content, at)
        if assistant is not None and assistant.get("content") is None:
            assistant["content"] = text
            return None
        return {"role": "assistant", "content": text}
    return dict(item)


def _assistant_text(content: str | list[Any], at: str) -> str:
    # vLLM keeps only the first part of an earlier answer.
    if isinstance(content, str):
        return content
    first = content[0] if content else None
    text = first.get("text") if isinstance(first, dict) else None
    if not isinstance(text, str):
        raise InvalidRequest(
            f"{at}.content must start with an output_text part (vLLM reads an earlier answer from its first "
            "part).",
            param=f"{at}.content",
        )
    return text


def _tool_call(item: dict[str, Any], at: str) -> dict[str, Any]:
    call_id, name = _string(item, "call_id", at), _string(item, "name", at)
    if item["type"] == "custom_tool_call":
        arguments = json.dumps({"input": _string(item, "input", at) or ""}, ensure_ascii=False)
    else:
        arguments = _string(item, "arguments", at)
        namespace = item.get("namespace")
        if namespace is not None and not isinstance(namespace, str):
            raise InvalidRequest(f"{at}.namespace must be a string.", param=f"{at}.namespace")
        if namespace:
            name = f"{namespace}{_NAMESPACE_SEPARATOR}{name}"
    return {"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"}


def _reasoning_text(item: dict[str, Any], at: str) -> str:
    if item.get("encrypted_content"):
        raise InvalidRequest("Encrypted content is not supported.", param=f"{at}.encrypted_content")
    summary, content = item.get("summary"), item.get("content")
    if not isinstance(summary, list):
        raise InvalidRequest(f"{at}.summary must be a list of summary parts.", param=f"{at}.summary")
    if content is not None and not isinstance(content, list):
        raise InvalidRequest(f"{at}.content must be a list of reasoning parts.", param=f"{at}.content")
    for field, parts in (("content", content), ("summary", summary)):
        if parts:
            text = parts[0].get("text") if isinstance(parts[0], dict) else None
            if not isinstance(text, str):
                raise InvalidRequest(f"{at}.{field}[0].text must be a string.", param=f"{at}.{field}[0].text")
            return text
    return ""


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """vLLM's ``construct_tool_dicts``: the function tools the model is shown, as chat tools.

    Namespaced functions are flattened to ``<namespace>__<name>``; custom tools become a one-argument
    function; built-in tools (web search, file search, MCP, ...) are never rendered.
    """
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidRequest(f"'tools' must be a list of tools, not {json_type(tools)}.", param="tools")
    if not tools:
        return None
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise InvalidRequest(f"{at} must be an object with a 'type'.", param=at)
        if tool["type"] == "function":
            out.append(_function_tool(tool, at, _string(tool, "name", at)))
        elif tool["type"] == "custom":
            custom = {"name": _string(tool, "name", at), "description": tool.get("description"),
                      "parameters": CUSTOM_TOOL_PARAMETERS}  # fmt: skip
            out.append({"type": "function", "function": custom})
        elif tool["type"] == "namespace":
            namespace, members = _string(tool, "name", at), tool.get("tools")
            if not isinstance(members, list):
                raise InvalidRequest(f"{at}.tools must be a list.", param=f"{at}.tools")
            for j, member in enumerate(members):
                if isinstance(member, dict) and member.get("type") == "function":
                    name = f"{namespace}{_NAMESPACE_SEPARATOR}{_string(member, 'name', f'{at}.tools[{j}]')}"
                    out.append(_function_tool(member, f"{at}.tools[{j}]", name))
    return out


def _function_tool(tool: dict[str, Any], at: str, name: str) -> dict[str, Any]:
    params = tool.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise InvalidRequest(f"{at}.parameters must be an object.", param=f"{at}.parameters")
    function = {"name": name, "description": tool.get("description"), "parameters": params}
    for key in ("strict", "defer_loading"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _string(item: dict[str, Any], key: str, at: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequest(f"{at}.{key} must be a string, not {json_type(value)}.", param=f"{at}.{key}")
    return value
