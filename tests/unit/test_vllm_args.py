"""vLLM's own arguments: every spelling of a flag vLLM accepts is read, the last one wins, and a flag is replaced
whatever its spelling."""

from __future__ import annotations

import pytest

from gateway.vllm_args import arg_value, with_arg


@pytest.mark.parametrize(
    ("args", "name", "value"),
    [
        (["--max-model-len", "4096"], "--max-model-len", "4096"),
        (["--max-model-len=4096"], "--max-model-len", "4096"),
        (["--max_model_len", "4096"], "--max-model-len", "4096"),
        (["--max-model-len", "1", "--max-model-len", "2"], "--max-model-len", "2"),
        (["--dtype", "float32"], "--max-model-len", None),
        (["--max-model-len"], "--max-model-len", None),
    ],
)
def test_arg_value_reads_every_spelling_vllm_accepts(args: list[str], name: str, value: str | None) -> None:
    assert arg_value(args, name) == value


@pytest.mark.parametrize(
    "args",
    [["--max-model-len", "32768", "--dtype", "float32"], ["--max_model_len=32768", "--dtype", "float32"]],
)
def test_with_arg_replaces_the_old_value(args: list[str]) -> None:
    assert with_arg(args, "--max-model-len", "3968") == ["--dtype", "float32", "--max-model-len", "3968"]
