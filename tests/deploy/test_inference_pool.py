"""deploy/k8s/inference-pool: the InferencePool, Gateway and HTTPRoute valid against their published CRD schemas
(vendored under tests/deploy/schemas, no download), the picker's configuration made of fields the picker has,
the pieces wired to each other, and the metrics the picker is pointed at really exported by the guard."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import Settings
from testing.gateway_thread import run_gateway
from testing.vllm_sim import SimConfig, run_sim_server
from tests.support.paths import ROOT

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate not installed (part of the test extra)"
)

POOL = ROOT / "deploy" / "k8s" / "inference-pool"
SCHEMAS = Path(__file__).parent / "schemas"
CRDS = {
    ("inference.networking.k8s.io", "InferencePool"): "inference.networking.k8s.io_inferencepools.yaml",
    ("gateway.networking.k8s.io", "Gateway"): "gateway.networking.k8s.io_gateways.yaml",
    ("gateway.networking.k8s.io", "HTTPRoute"): "gateway.networking.k8s.io_httproutes.yaml",
}
MANIFESTS = sorted(p.name for p in POOL.glob("*.yaml") if p.name != "kustomization.yaml")


def documents() -> list[dict[str, Any]]:
    return [d for name in MANIFESTS for d in yaml.safe_load_all((POOL / name).read_text(encoding="utf-8"))]


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in documents() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name)
    return found[0]


def crd_schema(doc: dict[str, Any]) -> dict[str, Any]:
    group, version = doc["apiVersion"].split("/")
    crd = yaml.safe_load((SCHEMAS / CRDS[(group, doc["kind"])]).read_text(encoding="utf-8"))
    served = {v["name"]: v for v in crd["spec"]["versions"]}
    assert version in served and served[version]["served"], f"{doc['kind']} {version} is not served"
    schema: dict[str, Any] = served[version]["schema"]["openAPIV3Schema"]
    return schema


def unknown_fields(doc: Any, schema: dict[str, Any], at: str = "") -> list[str]:
    """Fields the schema does not name: the API server prunes them silently, so they are mistakes."""
    if isinstance(doc, dict) and "properties" in schema:
        out = []
        for key, value in doc.items():
            if key in schema["properties"]:
                out += unknown_fields(value, schema["properties"][key], f"{at}.{key}")
            elif not schema.get("x-kubernetes-preserve-unknown-fields") and key not in ("apiVersion", "kind"):
                out.append(f"{at}.{key}")
        return out
    if isinstance(doc, list) and "items" in schema:
        return [f for i, item in enumerate(doc) for f in unknown_fields(item, schema["items"], f"{at}[{i}]")]
    return []


def validate_custom(doc: dict[str, Any]) -> None:
    schema = crd_schema(doc)
    jsonschema.Draft7Validator(schema).validate(doc)
    unknown = unknown_fields(doc, schema)
    if unknown:
        raise jsonschema.ValidationError(f"fields the schema does not know: {unknown}")


def custom(doc: dict[str, Any]) -> bool:
    return (doc["apiVersion"].split("/")[0], doc["kind"]) in CRDS


@pytest.mark.parametrize(
    "doc", [pytest.param(d, id=f"{d['kind']}/{d['metadata']['name']}") for d in documents()]
)
def test_every_manifest_is_valid_against_its_published_schema(doc: dict[str, Any]) -> None:
    if custom(doc):
        validate_custom(doc)
    else:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)


@pytest.mark.parametrize(
    ("kind", "mutate"),
    [
        pytest.param("InferencePool", lambda d: d["spec"].pop("targetPorts"), id="pool without target ports"),
        pytest.param("InferencePool", lambda d: d["spec"]["targetPorts"][0].update(number="8080"),
                     id="pool port as a string"),
        pytest.param("InferencePool", lambda d: d["spec"].update(targetPort=8080), id="pool with an unknown field"),
        pytest.param("HTTPRoute", lambda d: d["spec"]["rules"][0]["backendRefs"][0].pop("name"),
                     id="route backend without a name"),
        pytest.param("Gateway", lambda d: d["spec"]["listeners"][0].update(protocol=7), id="listener protocol"),
    ],
)
def test_the_schema_check_catches_a_broken_manifest(kind: str, mutate: Any) -> None:
    broken = copy.deepcopy(one(kind))
    mutate(broken)
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(broken)


def test_kustomization_applies_every_manifest() -> None:
    kustomization = yaml.safe_load((POOL / "kustomization.yaml").read_text(encoding="utf-8"))
    assert sorted(kustomization["resources"]) == MANIFESTS


def test_the_pool_targets_the_guard_which_is_probed_on_its_readiness_route_and_drains_on_shutdown() -> None:
    pool = one("InferencePool")["spec"]
    pod = one("Deployment", "vllm-guard-pool")["spec"]["template"]
    assert pool["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    guard = containers["guard"]
    guard_port = next(p["containerPort"] for p in guard["ports"] if p["name"] == "http")
    assert [p["number"] for p in pool["targetPorts"]] == [guard_port]
    assert all("ports" not in c for name, c in containers.items() if name != "guard"), "only the guard is exposed"
    assert guard["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert guard["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
    vllm_stop = containers["vllm"]["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert vllm_stop > guard["lifecycle"]["preStop"]["sleep"]["seconds"], "vLLM must outlive the guard's drain"
    assert pod["spec"]["terminationGracePeriodSeconds"] > vllm_stop


def test_the_route_the_pool_and_the_picker_name_each_other() -> None:
    pool = one("InferencePool")
    route = one("HTTPRoute")["spec"]
    backend = route["rules"][0]["backendRefs"][0]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"],
    )
    assert route["parentRefs"][0]["name"] == one("Gateway")["metadata"]["name"]
    ref = pool["spec"]["endpointPickerRef"]
    service = one("Service", ref["name"])
    assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    epp = one("Deployment", ref["name"])["spec"]["template"]["spec"]["containers"][0]
    assert f"--pool-name={pool['metadata']['name']}" in epp["args"]


def picker_config() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(one("ConfigMap", "vllm-guard-pool-epp")["data"]["config.yaml"])
    return config


def plugin(config: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(p for p in config["plugins"] if p["type"] == kind)


def go_json_fields(source: str, struct: str) -> set[str]:
    """The JSON names of a Go struct's fields, from its ``json:"..."`` tags."""
    match = re.search(rf"\b{struct}\s+struct\s*\{{(.*?)\n\s*\}}", source, re.S)
    assert match is not None, struct
    return {tag.split(",")[0] for tag in re.findall(r'json:"([^"]*)"', match.group(1))} - {""}


