"""A target: one server a benchmark sends traffic to (an engine alone, or a proxy in front of one), its process
and what it was (kind, command, cores, commit), for the result's JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bench.harness.cpu import cpu_seconds
from bench.harness.processes import Server

ENGINE_KINDS = frozenset({"fake", "simulator", "vllm"})


@dataclass
class Target:
    name: str
    kind: str  # fake, simulator, vllm, gateway, router, round-robin
    server: Server
    ready_paths: tuple[str, ...] = ("/health",)
    ready_timeout: float = 120.0
    upstreams: list[Target] = field(default_factory=list)  # a proxy's engines
    about: dict[str, Any] = field(default_factory=dict)  # flags, commit, settings

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def pid(self) -> int:
        return self.server.pid

    @property
    def is_proxy(self) -> bool:
        return self.kind not in ENGINE_KINDS

    def engine(self) -> Target:
        """The engine this target's traffic ends at: itself, or its (first) upstream's engine."""
        return self.upstreams[0].engine() if self.upstreams else self

    def cpu_seconds(self) -> float:
        """CPU seconds of the target's processes (every thread and child), so far."""
        return cpu_seconds(self.server.pid)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "command": self.server.command, "cpus": self.server.cpus,
                "upstreams": [u.name for u in self.upstreams], **self.about}  # fmt: skip
