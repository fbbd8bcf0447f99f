"""deploy/prometheus.yml and deploy/alerts.yml with the real Prometheus tools: promtool checks and rule unit
tests, then a real Prometheus on 127.0.0.1 scraping a real gateway (the `vllm-guard serve` command) in front of
the vLLM simulator, with every alert rule and dashboard query evaluated by its query API."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

from tests.support.paths import ROOT

DEPLOY = ROOT / "deploy"
STARTUP_DEADLINE = 60.0
T = TypeVar("T")


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed: run scripts/install-prometheus.sh (Debian package prometheus)")
    return path


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], cwd=DEPLOY, capture_output=True, text=True, timeout=120,
                          check=False)


# -- promtool -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (("check", "config", "prometheus.yml"), "is valid prometheus config file syntax"),
        (("check", "rules", "alerts.yml"), "SUCCESS"),
        (("test", "rules", "alerts_test.yml"), "SUCCESS"),
    ],
    ids=["config", "rules", "rule unit tests"],
)
def test_promtool_accepts_the_deploy_files(args: tuple[str, ...], expect: str) -> None:
    result = run_promtool(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert expect in result.stdout


def test_promtool_rejects_a_broken_rule(tmp_path: Path) -> None:
    rules = yaml.safe_load((DEPLOY / "alerts.yml").read_text(encoding="utf-8"))
    rules["groups"][0]["rules"][0]["expr"] = "sum by (instance) (rate(vllm_guard_requests_total[5m]"
    broken = tmp_path / "alerts.yml"
    broken.write_text(yaml.safe_dump(rules), encoding="utf-8")
    result = run_promtool("check", "rules", str(broken))
    assert result.returncode != 0


def test_the_rule_unit_tests_fail_when_a_rule_changes(tmp_path: Path) -> None:
    rules = yaml.safe_load((DEPLOY / "alerts.yml").read_text(encoding="utf-8"))
    down = next(r for g in rules["groups"] for r in g["rules"] if r["alert"] == "VllmGuardUpstreamDown")
    down["for"] = "30m"
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(rules), encoding="utf-8")
    shutil.copy(DEPLOY / "alerts_test.yml", tmp_path / "alerts_test.yml")
    result = subprocess.run([promtool(), "test", "rules", "alerts_test.yml"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode != 0 and "VllmGuardUpstreamDown" in result.stdout + result.stderr


# -- a live Prometheus --------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, probe: Callable[[], T | None], proc: subprocess.Popen[bytes] | None = None) -> T:
    """Poll a real external process until it is ready: no clock to inject there, so a bounded deadline."""
    deadline = time.monotonic() + STARTUP_DEADLINE
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: process exited with {proc.returncode}")
        try:
            result = probe()
        except httpx.HTTPError:
            result = None
        if result is not None:
            return result
        time.sleep(0.2)
    raise AssertionError(f"{what}: not ready within {STARTUP_DEADLINE:.0f} s")


def derived_config(gateway: str, engine: str) -> dict[str, Any]:
    """deploy/prometheus.yml with its targets pointed at local processes and fast intervals for a test."""
    config: dict[str, Any] = yaml.safe_load((DEPLOY / "prometheus.yml").read_text(encoding="utf-8"))
    # The scrape timeout is capped at the interval: 2 s leaves a loaded machine time to answer.
    config["global"].update(scrape_interval="2s", evaluation_interval="1s")
    config["rule_files"] = [str(DEPLOY / f) for f in config["rule_files"]]
    targets = {"vllm-guard": gateway, "vllm": engine}
    for job in config["scrape_configs"]:
        for key in [k for k in job if k.endswith("_sd_configs") or k == "static_configs"]:
            del job[key]
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
        job["scrape_interval"] = "2s"
    return config


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@dataclass
class Stack:
    prometheus: httpx.Client
    gateway: str

    def query(self, expr: str) -> dict[str, Any]:
        body: dict[str, Any] = self.prometheus.get("/api/v1/query", params={"query": expr}).json()
        return body


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any, tokenizer_dir: Path) -> Iterator[Stack]:
    prometheus_bin = shutil.which("prometheus")
    if prometheus_bin is None:
        pytest.skip("prometheus not installed: run scripts/install-prometheus.sh")
    vllm_sim = pytest.importorskip(
        "testing.vllm_sim", reason="the vLLM simulator (testing/vllm_sim/) is missing"
    )
    cli = Path(sys.executable).parent / "vllm-guard"
    tmp = tmp_path_factory.mktemp("prometheus")
    sim_config = vllm_sim.SimConfig(model="tiny", root=str(tokenizer_dir), max_model_len=512, num_blocks=256,
                                    block_size=16, tokenizer=tokenizer)
    with (
        vllm_sim.run_sim_server(sim_config) as sim,
        (tmp / "gateway.log").open("wb") as gateway_log,
        (tmp / "prometheus.log").open("wb") as prometheus_log,
    ):
        gw_port, prom_port = free_port(), free_port()
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        gateway = subprocess.Popen(
            [str(cli), "serve", "--upstream", sim.url, "--host", "127.0.0.1", "--port", str(gw_port),
             "--tokenizer", str(tokenizer_dir), "--log-level", "warning"],
            env=env, stdout=subprocess.DEVNULL, stderr=gateway_log,
        )
        config = tmp / "prometheus.yml"
        config.write_text(yaml.safe_dump(derived_config(f"127.0.0.1:{gw_port}", sim.url.split("://")[1])),
                          encoding="utf-8")
        prometheus = subprocess.Popen(
            [prometheus_bin, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=prometheus_log,
        )
        try:
            base = f"http://127.0.0.1:{gw_port}"
            with httpx.Client(base_url=base, timeout=10) as gw:
                wait_for("gateway /health", lambda: True if gw.get("/health").status_code == 200 else None,
                         gateway)
                # One answered and one refused request, so that request and rejection series exist.
                ok = gw.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4})
                refused = gw.post("/v1/completions", json={"model": "tiny", "prompt": "word " * 2000})
                assert (ok.status_code, refused.status_code) == (200, 400), (ok.text, refused.text)
            with httpx.Client(base_url=f"http://127.0.0.1:{prom_port}", timeout=10) as client:
                wait_for("prometheus ready", lambda: True if client.get("/-/ready").status_code == 200 else None,
                         prometheus)
                yield Stack(client, base)
        finally:
            stop(prometheus)
            stop(gateway)


def test_prometheus_scrapes_the_gateway_and_the_engine(stack: Stack) -> None:
    def both_up() -> dict[str, str] | None:
        result = stack.query("up")["data"]["result"]
        jobs = {r["metric"]["job"]: r["value"][1] for r in result}
        return jobs if jobs == {"vllm-guard": "1", "vllm": "1"} else None

    assert wait_for("both targets up", both_up) == {"vllm-guard": "1", "vllm": "1"}
    wanted = {"vllm_guard_upstream_up", "vllm_guard_requests_total", "vllm_guard_rejections_total"}

    def gateway_series() -> set[str] | None:
        result = stack.query('{__name__=~"vllm_guard_.+"}')["data"]["result"]
        names = {s["metric"]["__name__"] for s in result}
        return names if wanted <= names else None

    assert len(wait_for("vllm_guard_ series", gateway_series)) > len(wanted)
    up = stack.query("vllm_guard_upstream_up")["data"]["result"]
    assert [r["value"][1] for r in up] == ["1"]


def test_every_vllm_metric_the_files_use_is_exported_by_the_engine(stack: Stack) -> None:
    from tests.deploy.test_deploy import dashboard_exprs, promql_names, rule_exprs

    used = set().union(*(promql_names(e)[0] for _, e in rule_exprs() + dashboard_exprs()))
    engine = {n for n in used if n.startswith("vllm:")}
    assert engine
    wait_for("engine series", lambda: stack.query('{job="vllm"}')["data"]["result"] or None)
    for name in sorted(engine):
        base = name.removesuffix("_bucket")
        assert stack.query(f"count({{__name__=~'{base}(_bucket)?'}})")["data"]["result"], name


def test_every_alert_rule_loads_and_evaluates(stack: Stack) -> None:
    def evaluated() -> list[dict[str, Any]] | None:
        groups = stack.prometheus.get("/api/v1/rules").json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        done = rules and all(r["lastEvaluation"] != "0001-01-01T00:00:00Z" for r in rules)
        return rules if done else None

    rules = wait_for("rules evaluated", evaluated)
    expected = yaml.safe_load((DEPLOY / "alerts.yml").read_text(encoding="utf-8"))
    assert len(rules) == sum(len(g["rules"]) for g in expected["groups"])
    assert [r["name"] for r in rules if r["health"] != "ok"] == []
    for rule in rules:
        answer = stack.query(rule["query"])
        assert answer["status"] == "success", (rule["name"], answer)


def test_a_healthy_stack_fires_no_alert(stack: Stack) -> None:
    alerts = stack.prometheus.get("/api/v1/alerts").json()["data"]["alerts"]
    firing = [a["labels"]["alertname"] for a in alerts if a["state"] == "firing"]
    assert firing == []


def test_every_dashboard_query_evaluates(stack: Stack) -> None:
    dash = json.loads((DEPLOY / "grafana/dashboards/vllm-guard.json").read_text(encoding="utf-8"))
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dash["annotations"]["list"]]
    assert exprs
    for expr in exprs:
        answer = stack.query(expr.replace("$instance", ".*"))
        assert answer["status"] == "success", (expr, answer)
    kv = stack.query('max(vllm_guard_kv_capacity_blocks{instance=~".*"})')["data"]["result"]
    assert kv and float(kv[0]["value"][1]) == 256
