"""What one connection may hold: the limits of ``Settings`` that the server's protocol enforces."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config import Settings
from gateway.http.body import BodyLimits
from gateway.http.starved import STRETCH


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """The limits of ``Settings`` that the protocol enforces (their meanings and defaults are there)."""

    max_header_bytes: int
    max_headers: int
    header_timeout: float
    keep_alive_timeout: float
    max_connections: int
    body: BodyLimits
    write_timeout: float = 30.0
    stretch: float = STRETCH  # --starved-stretch: the most a starved host stretches each timeout

    @classmethod
    def of(cls, settings: Settings) -> ConnectionLimits:
        return cls(
            max_header_bytes=settings.max_header_bytes,
            max_headers=settings.max_headers,
            header_timeout=settings.header_timeout,
            keep_alive_timeout=settings.keep_alive_timeout,
            # Each process of --workers holds its share: connections are memory, which is per process.
            max_connections=-(-settings.max_connections // settings.worker_count()),
            body=BodyLimits.of(settings),
            write_timeout=settings.write_timeout,
            stretch=settings.starved_stretch,
        )
