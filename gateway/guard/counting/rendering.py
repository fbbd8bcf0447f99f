"""The model's chat template rendered exactly as ``tokenizer.apply_chat_template(..., tokenize=False)`` renders it,
for less.

Every chat request is rendered once to be counted, on the event loop when it is small, and vLLM renders it the
same way (transformers' ``apply_chat_template``, with transformers' own compile of the template into jinja's
``ImmutableSandboxedEnvironment``). For a short chat on the tiny model's template that call took 66.8 us (measured
in a loop on one core, the heap ``gc.freeze``d as the gateway's is); three parts of it are not the template's
own work, and are taken off here without changing a result:

- around the render: the special tokens' map rebuilt on every call, the template looked up again, the batching
  and continuation checks, the result wrapped and unwrapped. Here the map is taken once, the template compiled
  once, and a single conversation rendered straight away;
- inside it: the sandbox asks whether an attribute is safe on every attribute the template reads (``loop.first``,
  a namespace's field, a string's method), and jinja's answer depends only on the object's type and the
  attribute's name (a name starting with ``_``, a function's or frame's internals, a mutating method of a list,
  dict, set or deque): it is remembered per (type, name). These two: 66.8 -> 52.5 us;
- the template's globals, copied into every render's context, from a plain dict instead of jinja's ``ChainMap``:
  52.5 -> 38.8 us (``recompiled``).

Everything else about the sandbox is jinja's own, on an overlay of the environment transformers compiled; the same
text and the same errors (``tests/unit/guard/counting/test_rendering.py`` renders every case both ways). What this
path does not cover goes to ``apply_chat_template`` itself: a continued final message (transformers marks and trims
the message), tools or documents not given as objects, a keyword argument that names one of transformers' own
parameters, and a transformers without the compile this path builds on.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gateway.guard.counting.chatformat import PreparedChat

if TYPE_CHECKING:
    from jinja2 import Template
    from transformers import PreTrainedTokenizerBase

# apply_chat_template's own parameters that this path hands to the template the way it does.
_HANDLED = frozenset({"add_generation_prompt", "continue_final_message", "documents"})
_MOST_TEMPLATES = 16  # the model's default, named and tool-use templates: a handful


def named_parameters(tokenizer: PreTrainedTokenizerBase) -> frozenset[str]:
    """The keyword arguments ``apply_chat_template`` binds to its own parameters; every other one reaches the
    template."""
    params = inspect.signature(type(tokenizer).apply_chat_template).parameters
    return frozenset(
        name for name, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD or p.kind is p.KEYWORD_ONLY
    ) - {"self", "conversation", "tools", "chat_template", "tokenize"}


class ChatRenderer:
    """``render(prepared)`` is ``tokenizer.apply_chat_template(prepared.conversation, tools=prepared.tools,
    chat_template=prepared.chat_template, tokenize=False, **prepared.kwargs)``."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._compile, rendered_with = _transformers_compile()
        # A keyword argument named like one of these is bound, or refused, by transformers' own calls.
        self._bound = (named_parameters(tokenizer) | rendered_with | {"messages"}) - _HANDLED
        self._special: dict[str, Any] = dict(tokenizer.special_tokens_map)
        self._compiled: dict[str, Template] = {}

    def render(self, prepared: PreparedChat) -> Any:
        """The text; whatever the template raises propagates, as apply_chat_template's would."""
        conversation, tools, kwargs = prepared.conversation, prepared.tools, prepared.kwargs
        bound = self._bound
        if (
            self._compile is None
            or not conversation or not isinstance(conversation[0], dict)
            or not _objects_or_none(tools) or not _objects_or_none(kwargs.get("documents"))
            or kwargs.get("continue_final_message")
            or any(k in bound for k in kwargs)
        ):
            return self._tokenizer.apply_chat_template(
                conversation, tools=tools, chat_template=prepared.chat_template,  # type: ignore[arg-type]
                tokenize=False, **kwargs,
            )
        rest = {k: v for k, v in kwargs.items() if k not in _HANDLED}
        return self._template(prepared.chat_template).render(
            messages=conversation, tools=None if tools is None else list(tools), documents=kwargs.get("documents"),
            add_generation_prompt=kwargs.get("add_generation_prompt", False), **{**self._special, **rest},
        )

    def _template(self, source: str) -> Template:
        found = self._compiled.get(source)
        if found is None:
            if len(self._compiled) >= _MOST_TEMPLATES:
                self._compiled.clear()
            assert self._compile is not None
            found = self._compiled[source] = recompiled(self._compile(source), source)
        return found


def recompiled(compiled: Template, source: str) -> Template:
    """``source`` compiled again on an overlay of ``compiled``'s environment (every option, filter, global, test
    and extension as transformers set them), with two costs taken off that change no result:

    - the attribute-safety check remembered per (type, name), where the environment is jinja's immutable sandbox
      with jinja's own check, whose answer depends on nothing else (``remembered``);
    - the template's globals held in a plain dict instead of jinja's ``ChainMap`` over the environment's: every
      render copies them into its context, and the copy of a ``ChainMap`` walks it in Python (~14 us a render,
      measured; 38.8 against 52.5 us a short chat). Nothing changes them after the compile: the environment is
      this renderer's own.
    """
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = compiled.environment.overlay()
    if type(env) is ImmutableSandboxedEnvironment:
        env.is_safe_attribute = remembered(env.is_safe_attribute)  # type: ignore[method-assign,assignment]
    template = env.from_string(source)
    template.globals = dict(template.globals)
    return template


def remembered(check: Callable[[Any, str, Any], bool]) -> Callable[[Any, str, Any], bool]:
    """``check(obj, attr, value)`` answered once per (type of ``obj``, ``attr``). Bounded: jinja asks only of an
    attribute ``getattr`` found on the object, named in the template's own text (``obj.name``) or, for ``obj[key]``,
    only when the object has no such item; so the names are the attributes of a handful of types (JSON's dicts,
    lists and strings, the template's namespaces and loops), never the keys of a request's data."""
    known: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        safe = known.get(key)
        if safe is None:
            safe = known[key] = check(obj, attr, value)
        return safe

    return is_safe_attribute


def _objects_or_none(value: Any) -> bool:
    return value is None or (isinstance(value, list) and all(isinstance(v, dict) for v in value))


def _transformers_compile() -> tuple[Callable[[str], Template] | None, frozenset[str]]:
    """transformers' compile of a chat template (vLLM's own code imports it too), and the parameters of the
    function that renders with it."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template
    except ImportError:  # a transformers without them renders through apply_chat_template alone
        return None, frozenset()
    compile_template: Callable[[str], Template] = _compile_jinja_template
    return compile_template, frozenset(inspect.signature(render_jinja_template).parameters) - {"kwargs"}
