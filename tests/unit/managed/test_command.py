"""vLLM's command line: the gateway's flags are added, keys are hidden."""

from __future__ import annotations

import sys

import pytest

from gateway.config import Settings
from gateway.managed.command import base_command, engine_args, redact


def test_redact_hides_api_keys() -> None:
    assert redact(["vllm", "--api-key", "sk-1", "--api-key=sk-2"]) == ["vllm", "--api-key", "***", "--api-key=***"]


@pytest.mark.parametrize(
    ("command", "script", "expected"),
    [
        (None, "/venv/bin/vllm", ["/venv/bin/vllm", "serve", "m"]),
        ("/other/bin/python3.11", None, ["/other/bin/python3.11", "-m", "vllm.entrypoints.openai.api_server",
                                         "--model", "m"]),
        ("/other/bin/vllm serve", None, ["/other/bin/vllm", "serve", "m"]),
        ("docker-run-vllm --x {model}", None, ["docker-run-vllm", "--x", "m"]),
        ("python fake.py --fake-scenario ok", None, ["python", "fake.py", "--fake-scenario", "ok", "--model", "m"]),
    ],
)
def test_base_command_follows_the_override_or_the_detected_script(
    command: str | None, script: str | None, expected: list[str]
) -> None:
    settings = Settings.model_validate({"managed": True, "model": "m", "vllm_command": command})
    assert base_command(settings, script) == expected


@pytest.mark.parametrize(
    ("values", "overrides", "expected"),
    [
        ({}, {}, ["--host", "127.0.0.1", "--port", "9000"]),
        (
            {"vllm_args": ["--dtype", "float32", "--port", "1"], "served_model_name": "tiny", "max_model_len": 4096,
             "upstream_api_key": "sk-up"},
            {},
            ["--dtype", "float32", "--served-model-name", "tiny", "--api-key", "sk-up", "--max-model-len", "4096",
             "--host", "127.0.0.1", "--port", "9000"],
        ),
        (
            {"vllm_args": ["--max-model-len", "32768", "--served-model-name", "mine"], "served_model_name": "tiny"},
            {"--max-model-len": "3968"},
            ["--served-model-name", "mine", "--max-model-len", "3968", "--host", "127.0.0.1", "--port", "9000"],
        ),
    ],
)
def test_engine_args_add_the_gateways_settings_the_autofit_and_the_private_address(
    values: dict[str, object], overrides: dict[str, str], expected: list[str]
) -> None:
    settings = Settings.model_validate({"managed": True, "model": "m", **values})
    assert engine_args(settings, overrides, 9000) == expected


def test_without_a_working_script_vllm_starts_through_this_python() -> None:
    settings = Settings.model_validate({"managed": True, "model": "m"})
    assert base_command(settings, None) == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "m"]
