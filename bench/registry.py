"""The benchmarks ``python -m bench run`` knows, by name, in the order ``list`` shows them."""

from __future__ import annotations

import importlib
from types import ModuleType

MODULES = {
    "overhead": "bench.benchmarks.overhead",
    "relay": "bench.benchmarks.relay",
    "fake-engine": "bench.benchmarks.fake_engine",
    "realistic": "bench.benchmarks.realistic",
    "prefix": "bench.benchmarks.prefix",
    "flood": "bench.benchmarks.flood",
    "engines": "bench.benchmarks.engines",
    "servers-prefix": "bench.benchmarks.servers_prefix",
    "faults": "bench.benchmarks.faults",
    "rolling": "bench.benchmarks.rolling",
    "tenants": "bench.benchmarks.tenants",
    "restart": "bench.benchmarks.restart",
    "stages": "bench.benchmarks.stages",
    "profile": "bench.benchmarks.native_profile",
    "scaling": "bench.benchmarks.scaling",
    "authority": "bench.benchmarks.authority",
    "soak": "bench.benchmarks.soak",
    "slow-readers": "bench.benchmarks.slow_readers",
    "counting": "bench.benchmarks.counting",
    "access-log": "bench.benchmarks.access_log",
    "trace": "bench.benchmarks.trace",
    "http-clients": "bench.benchmarks.http_clients",
    "gpu-check": "bench.benchmarks.gpu_check",
}


def names() -> list[str]:
    return list(MODULES)


def module(name: str) -> ModuleType:
    """A benchmark's module: ``SUMMARY``, ``TARGETS`` (every target it can run, the default ones first) and
    ``DEFAULT_TARGETS``, ``add_arguments(parser)`` and ``run(ctx) -> Result``."""
    return importlib.import_module(MODULES[name])
