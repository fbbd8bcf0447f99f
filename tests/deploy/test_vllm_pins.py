"""vllm-guard installs into vLLM's own environment (managed mode runs there), so installing it must never move a
package vLLM's installation chose. The rule (DESIGN.md), kept for the next vLLM: the project's pins are never
tighter than the newest vLLM's; when a vLLM is released, set NEWEST_VLLM to it and run this test.

The check is one real resolve by pip's resolver, metadata only (``--dry-run --only-binary :all:``: nothing is
built or installed): ``vllm==NEWEST_VLLM`` beside the project's own dependencies named without their version
specifiers (so the project's packages that vLLM lacks, and their own requirements, take part). That is the
environment vLLM's installation would have with the project's packages in it, had the project pinned nothing.
Then each of the project's specifiers must accept the version chosen there: one that does not would make pip
move that package when the project is installed beside vLLM. A second resolve with the specifiers would only
repeat the first when they all accept it, at twice the cost (about a minute each here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support.paths import ROOT

NEWEST_VLLM = "0.33.0"
# pip's words when the package index cannot be reached (offline machine, no route, DNS): the test is skipped.
UNREACHABLE = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
               "Network is unreachable", "Max retries exceeded", "ConnectTimeoutError", "ReadTimeoutError")


def project_requirements() -> list[Requirement]:
    """The project's own dependencies, as installed beside vLLM (the base set, for this interpreter)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [r for r in map(Requirement, deps) if r.marker is None or r.marker.evaluate()]


def unpinned(req: Requirement) -> str:
    return req.name + (f"[{','.join(sorted(req.extras))}]" if req.extras else "")


def resolve(requirements: list[str], report: Path) -> dict[str, str]:
    """pip's resolution for this interpreter, metadata only: {canonical name: version}."""
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
           "--only-binary", ":all:", "--retries", "1", "--timeout", "20", "--report", str(report), *requirements]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if done.returncode != 0:
        if any(word in done.stderr for word in UNREACHABLE):
            pytest.skip(f"the package index cannot be reached, so vllm=={NEWEST_VLLM} cannot be resolved: "
                        f"{done.stderr.strip().splitlines()[-1][:200]}")
        raise AssertionError(f"pip could not resolve {requirements}:\n{done.stderr[-3000:]}")
    chosen = json.loads(report.read_text())["install"]
    return {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"] for item in chosen}


def test_installing_the_project_beside_the_newest_vllm_moves_none_of_its_packages(tmp_path: Path) -> None:
    ours = project_requirements()
    t0 = time.monotonic()
    env = resolve([f"vllm=={NEWEST_VLLM}", *map(unpinned, ours)], tmp_path / "report.json")
    took = time.monotonic() - t0
    assert env.get("vllm") == NEWEST_VLLM
    moved = [
        f"{req}: vllm=={NEWEST_VLLM}'s environment has {req.name} {env[canonicalize_name(req.name)]}"
        for req in ours
        if not req.specifier.contains(env[canonicalize_name(req.name)], prereleases=True)
    ]
    assert moved == [], f"pins tighter than vllm {NEWEST_VLLM}'s (resolved in {took:.0f} s): {moved}"
