"""Settings of what the gateway tells operators beyond its metrics: traces and the access log (a part of
``Settings``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ObserveFields(BaseModel):
    """Tracing and the access log."""

    otlp_traces_endpoint: str | None = Field(
        None,
        description="Export OpenTelemetry traces of every guarded request (OTLP over HTTP/protobuf) to this URL "
        "(vLLM's flag of the same name; a URL without a path gets /v1/traces). The SDK's own OTEL_* variables "
        "apply (OTEL_SERVICE_NAME, OTEL_EXPORTER_OTLP_HEADERS, OTEL_BSP_*, ...). Unset: no tracing, at no cost.",
    )
    access_log: Literal["text", "json", "off"] = Field(
        "text",
        description="One line per guarded request on the logger vllm_guard.access (standard output unless "
        "logging routes it): key=value pairs (text), one JSON object (json), or none (off).",
    )
