"""The chat renderer gives apply_chat_template's text and errors, for every case the counting tests send."""

from __future__ import annotations

import copy
from typing import Any

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from gateway.guard.counting.chatformat import PreparedChat, prepare_chat
from gateway.guard.counting.rendering import ChatRenderer, remembered
from tests.unit.guard.counting.chats import TOOLS, U
from tests.unit.guard.counting.test_local import CHAT_BODIES

# Templates that read what the tiny model's does not: methods, filters, loops' state, namespaces, the date.
METHODS = (
    "{%- set ns = namespace(n=0) -%}"
    "{%- for m in messages -%}{%- set ns.n = ns.n + 1 -%}"
    "{{ m.role | upper }}:{{ (m.content if m.content is string else m.content | map(attribute='text') | join(''))"
    ".strip().replace('a', 'A') }}{% if not loop.last %}|{% endif %}"
    "{%- endfor -%}#{{ ns.n }}/{{ messages | length }}{{ tools | tojson if tools }}"
    "{%- if add_generation_prompt %}>{{ eos_token }}{% endif %}{{ strftime_now('%Y') | length }}"
)
KWARGS = (
    "{{ enable_thinking }}{{ custom | default('none') }}{{ documents | tojson }}{{ bos_token }}"
    "{{ messages[0].content }}"
)
RAISES = "{{ raise_exception('no: ' ~ messages[0].role) }}"
UNSAFE = "{{ messages.append(1) }}"
UNDERSCORE = "{{ messages[0]._private is defined }}{{ messages.__class__ is defined }}{{ messages.pop is defined }}"


def apply(tokenizer: Any, prepared: PreparedChat) -> Any:
    return tokenizer.apply_chat_template(
        prepared.conversation, tools=prepared.tools, chat_template=prepared.chat_template, tokenize=False,
        **prepared.kwargs,
    )


def outcome(render: Any, prepared: PreparedChat) -> tuple[str, str]:
    """What rendering gives: its text, or its error's type and message."""
    try:
        return "text", render(copy.deepcopy(prepared))
    except Exception as exc:  # templates raise anything; the two must raise the same
        return type(exc).__name__, str(exc)


@pytest.fixture(scope="module")
def renderer(tokenizer: Any) -> ChatRenderer:
    return ChatRenderer(tokenizer)


@pytest.mark.parametrize("template", [None, METHODS, KWARGS], ids=["the model's", "methods", "keywords"])
@pytest.mark.parametrize(("case", "body"), CHAT_BODIES, ids=[c for c, _ in CHAT_BODIES])
def test_every_chat_renders_as_apply_chat_template_renders_it(
    renderer: ChatRenderer, tokenizer: Any, template: str | None, case: str, body: dict[str, Any]
) -> None:
    prepared = prepare_chat(body, template or tokenizer.get_chat_template(None))
    assert outcome(renderer.render, prepared) == outcome(lambda p: apply(tokenizer, p), prepared)


@pytest.mark.parametrize(
    ("case", "template", "body"),
    [
        ("a template that raises", RAISES, {"messages": [U]}),
        ("a mutating method the sandbox refuses", UNSAFE, {"messages": [U]}),
        ("private and mutating attributes tested", UNDERSCORE, {"messages": [U]}),
        ("a keyword transformers binds itself", KWARGS,
         {"messages": [U], "chat_template_kwargs": {"conversations": 1}}),
        ("a keyword apply_chat_template binds", KWARGS,
         {"messages": [U], "chat_template_kwargs": {"return_assistant_tokens_mask": True}}),
        ("tools given in the keywords as an object", METHODS,
         {"messages": [U], "chat_template_kwargs": {"tools": {"a": 1}}}),
        ("a custom keyword", KWARGS, {"messages": [U], "chat_template_kwargs": {"custom": "yes", "bos_token": "B"}}),
        ("a continued final message", METHODS,
         {"messages": [U, {"role": "assistant", "content": "It is"}], "add_generation_prompt": False,
          "continue_final_message": True}),
    ],
)  # fmt: skip
def test_errors_and_edges_are_apply_chat_templates_own(
    renderer: ChatRenderer, tokenizer: Any, case: str, template: str, body: dict[str, Any]
) -> None:
    prepared = prepare_chat(body, template)
    assert outcome(renderer.render, prepared) == outcome(lambda p: apply(tokenizer, p), prepared)


def test_a_plain_chat_is_rendered_without_apply_chat_template(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    renderer = ChatRenderer(tokenizer)
    prepared = prepare_chat({"messages": [U], "tools": TOOLS}, tokenizer.get_chat_template(None))
    expected = apply(tokenizer, prepared)
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda *a, **k: pytest.fail("the slow path was taken"))
    assert renderer.render(prepared) == expected


def test_a_continued_final_message_is_left_to_apply_chat_template(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    renderer = ChatRenderer(tokenizer)
    body = {"messages": [U, {"role": "assistant", "content": "It is"}], "add_generation_prompt": False,
            "continue_final_message": True}  # fmt: skip
    prepared = prepare_chat(body, tokenizer.get_chat_template(None))
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda *a, **k: "by transformers")
    assert renderer.render(prepared) == "by transformers"


# -- the remembered safety check ----------------------------------------------------------------------
OBJECTS = [{}, {"a": 1}, [], [1], "", "text", 1, 2.5, None, (), jinja2.utils.Namespace(x=1), len, str.upper,
           ImmutableSandboxedEnvironment, iter([]), set(), {1}]  # fmt: skip
NAMES = ["append", "pop", "update", "keys", "items", "get", "strip", "upper", "format", "x", "__class__", "_x",
         "__globals__", "mro", "gi_frame", "real", "add", "clear", "__len__", "__doc__"]  # fmt: skip


def test_jinjas_check_depends_only_on_the_type_and_the_name() -> None:
    """What remembering per (type, name) relies on, checked against the installed jinja."""
    check = ImmutableSandboxedEnvironment().is_safe_attribute
    twins = [({}, {"b": 2}), ([], [1, 2]), ("", "other"), (1, 7), (set(), {2}), ((), (1,))]
    for a, b in twins:
        for name in NAMES:
            assert check(a, name, None) == check(b, name, object()), (type(a), name)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(range(len(OBJECTS))), st.sampled_from(NAMES)), max_size=40))
def test_the_remembered_check_answers_as_jinjas_in_any_order(calls: list[tuple[int, str]]) -> None:
    check = ImmutableSandboxedEnvironment().is_safe_attribute
    fast = remembered(check)
    for i, name in calls:
        obj = OBJECTS[i]
        assert fast(obj, name, None) == check(obj, name, None)


def test_an_unsafe_attribute_still_fails_as_the_sandbox_fails(renderer: ChatRenderer) -> None:
    prepared = prepare_chat({"messages": [U]}, UNSAFE)
    with pytest.raises(SecurityError):
        renderer.render(prepared)
