"""Which content format a chat template expects, detected as vLLM 0.32 detects it (``_detect_content_format``).

A template that loops over a message's content takes a list of ``{"type": "text", "text": ...}`` parts
("openai"); any other takes the text parts joined with newlines ("string"). The two render differently, so the
counter must hand a template the same shape vLLM does. The detection walks the template's Jinja syntax tree.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from functools import lru_cache
from typing import Literal

import jinja2
import jinja2.nodes

ContentFormat = Literal["string", "openai"]


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _message_loop_vars(root: jinja2.nodes.Template) -> Iterator[str]:
    names = ["messages"]
    queue = deque(["messages"])
    while queue:
        current = queue.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems(assign.node, current) and isinstance(assign.target, jinja2.nodes.Name):
                names.append(assign.target.name)
                if assign.target.name != current:
                    queue.append(assign.target.name)
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems(loop.iter, n) for n in names) and isinstance(loop.target, jinja2.nodes.Name):
            yield loop.target.name


def _iterates_content(root: jinja2.nodes.Template) -> bool:
    message_vars = list(_message_loop_vars(root))
    macro_params: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        arg_names = {a.name for a in macro.args}
        params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(_is_var_or_elems(arg, v, "content") for v in message_vars):
                    params.add(macro.args[i].name)
            for kw in call.kwargs:
                if kw.key in arg_names and any(_is_var_or_elems(kw.value, v, "content") for v in message_vars):
                    params.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if params:
                macro_params[id(loop)] = params
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems(loop.iter, v, "content") for v in message_vars):
            return True
        if isinstance(loop.iter, jinja2.nodes.Name):
            if loop.iter.name in macro_params.get(id(loop), set()):
                return True
            if id(loop) not in in_macros and loop.iter.name == "content":
                return True
    return False


@lru_cache(maxsize=32)
def detect_content_format(chat_template: str) -> ContentFormat:
    """Return "openai" when the template loops over message content (so it takes a list of parts), else "string"."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        compiled = _compile_jinja_template(chat_template)
        root = compiled.environment.parse(chat_template)
    except Exception:
        # vLLM falls back to "string" when the template does not even parse; rendering will then fail.
        return "string"
    return "openai" if _iterates_content(root) else "string"
