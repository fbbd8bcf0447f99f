"""vLLM's own frontend as a target: the CPU build's API server on the tiny model, which renders the chat template,
counts the prompt and writes the answer as the gateway does, and a gateway of this tree in front of the same vLLM,
so that a benchmark reads the gateway's CPU per chat (or per token) against the API server's on the same traffic."""

from __future__ import annotations

from collections.abc import Sequence

from bench.harness.context import Context
from bench.harness.processes import cpu_list
from bench.harness.target import Target
from bench.targets import engines, proxies

NAME = "frontend"
GATEWAY = "gateway-vllm"  # the gateway in front of vLLM (target "gateway" measures through it)


def unavailable() -> str | None:
    """Why vLLM's CPU build cannot run here, or None."""
    from testing.servers import vllm_unavailable_reason

    return vllm_unavailable_reason()


def start(ctx: Context, names: list[str], flags: Sequence[str]) -> dict[str, Target]:
    """vLLM on the engine's cores (its worker's threads bound to the first of them), started and ready, then a
    gateway in front of it when ``names`` has the gateway (started once vLLM answers: it would refuse with 503 until
    its next probe otherwise). ``frontend`` is taken out of ``names`` when vLLM is not installed: the caller says
    why (``unavailable``)."""
    if unavailable() is not None:
        names.remove(NAME)
        return {}
    model = engines.tiny_model()
    first = min(cpu_list(ctx.cores.engine)) if ctx.cores.engine else None
    vllm = engines.vllm(ctx, NAME, cpus=ctx.cores.engine, core=first)
    ctx.start(vllm)
    out = {NAME: vllm}
    if "gateway" in names:
        out[GATEWAY] = proxies.gateway(ctx, GATEWAY, [vllm], flags=flags, tokenizer=model)
        ctx.start(out[GATEWAY])
    return out
