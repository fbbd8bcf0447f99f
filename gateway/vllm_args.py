"""vLLM's own command-line arguments, read and rewritten as vLLM reads them: ``--name value``, ``--name=value`` and
underscores for dashes, the last occurrence winning. Both the settings (vLLM's ``--watermark`` in managed mode) and
managed mode's command line read them."""

from __future__ import annotations

from collections.abc import Sequence


def _spellings(name: str) -> set[str]:
    return {name, name.replace("-", "_").replace("__", "--")}


def arg_value(args: Sequence[str], name: str) -> str | None:
    """The last value of ``--name`` (vLLM also accepts ``--name=v`` and underscores), else None."""
    wanted = _spellings(name)
    value: str | None = None
    for i, a in enumerate(args):
        key, eq, val = a.partition("=")
        if key in wanted:
            if eq:
                value = val
            elif i + 1 < len(args):
                value = args[i + 1]
    return value


def with_arg(args: Sequence[str], name: str, value: str) -> list[str]:
    """``args`` with every ``--name`` removed and ``--name value`` appended."""
    wanted = _spellings(name)
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        key, eq, _ = a.partition("=")
        if key in wanted:
            skip = not eq
            continue
        out.append(a)
    return [*out, name, value]
