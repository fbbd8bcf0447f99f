"""MkDocs hook: the configuration reference, rendered at build time from the command line's parser and the
``Settings`` it is built from, so that the page cannot drift from the code.

``docs/reference/configuration.md`` holds the prose and one marker line; this hook replaces the marker with a
table per group of flags for each subcommand: the flag, its environment variable and config-file key (``serve``
only: ``plan`` and ``doctor`` read flags alone), its type, default and description. The tests import this module
too (``tests/docs/``): ``missing_descriptions()`` names every flag without a help text.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

ROOT = Path(__file__).resolve().parents[2]
# The site describes the tree it is built from, not whichever copy of the package is installed.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pydantic import BaseModel  # noqa: E402
from pydantic.fields import FieldInfo  # noqa: E402

from gateway.cli import _field_flag, build_parser  # noqa: E402
from gateway.config import ENV_PREFIX, Settings  # noqa: E402
from gateway.config_managed import MANAGED_HANG_TIMEOUT  # noqa: E402

PAGE = "reference/configuration.md"
MARKER = "<!-- generated: configuration reference -->"
# "# -- token policy ------" in a Settings class heads the fields below it, up to the next method.
GROUP_COMMENT = re.compile(r"^\s*#\s*--\s*(.+?)\s*-{3,}\s*$")
OTHER = "Other settings"
FLAG_MENTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]")
# Settings fields that are no flag of their own.
NOT_FLAGS = {"vllm_args": "-- ARGS..."}
VLLM_ARGS_KIND = (
    "arguments after `--` on the command line; one shell-quoted line in the environment; a list in the file"
)


@dataclass
class Row:
    anchor: str
    names: list[str]  # flag, then environment variable and config-file key where they exist
    kind: str
    default: str
    help: str


@dataclass
class Group:
    title: str
    rows: list[Row] = field(default_factory=list)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its marker line {MARKER!r}: nothing would show the flags")
    return markdown.replace(MARKER, render())


# -- what there is to document -----------------------------------------------------------------------------


def subcommands() -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each subcommand, in the command line's order."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help or "" for choice in sub._choices_actions}
    return [(name, helps.get(name, ""), p) for name, p in sub.choices.items()]


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def missing_descriptions() -> list[str]:
    """Every flag (and subcommand) without a description, as ``serve --flag``; empty when all have one."""
    missing = [f"serve {_field_flag(n)}" for n, f in Settings.model_fields.items() if not _text(f.description)]
    for name, summary, parser in subcommands():
        if not _text(summary):
            missing.append(name)
        for action in options(parser):
            if action.dest not in Settings.model_fields and not _text(action.help):
                missing.append(f"{name} {action.option_strings[-1]}")
    return missing


def _text(value: str | None) -> bool:
    return bool(value and value.strip() and value.strip() != "None")


# -- serve: the Settings, grouped as their classes group them ----------------------------------------------


def settings_groups() -> list[Group]:
    """Every Settings field once, in groups named by the section comments of the ``config_*`` classes."""
    classes = [Settings, *(c for c in Settings.__mro__[1:] if _is_fields_class(c))]
    groups: dict[str, Group] = {}
    placed: set[str] = set()
    for cls in classes:
        for title, name in _fields_by_comment(cls):
            if name in Settings.model_fields and name not in placed:
                groups.setdefault(title, Group(title)).rows.append(_settings_row(name, Settings.model_fields[name]))
                placed.add(name)
    for name, info in Settings.model_fields.items():
        if name not in placed:  # a field declared where no comment names its group
            groups.setdefault(OTHER, Group(OTHER)).rows.append(_settings_row(name, info))
    ordered = [g for t, g in groups.items() if t != OTHER]
    return ordered + ([groups[OTHER]] if OTHER in groups else [])


def _is_fields_class(cls: type) -> bool:
    return issubclass(cls, BaseModel) and cls.__module__.startswith("gateway.")


def _fields_by_comment(cls: type) -> list[tuple[str, str]]:
    """(group title, field name) in source order. A method ends a group: fields after it are ``OTHER``."""
    lines, _ = inspect.getsourcelines(cls)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out: list[tuple[str, str]] = []
    title, last_end = _class_title(cls), 0
    for stmt in body:
        for line in lines[last_end : stmt.lineno - 1]:
            if match := GROUP_COMMENT.match(line):
                title = match.group(1)[0].upper() + match.group(1)[1:]
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            out.append((title, stmt.target.id))
        elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            title = OTHER
        last_end = stmt.end_lineno or stmt.lineno
    return out


def _class_title(cls: type) -> str:
    doc = inspect.getdoc(cls) if cls.__doc__ else None
    return doc.split("\n")[0].rstrip(".") if doc and cls is not Settings else OTHER


def _settings_row(name: str, info: FieldInfo) -> Row:
    flag = NOT_FLAGS.get(name, _field_flag(name))
    default_text = _value(info.get_default(call_default_factory=True), in_bytes=name.endswith("_bytes"))
    if name == "hang_timeout":  # the one default that follows another setting
        default_text += f"; `{MANAGED_HANG_TIMEOUT}` with `--managed`"
    return Row(
        anchor=f"serve-{name.replace('_', '-')}",
        names=[flag, ENV_PREFIX + name.upper(), name],
        kind=VLLM_ARGS_KIND if name == "vllm_args" else _field_kind(info),
        default=default_text,
        help=info.description or "",
    )


def _field_kind(info: FieldInfo) -> str:
    ann = info.annotation
    optional = type(None) in get_args(ann)
    base = next((a for a in get_args(ann) if a is not type(None)), ann) if optional else ann
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    if extra.get("duration"):
        kind = "duration (seconds, or 90m, 6h, 1d)"
    elif base is bool:
        kind = "switch (true/false in the environment and the file)"
    elif get_origin(base) is list:
        kind = "list, repeatable (comma-separated or a JSON list in the environment)"
    elif get_origin(base) is Literal:
        kind = "one of " + ", ".join(f"`{a}`" for a in get_args(base))
    elif get_origin(base) in (Union, UnionType):
        kind = _union_kind(get_args(base))
    else:
        kind = getattr(base, "__name__", str(base))
    bounds = [_bound(m) for m in info.metadata]
    return ", ".join([kind, *(b for b in bounds if b)])


def _union_kind(forms: tuple[Any, ...]) -> str:
    """``auto``, ``off`` or a number: the words of each form (``Literal`` values, a type with its bounds)."""
    words: list[str] = []
    for form in forms:
        if get_origin(form) is Literal:
            words += [f"`{a}`" for a in get_args(form)]
        elif get_origin(form) is Annotated:
            base, *meta = get_args(form)
            words.append(" ".join([base.__name__, *(b for b in map(_bound, meta) if b)]))
        else:
            words.append(getattr(form, "__name__", str(form)))
    return "one of " + ", ".join(words)


def _bound(meta: Any) -> str:
    for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
        if hasattr(meta, attr):
            return f"{sign} {getattr(meta, attr)}"
    return ""


def _value(value: Any, *, in_bytes: bool = False) -> str:
    if value is None or value == []:
        return "unset"
    if isinstance(value, list):
        return ", ".join(f"`{v}`" for v in value)
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if in_bytes and isinstance(value, int) and value >= 1024 and value % 1024 == 0:
        return f"`{value}` ({_binary(value)})"
    return f"`{value}`"


def _binary(n: int) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        size = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10}[unit]
        if n % size == 0:
            return f"{n // size} {unit}"
    return str(n)


# -- plan, doctor and serve's own options: argparse alone --------------------------------------------------


def parser_rows(command: str, parser: argparse.ArgumentParser) -> list[Row]:
    rows = []
    for action in options(parser):
        if command == "serve" and action.dest in Settings.model_fields:
            continue
        flag = max(action.option_strings, key=len)
        rows.append(
            Row(
                anchor=f"{command}-{flag.lstrip('-')}",
                names=sorted(action.option_strings, key=len, reverse=True),
                kind=_action_kind(action),
                default="required" if action.required else _value(action.default),
                help=action.help or "",
            )
        )
    return rows


def _action_kind(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        return "switch"
    if action.choices:
        return "one of " + ", ".join(f"`{c}`" for c in action.choices)
    kind = getattr(action.type, "__name__", "str") if action.type else "str"
    return f"{kind}, repeatable" if isinstance(action, argparse._AppendAction) else kind


# -- Markdown ----------------------------------------------------------------------------------------------


def render() -> str:
    parts = []
    for name, summary, parser in subcommands():
        about = _link_flags(_escape(parser.description)) if name == "serve" and parser.description else summary
        parts.append(f"## `vllm-guard {name}`\n\n{_sentence(about)}\n")
        if name == "serve":
            for group in settings_groups():
                parts.append(_table(f"### {group.title}", group.rows, settings=True))
            own = parser_rows(name, parser)
            if own:
                parts.append(_table("### Command line only", own, settings=False))
        else:
            parts.append(
                f"`{name}` reads its flags alone: no environment variable, no config file.\n\n"
                + _table("", parser_rows(name, parser), settings=False)
            )
    return "\n".join(parts)


def _sentence(text: str) -> str:
    text = text.strip()
    return (text[0].upper() + text[1:] + ("" if text.endswith(".") else ".")) if text else ""


def _table(heading: str, rows: list[Row], *, settings: bool) -> str:
    head = "| flag · environment variable · config key | default · type | description |" if settings else (
        "| flag | default · type | description |"
    )
    out = [heading, "", head, "| --- | --- | --- |"] if heading else [head, "| --- | --- | --- |"]
    for row in rows:
        first = f'<span id="{row.anchor}"></span>' + "<br>".join(f"`{n}`" for n in row.names)
        help_text = _link_flags(_escape(row.help)) if settings else _escape(row.help)
        out.append(f"| {first} | {_cell(row.default)}<br>{_cell(row.kind)} | {_cell(help_text)} |")
    return "\n".join(out) + "\n"


def _escape(text: str) -> str:
    """Help texts are plain text: what Markdown or HTML would read as markup is shown as written."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")


def _link_flags(text: str) -> str:
    """``--kv-blocks`` in a description links to that flag's row."""
    known = {_field_flag(n): f"serve-{n.replace('_', '-')}" for n in Settings.model_fields if n not in NOT_FLAGS}
    return FLAG_MENTION.sub(lambda m: f"[`{m[0]}`](#{known[m[0]]})" if m[0] in known else m[0], text)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
