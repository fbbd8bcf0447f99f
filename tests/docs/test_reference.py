"""The generated reference pages: every flag has a description (a flag without one is named), every setting is
rendered once, in its group, and help texts are shown as written."""

from __future__ import annotations

import argparse

import pytest

from gateway.cli import _field_flag
from gateway.config import ENV_PREFIX, Settings
from tests.docs.hooks import load_hook

reference = load_hook("config_reference")


def test_every_flag_of_every_subcommand_has_a_description() -> None:
    missing = reference.missing_descriptions()
    assert missing == [], f"flags without a description (help text): {', '.join(missing)}"


def test_a_setting_without_a_description_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Settings.model_fields["max_queue"], "description", None)
    assert reference.missing_descriptions() == ["serve --max-queue"]


def test_a_subcommand_flag_without_a_help_text_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def parser_with_a_bare_flag() -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog="vllm-guard")
        plan = parser.add_subparsers(dest="command").add_parser("plan", help="what fits on a GPU")
        plan.add_argument("--model", help="Model directory.")
        plan.add_argument("--max-num-seqs", type=int)
        return parser

    monkeypatch.setattr(reference, "build_parser", parser_with_a_bare_flag)
    assert reference.missing_descriptions() == ["plan --max-num-seqs"]


def test_every_setting_is_rendered_once_in_a_group() -> None:
    rows = [row for group in reference.settings_groups() for row in group.rows]
    assert sorted(row.names[-1] for row in rows) == sorted(Settings.model_fields)
    by_key = {row.names[-1]: row for row in rows}
    for name in Settings.model_fields:
        assert by_key[name].names[1] == f"{ENV_PREFIX}{name.upper()}"
        assert by_key[name].help == Settings.model_fields[name].description


@pytest.mark.parametrize(
    ("field", "group"),
    [
        ("upstream", "Where things are"),
        ("on_prompt_overflow", "Token policy"),
        ("kv_target", "KV admission"),
        ("max_connections", "Connection limits"),
        ("managed", "Managed mode"),
        ("access_log", "Tracing and the access log"),
    ],
)
def test_settings_are_grouped_as_their_classes_group_them(field: str, group: str) -> None:
    groups = {row.names[-1]: g.title for g in reference.settings_groups() for row in g.rows}
    assert groups[field] == group


@pytest.mark.parametrize(
    ("field", "kind", "default"),
    [
        ("kv_target", "float, > 0.0, ≤ 1.0", "`1.0`"),
        ("on_prompt_overflow", "one of `reject`, `truncate`", "`reject`"),
        ("api_key", "list, repeatable", "unset"),
        ("managed", "switch", "`false`"),
        ("max_body_bytes", "int, ≥ 1024", "`8388608` (8 MiB)"),
        ("restart_every", "duration", "unset"),
        ("fragmentation_growth_mib", "int, ≥ 0", "`2048`"),
        ("hang_timeout", "float, > 0", "`15.0`; `60.0` with `--managed`"),
        ("vllm_args", "arguments after `--`", "unset"),
        ("ttft_objective", "one of `auto`, `off`, float > 0", "`auto`"),
    ],
)
def test_a_row_gives_the_type_with_its_bounds_and_the_default(field: str, kind: str, default: str) -> None:
    row = reference._settings_row(field, Settings.model_fields[field])
    assert row.kind.startswith(kind)
    assert row.default == default


def test_help_texts_are_shown_as_written_and_name_flags_as_links() -> None:
    page = reference.render()
    assert "plain or sha256:&lt;hex&gt;" in page  # --keys-file's help would otherwise lose "<hex>" as a tag
    assert "[`--kv-blocks`](#serve-kv-blocks)" in page
    assert f'<span id="serve-{_field_flag("kv_target").lstrip("-")}"></span>' in page


def test_the_page_without_its_marker_fails_the_build() -> None:
    class Page:
        class file:
            src_uri = reference.PAGE

    with pytest.raises(ValueError, match="marker"):
        reference.on_page_markdown("# Configuration\n", Page())
