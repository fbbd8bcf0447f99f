"""Settings of what the gateway tells operators beyond its metrics: traces and the access log (a part of
``Settings``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ObserveFields(BaseModel):
    """Tracing and the access log."""

    access_log: Literal["text", "json", "off"] = Field(
        "text",
        description="One line per guarded request on the logger vllm_guard.access (standard output unless "
        "logging routes it): key=value pairs (text), one JSON object (json), or none (off).",
    )
