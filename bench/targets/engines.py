"""Engine targets: the fast fake engine, the vLLM simulator, a real vLLM (CPU build, the tiny model) with flags."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from bench.harness.context import Context
from bench.harness.processes import Server, free_port, python
from bench.harness.target import Target

VLLM_READY_PATHS = ("/health", "/v1/models")


def fake(ctx: Context, name: str = "engine", *, token_delay: float = 0.02, max_model_len: int = 32768,
         cpus: str | None = None) -> Target:
    """``bench.servers.fake_engine``: answers at once or streams one event per token, ``token_delay`` apart."""
    port = free_port()
    argv = python("bench.servers.fake_engine", "--port", str(port), "--token-delay", f"{token_delay:g}",
                  "--max-model-len", str(max_model_len))
    server = Server(name, argv, port, ctx.log_path(name), cpus=cpus or ctx.cores.engine)
    return Target(name, "fake", server, about={"token_delay": token_delay}, ready_timeout=30)


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
    from tests.e2e.servers import ensure_tiny_model

    return ensure_tiny_model(max_model_len)


def eos_id(model: Path) -> int:
    eos = json.loads((model / "config.json").read_text())["eos_token_id"]
    return int(eos[0] if isinstance(eos, list) else eos)


def vllm(ctx: Context, name: str = "engine", *, flags: Sequence[str] = (), kv_cache_bytes: int = 4 << 20,
         max_model_len: int = 2048, model: Path | None = None, cpus: str | None = None) -> Target:
    """A real vLLM OpenAI server (the CPU build) on the tiny model, with ``flags`` (``--watermark 0.05``, a queue
    cap, ``--data-parallel-size 2``...)."""
    from tests.e2e.servers import vllm_server

    model = model or tiny_model(max_model_len)
    spec = vllm_server(model, ctx.log_path(name), max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_bytes,
                       extra_args=flags)
    server = Server(name, spec.argv, spec.port, spec.log_path, cpus=cpus)
    about = {"flags": list(flags), "kv_cache_bytes": kv_cache_bytes, "max_model_len": max_model_len}
    return Target(name, "vllm", server, ready_paths=VLLM_READY_PATHS, ready_timeout=900, about=about)
