"""deploy/k8s: every manifest valid against the Kubernetes API schemas (shipped by kubernetes-validate, no
download), and the pod wired as docs/deploy.md says: vLLM on loopback, the gateway probed on /health,
scraped by annotation, configured by real setting names."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from gateway.config import ENV_PREFIX, Settings
from gateway.settings_sources import build_settings
from tests.support.paths import ROOT

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate not installed (part of the test extra)"
)

K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30.0"
MANIFESTS = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def load(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((K8S / name).read_text(encoding="utf-8"))
    return doc


def validate(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def containers() -> dict[str, dict[str, Any]]:
    spec = load("deployment.yaml")["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec["containers"]}


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_manifest_is_valid_against_the_kubernetes_schema(manifest: str) -> None:
    validate(load(manifest))


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(
            lambda d: d["spec"]["template"]["spec"]["containers"][1]["readinessProbe"]["httpGet"].update(paht="/"),
            id="unknown field"),
        pytest.param(lambda d: d["spec"].update(replicas="one"), id="wrong type"),
        pytest.param(lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("name"), id="missing name"),
    ],
)
def test_the_schema_check_catches_a_broken_deployment(mutate: Any) -> None:
    broken = copy.deepcopy(load("deployment.yaml"))
    mutate(broken)
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken)


def test_kustomization_applies_every_manifest() -> None:
    assert sorted(load("kustomization.yaml")["resources"]) == MANIFESTS


def test_the_gateway_is_probed_on_health_and_scraped_by_annotation() -> None:
    pod = load("deployment.yaml")["spec"]["template"]
    guard = containers()["guard"]
    port = next(p for p in guard["ports"] if p["name"] == "http")["containerPort"]
    for probe in ("startupProbe", "readinessProbe"):
        assert guard[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    # /health answers 503 while the upstream is down; restarting the gateway would not help, so liveness
    # only asks whether the gateway's socket answers.
    assert guard["livenessProbe"]["tcpSocket"]["port"] == "http"
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port) and annotations["prometheus.io/path"] == "/metrics"
    assert guard["securityContext"]["runAsNonRoot"] is True


def test_vllm_listens_on_loopback_with_a_gpu_and_the_service_exposes_only_the_gateway() -> None:
    vllm = containers()["vllm"]
    assert "--host=127.0.0.1" in vllm["args"] and "ports" not in vllm
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert vllm["image"].startswith("vllm/vllm-openai:v")
    vllm_port = next(a.split("=")[1] for a in vllm["args"] if a.startswith("--port="))
    upstream = next(e["value"] for e in containers()["guard"]["env"] if e["name"] == "VLLM_GUARD_UPSTREAM")
    assert upstream == f"http://127.0.0.1:{vllm_port}"
    service = load("service.yaml")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    pod_labels = load("deployment.yaml")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_settings_from_configmap_secret_and_pod_are_real_and_valid() -> None:
    env = {**load("configmap.yaml")["data"], **load("secret.yaml")["stringData"]}
    env |= {e["name"]: e.get("value", "") for e in containers()["guard"]["env"] if "value" in e}
    names = {k for k in env if k.startswith(ENV_PREFIX)}
    assert {n for n in names if n.removeprefix(ENV_PREFIX).lower() not in Settings.model_fields} == set()
    settings = build_settings({}, None, {k: str(v) for k, v in env.items()})
    assert settings.port == 8080 and settings.api_key == ["replace-me"]


def test_every_configmap_and_secret_key_the_pod_reads_exists() -> None:
    keys = {"vllm-guard-settings": set(load("configmap.yaml")["data"]),
            "vllm-guard-secrets": set(load("secret.yaml")["stringData"])}
    for container in containers().values():
        for e in container.get("env", []):
            ref = e.get("valueFrom", {})
            ref = ref.get("configMapKeyRef") or ref.get("secretKeyRef")
            if ref:
                assert ref["key"] in keys[ref["name"]], (container["name"], e["name"])
        for source in container.get("envFrom", []):
            ref = source.get("configMapRef") or source.get("secretRef")
            assert ref["name"] in keys


def test_the_in_cluster_scrape_config_keeps_the_job_name_the_alerts_expect() -> None:
    config = yaml.safe_load((K8S / "prometheus-scrape.yml").read_text(encoding="utf-8"))
    job = config["scrape_configs"][0]
    assert job["job_name"] == "vllm-guard"
    address = next(r for r in job["relabel_configs"] if r.get("target_label") == "__address__")
    joined = "10.1.2.3:8000;8080"
    match = re.fullmatch(address["regex"], joined)
    assert match is not None
    assert match.expand(address["replacement"].replace("$", "\\")) == "10.1.2.3:8080"


def test_the_in_cluster_scrape_config_passes_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (scripts/install-prometheus.sh)")
    result = subprocess.run([promtool, "check", "config", "--syntax-only", str(K8S / "prometheus-scrape.yml")],
                            capture_output=True, text=True, timeout=60, check=False)
    if "kubernetes_sd_configs not found" in result.stdout + result.stderr:
        pytest.skip("this promtool is built without Kubernetes service discovery (Debian's package)")
    assert result.returncode == 0, result.stdout + result.stderr
