"""Settings of what the gateway tells operators beyond its metrics: traces and the access log (a part of
``Settings``)."""

from __future__ import annotations

from pydantic import BaseModel


class ObserveFields(BaseModel):
    """Tracing and the access log."""
