"""Prompt text and token counting for the vLLM simulator, the way vLLM 0.32 renders and counts.

With a ``transformers`` tokenizer a chat prompt is ``apply_chat_template(conversation, tools=...,
tokenize=False, **kwargs)`` encoded with the request's ``add_special_tokens`` (False by default), where the
conversation is normalised as vLLM's chat_utils does: content as a string (text parts joined by newlines)
or, when the template loops over content, as a list of ``{"type": "text"}`` parts; tool-call arguments
parsed into objects; tools as vLLM's ``ChatCompletionToolsParam.model_dump()`` writes them.

Without a tokenizer, a deterministic stand-in counts pieces of at most four non-blank characters (with
the blanks before them) and renders chats with a ChatML-like template.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jinja2
import jinja2.nodes

_PIECE = re.compile(r"\s*\S{1,4}")
_FALLBACK_BOS = 1
_FALLBACK_EOS = 2
_FALLBACK_FIRST_ID = 16


class ChatTemplateError(ValueError):
    """The chat template or its arguments rejected the request (vLLM answers 400)."""


class FallbackTokenizer:
    """Deterministic, invertible stand-in for a tokenizer: one id per distinct piece."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._pieces: dict[int, str] = {_FALLBACK_BOS: ""}

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = [_FALLBACK_BOS] if add_special_tokens else []
        for piece in _PIECE.findall(text):
            token = self._ids.get(piece)
            if token is None:
                token = _FALLBACK_FIRST_ID + len(self._ids)
                self._ids[piece] = token
                self._pieces[token] = piece
            ids.append(token)
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self._pieces.get(i, "") for i in ids)


class PromptCounter:
    """Renders and tokenizes prompts; one per simulator."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._fallback = FallbackTokenizer()
        self.max_chars_per_token: int | None = None
        self._template: str | None = None
        self.content_format = "string"
        if tokenizer is not None:
            self.max_chars_per_token = max(len(t) for t in tokenizer.get_vocab())
            template = getattr(tokenizer, "chat_template", None)
            self._template = template if isinstance(template, str) else None
            if self._template is not None:
                self.content_format = detect_content_format(self._template)

    def encode(self, text: str, add_special_tokens: bool, max_length: int | None = None) -> list[int]:
        """Token ids of ``text``; like vLLM, stops at ``max_length`` tokens when it is given."""
        if self.tokenizer is None:
            ids = self._fallback.encode(text, add_special_tokens)
            return ids if max_length is None else ids[:max_length]
        kwargs: dict[str, Any] = {"add_special_tokens": add_special_tokens}
        if max_length is not None:
            kwargs.update(truncation=True, max_length=max_length)
        encoded: list[int] = self.tokenizer.encode(text, **kwargs)
        return encoded

    @property
    def eos_token_id(self) -> int:
        """The id a ``logit_bias`` names to make answers end (the stand-in's: one no piece gets)."""
        eos = None if self.tokenizer is None else self.tokenizer.eos_token_id
        return _FALLBACK_EOS if eos is None else int(eos)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return self._fallback.decode(ids)
        text: str = self.tokenizer.decode(ids)
        return text

    def chat_text(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any],
    ) -> str:
        """The prompt text vLLM renders for a chat request."""
        unexpected = {"chat_template", "tokenize"} & template_kwargs.keys()
        if unexpected:
            raise ChatTemplateError(f"Found unexpected chat template kwargs from request: {unexpected}")
        conversation = normalise_conversation(messages, self.content_format, self._template)
        tool_dicts = [normalise_tool(t) for t in tools] if tools is not None else None
        if self.tokenizer is None:
            return _fallback_chat_text(conversation, tool_dicts, template_kwargs)
        if self._template is None:
            raise ChatTemplateError(
                "As of transformers v4.44, default chat template is no longer allowed, so you must provide "
                "a chat template if the tokenizer does not define one."
            )
        try:
            text: str = self.tokenizer.apply_chat_template(
                conversation, tools=tool_dicts, tokenize=False, **template_kwargs
            )
        except (jinja2.TemplateError, ValueError) as exc:
            # vLLM turns template and transformers argument errors into a 400 with their own reason.
            raise ChatTemplateError(str(exc)) from exc
        return text


