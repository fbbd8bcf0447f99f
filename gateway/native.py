"""The admission package compiled by mypyc: built apart from its sources, used only while it matches them.

What a request costs the gateway is the interpreter's work over hundreds of small functions (admission alone is
~400 Python calls a request, none of them over a few percent). The code is typed under mypy's strict mode, so mypyc
(part of mypy, the project's type checker) compiles it to C as it stands: measured on 2 cores, the admission
alone 96 -> 47 us a request in-process, a short chat 0.92x the gateway's CPU, the authority's coordination per
request a worker served 0.63-0.65x (docs/overhead.md, "Admission compiled with mypyc").

A build lives in ``.native/<key>/`` beside the ``gateway`` package (a source checkout; scripts/setup.sh builds it
where a C compiler is), never beside the sources: Python prefers a ``.so`` to the ``.py`` next to it, and a build
left there would shadow every later edit. ``key`` hashes every source file of the package and the interpreter's
tag, so an edit anywhere (compiled code trusts the types of what it calls) leaves the build unused until it is built
again, and the pure modules run meanwhile. ``activate``, called by the package's ``__init__`` before it imports
anything, puts a matching build first on the package's path; a wheel install has no ``.native`` and runs pure.

Kept pure (``PURE``): the package's ``__init__`` (it activates the build), and the modules of values that cross the
workers' channel, whose codec builds its decoders from their dataclasses' type hints: a compiled module's
annotations are erased to their runtime classes (``Sequence[int]`` reads back as ``Sequence``). Compiled code also
refuses what the pure modules allow and nothing here needs: an attribute of a compiled object replaced from outside
(a test's ``monkeypatch``), a value of another type than the annotation says, a dataclass generic in its item.

    python -m gateway.native build      # ~1-2 min; prints the build's folder, or why there is none
    python -m gateway.native status     # whether a build matches this checkout's sources
"""

from __future__ import annotations

import hashlib
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGE = "admission"  # gateway/admission
PURE = frozenset({"__init__.py", "prefix.py", "destination.py"})
BUILDS = ".native"
DONE = "built"  # written last: a folder without it is a build that did not finish, never used

_enabled = True  # False: the pure modules run whatever is built (``disable``)
_active: Path | None = None  # the build this process runs


def top() -> Path:
    """The folder that holds the ``gateway`` package (a checkout's root, or site-packages)."""
    return Path(__file__).resolve().parent.parent


def key(root: Path) -> str:
    """What a build is for: every source file of ``root/gateway``, the interpreter's tag and the machine."""
    digest = hashlib.sha256(f"{sys.implementation.cache_tag} {platform.machine()}\0".encode())
    package = root / "gateway"
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:20]


def disable() -> None:
    """Run the pure modules in this process whatever is built (called before the package is imported: the
    pure run of the admission tests, ``testing/pure.py``)."""
    global _enabled
    _enabled = False


def activate(package_path: list[str], root: Path | None = None) -> Path | None:
    """Put the build that matches these sources first on ``package_path`` (the package's ``__path__``); the
    build's folder, or None where there is none (the pure modules run)."""
    global _active
    root = top() if root is None else root
    where = built(root) if _enabled else None
    if where is None:
        return None
    lib = str(where / "lib")  # the group's shared library, imported by name by each module's own small one
    if lib not in sys.path:
        sys.path.append(lib)
    package_path.insert(0, str(where / "modules"))
    _active = where
    return where


def active() -> Path | None:
    """The build this process runs, or None: the pure modules."""
    return _active


def built(root: Path) -> Path | None:
    """The finished build for ``root``'s sources as they are now, or None."""
    builds = root / BUILDS
    if not builds.is_dir():  # a wheel install, or a checkout never built: nothing to hash
        return None
    where = builds / key(root)
    return where if (where / DONE).is_file() else None


def build(root: Path | None = None) -> Path:
    """Compile the package for the sources as they are now (a build already made for them is kept); raises
    ``RuntimeError`` with mypyc's own words when it cannot (no C compiler, a module it refuses)."""
    root = top() if root is None else root
    ready = built(root)
    if ready is not None:
        return ready
    builds = root / BUILDS
    where = builds / key(root)
    with tempfile.TemporaryDirectory(prefix="vllm-guard-native-") as scratch:
        work = Path(scratch)
        shutil.copytree(root / "gateway", work / "gateway", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        if (root / "pyproject.toml").is_file():  # the project's mypy settings, as the type check runs them
            shutil.copy(root / "pyproject.toml", work / "pyproject.toml")
        sources = sorted(
            f"gateway/{PACKAGE}/{p.name}" for p in (work / "gateway" / PACKAGE).glob("*.py") if p.name not in PURE
        )
        done = subprocess.run(
            [sys.executable, "-m", "mypyc", *sources], cwd=work, capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"mypyc failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}")
        staging = builds / f"{where.name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        (staging / "lib").mkdir(parents=True)
        (staging / "modules").mkdir()
        for lib in work.glob("*.so"):
            shutil.move(lib, staging / "lib" / lib.name)
        for module in (work / "gateway" / PACKAGE).glob("*.so"):
            shutil.move(module, staging / "modules" / module.name)
        (staging / DONE).write_text(" ".join(sources) + "\n")
        for old in builds.iterdir():  # one build at a time: the sources it was for are gone
            if old != staging:
                shutil.rmtree(old, ignore_errors=True)
        staging.rename(where)
    return where


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["build"]:
        try:
            print(build())
        except (RuntimeError, OSError) as exc:
            print(f"no compiled build (the pure modules run): {exc}", file=sys.stderr)
            return 1
        return 0
    if args == ["status"]:
        where = built(top())
        print(f"compiled: {where}" if where is not None else "pure Python: no build for these sources")
        return 0
    print("usage: python -m gateway.native build|status", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
