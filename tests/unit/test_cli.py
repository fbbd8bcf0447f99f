from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import _field_flag, build_parser, main, parse_serve
from gateway.config import Settings

# Every flag's documentation is generated from the Settings: tests/docs/ checks the configuration reference.
FIELDS = [name for name in Settings.model_fields if name != "vllm_args"]


def test_serve_help_explains_every_flag() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    text = serve.format_help()
    for name in FIELDS:
        assert _field_flag(name) in text


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["serve", "--upstream", "http://h:1", "--kv-target", "0.5"], {}, {
            "upstream": ["http://h:1"], "kv_target": 0.5,
        }),
        (
            ["serve", "--upstream", "http://h:1", "--upstream", "http://h:2/"], {},
            {"upstream": ["http://h:1", "http://h:2"]},
        ),
        (["serve"], {"VLLM_GUARD_UPSTREAM": "http://h:1,http://h:2"}, {"upstream": ["http://h:1", "http://h:2"]}),
        (["serve", "--api-key", "a", "--api-key", "b=3"], {}, {"api_key": ["a", "b=3"]}),
        (["serve"], {"VLLM_GUARD_MAX_QUEUE": "9"}, {"max_queue": 9}),
        (["serve", "--max-queue", "4"], {"VLLM_GUARD_MAX_QUEUE": "9"}, {"max_queue": 4}),
        (
            ["serve", "--managed", "--model", "m", "--", "--dtype", "float32", "--max-num-seqs", "8"],
            {},
            {"managed": True, "model": "m", "vllm_args": ["--dtype", "float32", "--max-num-seqs", "8"]},
        ),
        (["serve", "--on-prompt-overflow", "truncate"], {}, {"on_prompt_overflow": "truncate"}),
        (["serve"], {}, {"ttft_objective": "auto", "queue_timeout": 300.0}),
        (["serve", "--ttft-objective", "5"], {}, {"ttft_objective": 5.0}),
        (["serve", "--ttft-objective", "off"], {}, {"ttft_objective": "off"}),
        (["serve"], {"VLLM_GUARD_TTFT_OBJECTIVE": "2.5"}, {"ttft_objective": 2.5}),
    ],
)
def test_serve_flags_build_the_settings(argv: list[str], env: dict[str, str], expected: dict[str, object]) -> None:
    settings = parse_serve(argv, env)
    for key, value in expected.items():
        assert getattr(settings, key) == value


@pytest.mark.parametrize(
    ("argv", "engines", "devices", "every"),
    [
        (["--managed-engines", "2"], 2, [], None),
        (["--engine-devices", "0;1"], 2, ["0", "1"], None),
        (["--engine-devices", "0,1; 2,3", "--managed-engines", "2"], 2, ["0,1", "2,3"], None),
        (["--engine-devices", "3"], 1, ["3"], None),
        (["--restart-every", "6h"], 1, [], 21600.0),
        (["--restart-every", "1h30m"], 1, [], 5400.0),
        (["--restart-every", "90"], 1, [], 90.0),
        (["--restart-every", "1d"], 1, [], 86400.0),
    ],
)
def test_managed_engines_their_devices_and_the_restart_period_come_from_flags(
    argv: list[str], engines: int, devices: list[str], every: float | None
) -> None:
    settings = parse_serve(["serve", "--managed", "--model", "m", *argv], {})
    assert (settings.engine_count(), settings.device_groups(), settings.restart_every) == (engines, devices, every)


def test_the_restart_period_and_devices_come_from_the_environment_too() -> None:
    env = {"VLLM_GUARD_RESTART_EVERY": "30m", "VLLM_GUARD_ENGINE_DEVICES": "0;1"}
    settings = parse_serve(["serve", "--managed", "--model", "m"], env)
    assert (settings.restart_every, settings.engine_count()) == (1800.0, 2)


def test_a_config_file_is_read_and_flags_win(tmp_path: Path) -> None:
    cfg = tmp_path / "guard.yaml"
    cfg.write_text("max-queue: 3\nport: 9000\n")
    settings = parse_serve(["serve", "--config", str(cfg), "--port", "9100"], {})
    assert (settings.max_queue, settings.port) == (3, 9100)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["serve", "--kv-target", "3"], "--kv-target"),
        (["serve", "--managed"], "--managed needs --model"),
        (["serve", "--upstream", "localhost:8000"], "http(s) URL"),
        (["serve", "--upstream", "http://h:1", "--upstream", "http://h:1"], "the same server twice"),
        (["serve", "--managed", "--model", "m", "--upstream", "http://h:1", "--upstream", "http://h:2"],
         "runs its own engines (--managed-engines)"),
        (["serve", "--managed", "--model", "m", "--managed-engines", "3", "--engine-devices", "0;1"],
         "--managed-engines is 3 but --engine-devices names 2 engines"),
        (["serve", "--restart-every", "6h"], "need --managed"),
        (["serve", "--managed", "--model", "m", "--restart-every", "6 hours"], "not a duration: '6 hours'"),
        (["serve", "--managed", "--model", "m", "--restart-every", "0"], "--restart-every"),
        (["serve", "--ttft-objective", "sometimes"], "--ttft-objective"),
        (["serve", "--ttft-objective", "0"], "--ttft-objective"),
    ],
)
def test_invalid_settings_exit_2_with_a_clear_message(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert words in capsys.readouterr().err


def test_an_unknown_choice_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--on-prompt-overflow", "drop"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["plan", "doctor"])
def test_plan_and_doctor_have_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert "usage: vllm-guard " + command in capsys.readouterr().out