def normalise_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as vLLM's ``ChatCompletionToolsParam.model_dump()`` passes it to the template."""
    function = tool.get("function") or {}
    out: dict[str, Any] = {
        "name": function.get("name"),
        "description": function.get("description"),
        "parameters": function.get("parameters"),
    }
    if function.get("strict") is not None:
        out["strict"] = function["strict"]
    if function.get("defer_loading", tool.get("defer_loading")) is not None:
        out["defer_loading"] = function.get("defer_loading", tool.get("defer_loading"))
    dumped: dict[str, Any] = {"type": tool.get("type", "function"), "function": out}
    if tool.get("defer_loading") is not None:
        dumped["defer_loading"] = tool["defer_loading"]
    return dumped


def normalise_conversation(
    messages: list[dict[str, Any]], content_format: str, template: str | None
) -> list[dict[str, Any]]:
    """vLLM's ``parse_chat_messages`` for text content: what the chat template sees."""
    developer_known = template is not None and ('"developer"' in template or "'developer'" in template)
    conversation: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        texts = _texts(message.get("content"))
        msg: dict[str, Any] = {"role": role}
        if content_format == "openai" and role != "tool":
            msg["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            msg["content"] = "\n".join(texts)
        if role == "assistant":
            calls = message.get("tool_calls")
            if calls:
                msg["tool_calls"] = [_parsed_call(c) for c in calls]
            reasoning = message.get("reasoning", message.get("reasoning_content"))
            if reasoning is not None:
                msg["reasoning"] = msg["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            msg["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            msg["name"] = message["name"]
        if role == "developer" and not developer_known:
            msg["role"] = "system"
        conversation.append(msg)
    return conversation


def _texts(content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    texts: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
            texts.append(str(part.get("text", "")))
    return texts


def _parsed_call(call: dict[str, Any]) -> dict[str, Any]:
    call = dict(call)
    function = call.get("function")
    if isinstance(function, dict):
        function = dict(function)
        arguments = function.get("arguments")
        if not arguments:
            function["arguments"] = {}
        elif isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except json.JSONDecodeError:
                # vLLM coerces a malformed history entry so the conversation stays usable.
                function["arguments"] = {}
        call["function"] = function
    return call


def _fallback_chat_text(
    conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]
) -> str:
    parts: list[str] = []
    if tools:
        parts.append("<|im_start|>system\n" + json.dumps(tools) + "<|im_end|>\n")
    for msg in conversation:
        content = msg["content"]
        text = content if isinstance(content, str) else "".join(p["text"] for p in content)
        if msg.get("tool_calls"):
            text += json.dumps(msg["tool_calls"])
        parts.append(f"<|im_start|>{msg['role']}\n{text}<|im_end|>\n")
    if kwargs.get("continue_final_message") and parts:
        parts[-1] = parts[-1].removesuffix("<|im_end|>\n")
    elif kwargs.get("add_generation_prompt", True):
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def detect_content_format(template: str) -> str:
    """"openai" when the template loops over a message's content (or a macro parameter given it)."""
    try:
        ast = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    content_params: set[str] = set()
    for macro in ast.find_all(jinja2.nodes.Macro):
        names = [arg.name for arg in macro.args]
        for call in ast.find_all(jinja2.nodes.Call):
            if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
                for i, arg in enumerate(call.args):
                    if i < len(names) and _is_content_access(arg):
                        content_params.add(names[i])
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        if _is_content_access(it):
            return "openai"
        if isinstance(it, jinja2.nodes.Name) and (it.name == "content" or it.name in content_params):
            return "openai"
    return "string"


def _is_content_access(node: jinja2.nodes.Node) -> bool:
    while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
        node = node.node
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    return isinstance(node, jinja2.nodes.Getattr) and node.attr == "content"


def chat_template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """Request fields merged over ``chat_template_kwargs`` as vLLM's ``build_chat_params`` does."""
    user = dict(body.get("chat_template_kwargs") or {})
    extra: dict[str, Any] = {
        "add_generation_prompt": body.get("add_generation_prompt", True),
        "continue_final_message": body.get("continue_final_message", False),
        "documents": body.get("documents"),
        "reasoning_effort": body.get("reasoning_effort"),
    }
    if body.get("reasoning_effort") is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = body["reasoning_effort"] != "none"
    return user | {k: v for k, v in extra.items() if v is not None and v != "auto"}