def test_the_picker_configuration_uses_only_fields_the_picker_has() -> None:
    config = picker_config()
    types = (SCHEMAS / "endpointpickerconfig_types.go").read_text(encoding="utf-8")
    extractor = (SCHEMAS / "core_metrics_extractor_factories.go").read_text(encoding="utf-8")
    source = (SCHEMAS / "metrics_data_source.go").read_text(encoding="utf-8")
    assert config["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1"
    assert config["kind"] == "EndpointPickerConfig"
    assert set(config) - {"apiVersion", "kind"} <= go_json_fields(types, "EndpointPickerConfig")
    assert set(plugin(config, "metrics-data-source")["parameters"]) <= go_json_fields(source, r"\w*[pP]arams?\w*")
    params = plugin(config, "core-metrics-extractor")["parameters"]
    assert set(params) <= go_json_fields(extractor, "modelServerExtractorParams")
    for engine in params["engineConfigs"]:
        assert set(engine) <= go_json_fields(extractor, "engineConfigParams")
    referenced = {p["pluginRef"] for prof in config["schedulingProfiles"] for p in prof["plugins"]}
    assert referenced <= {p.get("name", p["type"]) for p in config["plugins"]}


def test_the_pods_are_read_under_the_guards_engine_configuration() -> None:
    params = plugin(picker_config(), "core-metrics-extractor")["parameters"]
    labels = one("Deployment", "vllm-guard-pool")["spec"]["template"]["metadata"]["labels"]
    engine = labels[params["engineLabelKey"]]
    assert engine == params["defaultEngine"]
    assert engine in {e["name"] for e in params["engineConfigs"]}


@pytest.fixture
def scraped(tokenizer: Any, tokenizer_dir: Any, base_settings: Settings) -> Iterator[dict[str, Any]]:
    """The guard's /metrics in front of the simulator, with one request served."""
    config = SimConfig(model="tiny", root=str(tokenizer_dir), num_blocks=64, block_size=16, tokenizer=tokenizer)
    with run_sim_server(config) as sim, run_gateway(base_settings, upstream=sim.url) as gw:
        reply = httpx.post(gw.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4})
        assert reply.status_code == 200
        text = httpx.get(gw.url + "/metrics").text
    yield {f.name: f for f in text_string_to_metric_families(text)}


def test_every_metric_the_picker_is_pointed_at_is_exported_by_the_guard(scraped: dict[str, Any]) -> None:
    params = plugin(picker_config(), "core-metrics-extractor")["parameters"]
    (engine,) = [e for e in params["engineConfigs"] if e["name"] == params["defaultEngine"]]
    specs = {k: v for k, v in engine.items() if k.endswith("Spec") and v}
    assert set(specs) == {"queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec"}
    for spec in specs.values():
        assert spec in scraped, f"{spec} is not on the guard's /metrics"
        assert scraped[spec].type == "gauge" and len(scraped[spec].samples) == 1
    sample = {key: scraped[spec].samples[0] for key, spec in specs.items()}
    assert sample["queuedRequestsSpec"].value == 0 and sample["runningRequestsSpec"].value == 0
    assert 0.0 <= sample["kvUsageSpec"].value <= 1.0
    # The picker reads the cache's facts from the labels, as from vllm:cache_config_info.
    labels = sample["cacheInfoSpec"].labels
    # num_gpu_blocks as vLLM states it: the 64 blocks requests can hold and its null block.
    assert int(labels["block_size"]) == 16 and int(labels["num_gpu_blocks"]) == 64 + 1
