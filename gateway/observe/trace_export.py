"""Where the gateway's traces go: nowhere without ``--otlp-traces-endpoint`` (the no-op ``Tracing`` of
``gateway/observe/tracing.py``), else to that endpoint over OTLP/HTTP (``gateway/observe/otel.py``, whose
OpenTelemetry SDK is imported only then).
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from gateway.config import Settings
from gateway.errors import ConfigInvalid
from gateway.observe.tracing import NoTracing, Tracing

# OTLP/HTTP's path for traces, appended to an endpoint given without one (the collector's base URL).
OTLP_TRACES_PATH = "/v1/traces"


def traces_url(endpoint: str) -> str:
    """The URL spans are posted to: ``endpoint`` as given, or with OTLP's traces path when it has no path."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigInvalid(
            f"--otlp-traces-endpoint must be an http:// or https:// URL (OTLP over HTTP); got {endpoint!r}"
        )
    if parts.path in ("", "/"):
        parts = parts._replace(path=OTLP_TRACES_PATH)
    return urlunsplit(parts)


def start_tracing(settings: Settings) -> Tracing:
    """The no-op ``Tracing`` without an endpoint; else one exporting to it with the OpenTelemetry SDK (imported
    only then)."""
    if settings.otlp_traces_endpoint is None:
        return NoTracing()
    url = traces_url(settings.otlp_traces_endpoint)
    from gateway.observe.otel import OtelTracing

    return OtelTracing(url)
