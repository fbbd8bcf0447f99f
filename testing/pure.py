"""A pytest plugin that runs the admission package's pure Python modules whatever is built (``gateway/native.py``):
``pytest -p testing.pure tests/unit/admission``. The suite as a whole runs what users run, the compiled modules
where a build matches the sources; this run keeps the pure ones, which run wherever none does, under test too."""

from __future__ import annotations

import sys

from gateway import native

if "gateway.admission" in sys.modules:  # loaded before this plugin: too late to choose
    raise RuntimeError("testing.pure must load before gateway.admission is imported (pytest -p testing.pure)")
native.disable()


def pytest_report_header() -> str:
    return "admission: the pure Python modules (testing.pure)"


def pytest_sessionstart() -> None:
    import gateway.admission.controller as controller

    if not controller.__file__ or not controller.__file__.endswith(".py"):
        raise RuntimeError(f"the admission runs compiled ({controller.__file__}) under testing.pure")
