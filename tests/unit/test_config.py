from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.config import Settings
from gateway.settings_sources import build_settings, load_config_file


def test_defaults_are_valid_and_match_the_design() -> None:
    s = Settings()
    assert (s.on_prompt_overflow, s.on_max_tokens_overflow, s.admission_policy) == ("reject", "clamp", "adaptive")
    assert s.upstream == ["http://127.0.0.1:8000"] and s.port == 8080


def test_flags_beat_environment_which_beats_the_file() -> None:
    s = build_settings(
        {"port": 9001},
        {"port": 9002, "kv_target": 0.5, "max_queue": 3},
        {"VLLM_GUARD_PORT": "9003", "VLLM_GUARD_KV_TARGET": "0.7"},
    )
    assert (s.port, s.kv_target, s.max_queue) == (9001, 0.7, 3)


@pytest.mark.parametrize(
    ("env", "field", "expected"),
    [
        ({"VLLM_GUARD_API_KEY": "a, b=5"}, "api_key", ["a", "b=5"]),
        ({"VLLM_GUARD_API_KEY": '["x", "y"]'}, "api_key", ["x", "y"]),
        (
            {"VLLM_GUARD_VLLM_ARGS": "--dtype float32 --enforce-eager"},
            "vllm_args",
            ["--dtype", "float32", "--enforce-eager"],
        ),
        ({"VLLM_GUARD_MANAGED": "true", "VLLM_GUARD_MODEL": "m"}, "managed", True),
        ({"VLLM_GUARD_ON_PROMPT_OVERFLOW": "truncate"}, "on_prompt_overflow", "truncate"),
    ],
)
def test_every_field_is_settable_from_the_environment(env: dict[str, str], field: str, expected: object) -> None:
    assert getattr(build_settings({}, None, env), field) == expected


@pytest.mark.parametrize(
    "values",
    [
        {"kv_target": 0},
        {"kv_target": 1.5},
        {"port": 0},
        {"on_prompt_overflow": "drop"},
        {"upstream": "localhost:8000"},
        {"managed": True},
        {"max_prompt_tokens": 4096, "max_model_len": 2048},
        {"no_such_flag": 1},
    ],
)
def test_absurd_values_are_refused(values: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        build_settings(values)


@pytest.mark.parametrize(("stretch", "refused"), [(0, False), (0.5, True), (0.99, True), (1, False), (4, False),
                                                   (100, False), (101, True), (-1, True)])
def test_a_starved_stretch_is_off_or_at_least_the_timeout_itself(stretch: float, refused: bool) -> None:
    if not refused:
        assert build_settings({"starved_stretch": stretch}).starved_stretch == stretch
        return
    with pytest.raises(ValidationError, match="starved"):
        build_settings({"starved_stretch": stretch})


@pytest.mark.parametrize(
    ("keys", "expected"), [(["a"], {"a": 0}), (["a=3", "b"], {"a": 3, "b": 0}), (["x=y"], {"x=y": 0})]
)
def test_api_keys_may_carry_a_default_priority(keys: list[str], expected: dict[str, int]) -> None:
    assert build_settings({"api_key": keys}).key_priorities() == expected


def test_an_api_keys_priority_past_the_range_is_refused_at_the_start() -> None:
    with pytest.raises(ValidationError, match="the priority of an --api-key must be an integer from -2147483647"):
        build_settings({"api_key": ["a=" + "9" * 40]})


def test_the_keys_priorities_are_worked_out_once_and_again_for_a_copy_with_other_keys() -> None:
    settings = build_settings({"api_key": ["a=3"]})
    assert settings.key_priorities() is settings.key_priorities()
    with pytest.raises(TypeError):
        settings.key_priorities()["b"] = 1  # type: ignore[index]
    assert settings.model_copy(update={"api_key": ["b=2"]}).key_priorities() == {"b": 2}
    assert settings.model_copy().key_priorities() == {"a": 3}
    assert Settings.model_validate_json(settings.model_dump_json()).key_priorities() == {"a": 3}


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("guard.yaml", "max-queue: 7\nkv_target: 0.5\napi-key: [k1]\n"),
        ("guard.toml", 'max-queue = 7\nkv_target = 0.5\napi-key = ["k1"]\n'),
    ],
)
def test_config_files_in_yaml_or_toml(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    s = build_settings({}, load_config_file(path))
    assert (s.max_queue, s.kv_target, s.api_key) == (7, 0.5, ["k1"])


def test_a_config_file_must_hold_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config_file(path)


def _pool_seconds(client: str) -> float:
    """How long a client keeps an idle connection in its pool by default, read from the installed library where
    it says (httpx, the OpenAI SDK's own limits), else from its documentation."""
    if client == "httpx":
        import httpx

        return float(httpx.Limits().keepalive_expiry or 0.0)
    if client == "the OpenAI SDK":
        from openai._constants import DEFAULT_CONNECTION_LIMITS

        return float(DEFAULT_CONNECTION_LIMITS.keepalive_expiry or 0.0)
    # aiohttp's TCPConnector keepalive_timeout, nginx's upstream keepalive_timeout, Go's DefaultTransport
    return {"aiohttp": 15.0, "nginx upstream": 60.0, "Go net/http": 90.0}[client]


@pytest.mark.parametrize("client", ["httpx", "the OpenAI SDK", "aiohttp", "nginx upstream", "Go net/http"])
def test_the_idle_keep_alive_outlasts_the_clients_pools_so_the_client_always_closes_first(client: str) -> None:
    """A server that closes an idle connection as a client sends on it loses that request (the 5 s default
    raced every pool that keeps connections longer: aiohttp, nginx, Go)."""
    assert Settings().keep_alive_timeout > _pool_seconds(client) > 0
