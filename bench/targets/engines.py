"""Engine targets: the fast fake engine, the vLLM simulator, a real vLLM (CPU build, the tiny model) with flags."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

from bench.harness.context import Context
from bench.harness.processes import Server, free_port, python
from bench.harness.target import Target

VLLM_READY_PATHS = ("/health", "/v1/models")


def fake(ctx: Context, name: str = "engine", *, token_delay: float = 0.02, max_model_len: int = 32768,
         cpus: str | None = None, processes: int = 1) -> Target:
    """``bench.servers.fake_engine``: answers at once or streams one event per token, ``token_delay`` apart;
    ``processes`` serve the port together (a machine whose proxy would outrun one core of engine)."""
    port = free_port()
    argv = python("bench.servers.fake_engine", "--port", str(port), "--token-delay", f"{token_delay:g}",
                  "--max-model-len", str(max_model_len), *(("--processes", str(processes)) if processes > 1 else ()))
    server = Server(name, argv, port, ctx.log_path(name), cpus=cpus or ctx.cores.engine)
    about = {"token_delay": token_delay, **({"processes": processes} if processes > 1 else {})}
    return Target(name, "fake", server, about=about, ready_timeout=30)


def simulator(ctx: Context, name: str = "engine", *, token_delay: float = 0.0, tokenizer: Path | None = None,
              num_blocks: int = 1_000_000, max_model_len: int = 32768, max_num_seqs: int = 100_000,
              block_size: int = 16, cpus: str | None = None) -> Target:
    """``bench.servers.simulator``: the test suite's vLLM simulator (a KV cache, real token counts)."""
    port = free_port()
    argv = python("bench.servers.simulator", "--port", str(port), "--token-delay", f"{token_delay:g}",
                  "--num-blocks", str(num_blocks), "--max-model-len", str(max_model_len), "--max-num-seqs",
                  str(max_num_seqs), "--block-size", str(block_size),
                  *(("--tokenizer", str(tokenizer)) if tokenizer else ()))  # fmt: skip
    server = Server(name, argv, port, ctx.log_path(name), cpus=cpus)
    about = {"token_delay": token_delay, "num_blocks": num_blocks, "max_model_len": max_model_len}
    return Target(name, "simulator", server, ready_paths=("/health", "/v1/models"), ready_timeout=90, about=about)


def tiny_model(max_model_len: int = 2048) -> Path:
    """The test suite's tiny random-weight model, built once under .models/."""
    from testing.servers import ensure_tiny_model

    return ensure_tiny_model(max_model_len)


def eos_id(model: Path) -> int:
    eos = json.loads((model / "config.json").read_text())["eos_token_id"]
    return int(eos[0] if isinstance(eos, list) else eos)


def vllm(ctx: Context, name: str = "engine", *, flags: Sequence[str] = (), kv_cache_bytes: int = 4 << 20,
         max_model_len: int = 2048, model: Path | None = None, cpus: str | None = None,
         core: int | None = None) -> Target:
    """A real vLLM OpenAI server (the CPU build) on the tiny model, with ``flags`` (``--watermark 0.05``, a queue
    cap, ``--data-parallel-size 2``...). ``core``: its worker's threads bound to that core (vLLM's CPU build binds
    every server's worker to the same first core otherwise: two servers then fight over one core)."""
    from testing.servers import vllm_server

    model = model or tiny_model(max_model_len)
    spec = vllm_server(model, ctx.log_path(name), max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_bytes,
                       extra_args=flags)
    env = {"VLLM_CPU_OMP_THREADS_BIND": str(core % (os.cpu_count() or 1))} if core is not None else {}
    server = Server(name, spec.argv, spec.port, spec.log_path, cpus=cpus, env=env)
    about = {"flags": list(flags), "kv_cache_bytes": kv_cache_bytes, "max_model_len": max_model_len}
    return Target(name, "vllm", server, ready_paths=VLLM_READY_PATHS, ready_timeout=900, about=about)


def wait_idle(engine: Target, timeout_s: float = 300.0) -> None:
    """Until a vLLM runs and queues nothing (it notices a client that gave up only at its next output)."""
    from bench.harness.scrape import scrape

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(scrape(engine.url, n) for n in ("vllm:num_requests_running", "vllm:num_requests_waiting")) == 0:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{engine.name} still busy after {timeout_s:.0f} s")


def renice_engine_core(engine: Target, niceness: int) -> int:
    """Every thread of vLLM's engine core process (``VLLM::EngineCore``) at ``niceness`` (Linux keeps a niceness
    per thread; threads it starts later inherit it); how many were set. Its busy loop waits for its worker by
    spinning on ``sched_yield``, which on a shared core takes the turns of the API server, the client and a
    gateway (docs/history/realistic-engine-core-niceness.md, "Where a first token's time goes at capacity")."""
    import psutil

    count = 0
    for child in psutil.Process(engine.pid).children(recursive=True):
        if child.name().startswith("VLLM::EngineCor"):
            for thread in child.threads():
                os.setpriority(os.PRIO_PROCESS, thread.id, niceness)
                count += 1
    return count


def engine_core_pid(engine: Target, timeout_s: float = 60.0) -> int:
    """The pid of the server's engine core process (``VLLM::EngineCore``), once it runs."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in psutil.Process(engine.pid).children(recursive=True):
            if child.name().startswith("VLLM::EngineCor"):
                return int(child.pid)
        time.sleep(0.2)
    raise RuntimeError(f"{engine.name} has no engine core process after {timeout_s:.0f} s")
