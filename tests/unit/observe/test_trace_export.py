"""Tracing's switch: the endpoint's URL, and nothing of the SDK loaded while tracing is off."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gateway.errors import ConfigInvalid
from gateway.observe.trace_export import traces_url
from tests.support.paths import ROOT


@pytest.mark.parametrize(
    ("given", "posted_to"),
    [
        ("http://collector:4318", "http://collector:4318/v1/traces"),
        ("http://collector:4318/", "http://collector:4318/v1/traces"),
        ("https://collector:4318/v1/traces", "https://collector:4318/v1/traces"),
        ("http://gateway.example/otlp/traces", "http://gateway.example/otlp/traces"),
    ],
)
def test_an_endpoint_without_a_path_gets_otlps_traces_path(given: str, posted_to: str) -> None:
    assert traces_url(given) == posted_to


@pytest.mark.parametrize("given", ["collector:4317", "grpc://collector:4317", "http://", "/v1/traces"])
def test_an_endpoint_that_is_not_an_http_url_is_refused(given: str) -> None:
    with pytest.raises(ConfigInvalid, match="--otlp-traces-endpoint"):
        traces_url(given)


def test_tracing_off_loads_neither_the_sdks_tracing_nor_its_exporter() -> None:
    code = (
        "import sys\n"
        "import gateway.cli, gateway.http.app, gateway.guard.pipeline\n"
        "from gateway.config import Settings\n"
        "from gateway.observe.trace_export import start_tracing\n"
        "start_tracing(Settings())\n"
        "loaded = [m for m in sys.modules if m.startswith(('opentelemetry.sdk.trace', 'opentelemetry.exporter',"
        " 'gateway.observe.otel'))]\n"
        "print(loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
