"""Proxy targets in front of engines: the gateway of this working tree or of a given commit, vllm-router (the
vLLM project's Rust router, from PyPI, in a virtual environment of its own), and a round-robin forwarder."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.harness.context import CACHE, Context
from bench.harness.processes import ROOT, Server, free_port, python
from bench.harness.target import Target

ROUTER_VERSION = "0.1.17"


def tokenizer_dir() -> Path:
    """The tiny model's tokenizer for the gateway's counting, built once under .cache/bench/."""
    target = CACHE / "tokenizer"
    if not (target / "tokenizer.json").is_file():
        from gateway.tools.tinymodel import build_tokenizer

        CACHE.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="tokenizer-", dir=CACHE))
        build_tokenizer(staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return target


def source_at(commit: str, cache: Path = CACHE) -> tuple[Path, str]:
    """The gateway package of ``commit``, extracted once under .cache/bench/src-<sha>/ (``git archive``: no
    worktree registered); returns the directory to put first on the path and the commit's short hash."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{commit}^{{commit}}"],
                         capture_output=True, text=True, check=True).stdout.strip()
    where = cache / f"src-{sha[:12]}"
    if not (where / "gateway" / "cli.py").is_file():
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", sha, "gateway"],
                                 capture_output=True, check=True).stdout
        cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"src-{sha[:12]}-", dir=cache))
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(staging, filter="data")
        if (staging / "gateway" / "native.py").is_file():  # its admission compiled, as its own setup builds it
            subprocess.run(python("gateway.native", "build"), cwd=staging, capture_output=True, timeout=900,
                           check=False, env={**os.environ, "PYTHONPATH": str(staging)})
        shutil.rmtree(where, ignore_errors=True)
        staging.rename(where)
    return where, sha[:7]


def gateway_argv(commit: str | None) -> tuple[list[str], Path]:
    """The command that runs ``vllm-guard`` of this tree or of ``commit``, and the directory to run it in."""
    src = ROOT if commit is None else source_at(commit)[0]
    return python("gateway.cli"), src


def has_flag(commit: str | None, flag: str) -> bool:
    """Whether the gateway of this tree (None) or of a commit knows ``flag`` (old commits lack newer flags)."""
    argv, src = gateway_argv(commit)
    done = subprocess.run([*argv, "serve", "--help"], capture_output=True, text=True, timeout=120, check=False,
                          cwd=src, env={**os.environ, "PYTHONPATH": str(src)})
    return flag in done.stdout


def gateway(ctx: Context, name: str, upstreams: Sequence[Target], *, flags: Sequence[str] = (),
            commit: str | None = None, cpus: str | None = None, tokenizer: Path | None = None,
            extra_args: bool = True) -> Target:
    """``vllm-guard serve`` in front of ``upstreams``: this tree's gateway, or (``commit``) that commit's, run from
    its own extracted source. ``flags`` are the benchmark's; ``--gateway-arg`` options follow them unless
    ``extra_args`` is False."""
    port = free_port()
    src, about = ROOT, {"commit": ctx.source["gateway_commit"], "tree": "working tree"}
    if commit is not None:
        src, short = source_at(commit)
        about = {"commit": short, "tree": f"commit {commit}"}
    ups = [a for u in upstreams for a in ("--upstream", u.url)]
    tok = ("--tokenizer", str(tokenizer)) if tokenizer is not None else ()
    passed = list(getattr(ctx.args, "gateway_arg", None) or []) if extra_args else []
    argv = [*python("gateway.cli", "serve"), *ups, "--host", "127.0.0.1", "--port", str(port), *tok, *flags, *passed]
    # The source's directory first on the path and as the working directory: `-m` puts the latter first.
    server = Server(name, argv, port, ctx.log_path(name), cpus=cpus or ctx.cores.proxy, cwd=src,
                    env={"PYTHONPATH": str(src)})
    return Target(name, "gateway", server, upstreams=list(upstreams), ready_timeout=180,
                  about={**about, "flags": [*flags, *passed]})


