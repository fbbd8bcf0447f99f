"""docker-compose.yml and .env.example: valid against the Compose Specification schema (vendored, offline),
wired the way docs/deploy.md says, and speaking only the gateway's real setting names."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import jsonschema
import pytest
import yaml

from gateway.config import ENV_PREFIX, Settings
from gateway.settings_sources import build_settings
from tests.support.paths import ROOT

SCHEMA = json.loads((ROOT / "tests/fixtures/compose-spec.json").read_text(encoding="utf-8"))
GATEWAYS = ("guard", "guard-managed")


def env_example(include_commented: bool = False) -> dict[str, str]:
    """KEY=VALUE lines of .env.example; commented-out ones (`# KEY=VALUE`) too when asked."""
    pattern = r"^(?:#\s*)?([A-Z][A-Z0-9_]*)=(.*)$" if include_commented else r"^([A-Z][A-Z0-9_]*)=(.*)$"
    lines = (ROOT / ".env.example").read_text(encoding="utf-8").splitlines()
    return {m.group(1): m.group(2) for m in (re.match(pattern, line) for line in lines) if m}


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution: $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, $$."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group("braced") or m.group("plain"), m.group("op"), m.group("arg") or ""
        current = env.get(name)
        if op in (":-", "-"):
            return current if current or (op == "-" and current is not None) else arg
        if current is None or (op == ":?" and not current):
            raise KeyError(f"${{{name}}} is not set ({arg or 'no default'})")
        return current

    return re.sub(r"\$\$|\$\{(?P<braced>\w+)(?:(?P<op>:-|-|:\?|\?)(?P<arg>[^}]*))?\}|\$(?P<plain>\w+)", sub, value)


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))
    return doc


@pytest.fixture(scope="module")
def compose(raw: dict[str, Any]) -> dict[str, Any]:
    resolved: dict[str, Any] = interpolate(raw, env_example())
    return resolved


def schema_errors(doc: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft201909Validator(SCHEMA)
    return [f"{e.json_path}: {e.message}" for e in validator.iter_errors(doc)]


# -- schema ---------------------------------------------------------------------------------------
def test_compose_file_is_valid_against_the_compose_specification(compose: dict[str, Any]) -> None:
    assert schema_errors(compose) == []


def _set(doc: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for p in parents:
        doc = doc[p]
    doc[last] = value


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("services.vllm.deploy.resources.reservations.gpus", 1),
        ("services.guard.depends_on.vllm.condition", "service_ready"),
        ("services.guard.healthcheck.intervall", "5s"),
        ("networks.backend.internal", "yes"),
        ("services.vllm.ports", "8000:8000"),
    ],
)
def test_the_schema_check_catches_a_broken_compose_file(compose: dict[str, Any], path: str, value: Any) -> None:
    broken = copy.deepcopy(compose)
    _set(broken, path, value)
    assert schema_errors(broken) != []


def test_every_variable_the_compose_file_needs_is_in_env_example(raw: dict[str, Any]) -> None:
    interpolate(raw, env_example())  # raises on a ${VAR} without default that .env.example lacks
    with pytest.raises(KeyError, match="MODEL"):
        interpolate(raw, {k: v for k, v in env_example().items() if k != "MODEL"})


# -- setting names ----------------------------------------------------------------------------------
def _compose_guard_names(raw: dict[str, Any]) -> set[str]:
    names = set()
    for svc in raw["services"].values():
        names |= {k for k in (svc.get("environment") or {}) if k.startswith(ENV_PREFIX)}
    text = (ROOT / "docker-compose.yml").read_text(encoding="utf-8")
    return names | set(re.findall(r"\$\{(" + ENV_PREFIX + r"\w+?)(?::?[-?][^}]*)?\}", text))


# Names compose itself uses that share the prefix but are not gateway settings.
NOT_SETTINGS = {"VLLM_GUARD_IMAGE_TAG"}


def unknown_settings(names: set[str]) -> set[str]:
    return {n for n in names - NOT_SETTINGS if n.removeprefix(ENV_PREFIX).lower() not in Settings.model_fields}


@pytest.mark.parametrize("source", ["docker-compose.yml", ".env.example"])
def test_every_vllm_guard_variable_is_a_real_setting(raw: dict[str, Any], source: str) -> None:
    names = _compose_guard_names(raw) if source == "docker-compose.yml" else {
        k for k in env_example(include_commented=True) if k.startswith(ENV_PREFIX)}
    assert names
    assert unknown_settings(names) == set()


def test_a_misspelt_setting_name_is_caught() -> None:
    assert unknown_settings({"VLLM_GUARD_KV_TARGETS", "VLLM_GUARD_KV_TARGET"}) == {"VLLM_GUARD_KV_TARGETS"}


@pytest.mark.parametrize("service", GATEWAYS)
def test_each_gateway_service_gets_valid_settings_from_env_example_and_compose(
    compose: dict[str, Any], service: str
) -> None:
    env = {**env_example(), **{k: str(v) for k, v in compose["services"][service]["environment"].items()}}
    settings = build_settings({}, None, env)
    assert settings.port == 8080 and settings.host == "0.0.0.0"
    if service == "guard":
        assert settings.upstream == ["http://vllm:8000"] and not settings.managed
    else:
        assert settings.managed and settings.model == env_example()["MODEL"]


def test_commented_settings_in_env_example_are_valid_when_uncommented() -> None:
    env = {k: v for k, v in env_example(include_commented=True).items() if k.startswith(ENV_PREFIX)}
    env["VLLM_GUARD_MODEL"] = "m"
    assert build_settings({}, None, env).max_model_len is not None


# -- wiring ---------------------------------------------------------------------------------------
def _published(svc: dict[str, Any]) -> list[str]:
    return [str(p) for p in svc.get("ports", [])]


def test_only_the_gateway_is_published_beyond_loopback(compose: dict[str, Any]) -> None:
    for name, svc in compose["services"].items():
        for port in _published(svc):
            if name in GATEWAYS:
                assert port.endswith(":8080") and not port.startswith("127.0.0.1:")
            else:
                assert port.startswith("127.0.0.1:"), f"{name} publishes {port} to every interface"
    assert "ports" not in compose["services"]["vllm"]


def test_vllm_sits_on_the_internal_network_with_a_gpu(compose: dict[str, Any]) -> None:
    vllm = compose["services"]["vllm"]
    assert compose["networks"]["backend"]["internal"] is True and "backend" in vllm["networks"]
    # Besides the internal network, only the egress one (outbound downloads, nothing published).
    assert set(vllm["networks"]) == {"backend", "egress"}
    for name in ("vllm", "guard-managed"):
        device = compose["services"][name]["deploy"]["resources"]["reservations"]["devices"][0]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and int(device["count"]) >= 1
    assert vllm["image"].startswith("vllm/vllm-openai:v")


def test_the_gateway_waits_for_a_healthy_vllm_and_everything_has_a_healthcheck(compose: dict[str, Any]) -> None:
    assert compose["services"]["guard"]["depends_on"]["vllm"]["condition"] == "service_healthy"
    assert compose["services"]["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    for name, svc in compose["services"].items():
        assert svc["healthcheck"]["test"][0] == "CMD", name
    for name in ("vllm", *GATEWAYS):
        assert any("/health" in part for part in compose["services"][name]["healthcheck"]["test"]), name


def test_the_modes_are_profiles_chosen_in_env_example(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["vllm"]["profiles"] == services["guard"]["profiles"] == ["proxy"]
    assert services["guard-managed"]["profiles"] == ["managed"]
    assert services["guard-managed"]["command"] == ["serve", "--managed"]
    assert services["guard-managed"]["build"]["dockerfile"] == "Dockerfile.managed"
    assert env_example()["COMPOSE_PROFILES"] in {"proxy", "managed"}
    assert all("profiles" not in services[s] for s in ("prometheus", "grafana"))


def test_prometheus_scrapes_the_gateway_by_the_alias_both_modes_share(compose: dict[str, Any]) -> None:
    prom = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text(encoding="utf-8"))
    target = next(j for j in prom["scrape_configs"] if j["job_name"] == "vllm-guard")["static_configs"][0]
    host, port = target["targets"][0].split(":")
    for name in GATEWAYS:
        svc = compose["services"][name]
        assert host in svc["networks"]["backend"]["aliases"], name
        assert svc["environment"]["VLLM_GUARD_PORT"] == port
    assert "backend" in compose["services"]["prometheus"]["networks"]
    mounts = [v.split(":")[0] for v in compose["services"]["prometheus"]["volumes"]]
    assert {"./deploy/prometheus.yml", "./deploy/alerts.yml"} <= set(mounts)
    assert all((ROOT / m).exists() for m in mounts if m.startswith("./"))


def test_the_proxy_mode_gateway_outweighs_vllm_for_the_cpu(compose: dict[str, Any]) -> None:
    # vLLM's spinning processes starve a gateway of equal weight in a group of its own (docs/deploy.md).
    services = compose["services"]
    assert services["guard"].get("cpu_shares", 1024) >= 4 * services["vllm"].get("cpu_shares", 1024)