def router_binary(venv: Path | None = None) -> Path:
    """vllm-router's command in ``venv`` (default .cache/bench/router-venv), installed there with pip first if
    it is not yet (``pip install vllm-router==0.1.17``: a binary wheel, no Rust toolchain needed)."""
    venv = venv or CACHE / "router-venv"
    binary = venv / "bin" / "vllm-router"
    if binary.exists():
        return binary
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", f"vllm-router=={ROUTER_VERSION}"], check=True)
    if not binary.exists():
        raise RuntimeError(f"pip installed vllm-router=={ROUTER_VERSION} but {binary} is missing")
    return binary


def router(ctx: Context, name: str, upstreams: Sequence[Target], *, cpus: str | None = None,
           venv: Path | None = None) -> Target:
    """vllm-router in front of ``upstreams``, round robin, warnings only in its log."""
    port = free_port()
    binary = router_binary(venv or getattr(ctx.args, "router_venv", None))
    argv = [str(binary), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *(u.url for u in upstreams),
            "--policy", "round_robin", "--log-level", "warning", "--prometheus-port", str(free_port())]
    server = Server(name, argv, port, ctx.log_path(name), cpus=cpus or ctx.cores.proxy)
    return Target(name, "router", server, upstreams=list(upstreams), ready_paths=("/v1/models",), ready_timeout=120,
                  about={"version": ROUTER_VERSION})


def floor(ctx: Context, name: str, upstreams: Sequence[Target], *, cpus: str | None = None,
          count: Path | None = None, asgi: bool = False) -> Target:
    """``bench.servers.floor`` in front of the first upstream: the least a Python proxy on the gateway's stack
    (uvloop, an asyncio protocol, httptools) spends per request and per relayed event, on the proxies' cores;
    with ``count`` (a tokenizer's directory), each chat's prompt also counted by the gateway's own counter; with
    ``asgi``, the same proxy served through uvicorn's ASGI cycle (``bench.servers.floor_asgi``)."""
    port = free_port()
    counting = ("--count", str(count)) if count is not None else ()
    module = "bench.servers.floor_asgi" if asgi else "bench.servers.floor"
    argv = python(module, "--port", str(port), *counting, upstreams[0].url)
    server = Server(name, argv, port, ctx.log_path(name), cpus=cpus or ctx.cores.proxy)
    return Target(name, "floor", server, upstreams=list(upstreams[:1]), ready_paths=("/health",), ready_timeout=60,
                  about={"counts": count is not None, "asgi": asgi})


def round_robin(ctx: Context, name: str, upstreams: Sequence[Target], *, cpus: str | None = None) -> Target:
    """``bench.servers.round_robin``: each POST to the next upstream in turn, one proxy hop in its own process."""
    port = free_port()
    argv = python("bench.servers.round_robin", "--port", str(port), *(u.url for u in upstreams))
    server = Server(name, argv, port, ctx.log_path(name), cpus=cpus)
    return Target(name, "round-robin", server, upstreams=list(upstreams), ready_paths=("/health",), ready_timeout=60)


def engine_states(gateway: Target, key: str | None = None) -> list[str]:
    """Each engine's state in the gateway's ``/guard/status`` (``ready``, ``down``, ``hung``...)."""
    from bench.harness.scrape import get_json

    headers = {"authorization": f"Bearer {key}"} if key else None
    return [str(row["state"]) for row in get_json(f"{gateway.url}/guard/status", headers=headers)["engines"]]


def wait_engines_ready(gateway: Target, count: int, timeout_s: float = 120.0) -> None:
    """Until the gateway says ``count`` engines, each ready."""
    import time

    deadline = time.monotonic() + timeout_s
    while (states := engine_states(gateway)) != ["ready"] * count:
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{gateway.name}'s engines are {states} after {timeout_s:.0f} s, not {count} ready")
        time.sleep(0.5)
