"""vLLM's command line: how it is started, the flags the gateway adds or overrides, and how it is shown."""

from __future__ import annotations

import re
import shlex
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from gateway.config import Settings
from gateway.vllm_args import arg_value, with_arg

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
_PYTHON = re.compile(r"python[\d.]*$")


def base_command(settings: Settings, vllm_script: str | None) -> list[str]:
    """The command that starts vLLM's API server for ``settings.model``, without gateway-set flags.

    ``--vllm-command`` may name a whole command (``{model}`` is substituted; a trailing ``serve``
    takes the model positionally, anything else gets ``--model``) or just another environment's python.
    """
    model = settings.model or ""
    if settings.vllm_command:
        parts = shlex.split(settings.vllm_command)
        if any("{model}" in p for p in parts):
            return [p.replace("{model}", model) for p in parts]
        if len(parts) == 1 and _PYTHON.search(Path(parts[0]).name):
            return [parts[0], "-m", API_SERVER_MODULE, "--model", model]
        if parts and parts[-1] == "serve":
            return [*parts, model]
        return [*parts, "--model", model]
    if vllm_script is not None:
        return [vllm_script, "serve", model]
    return [sys.executable, "-m", API_SERVER_MODULE, "--model", model]


def engine_args(settings: Settings, overrides: Mapping[str, str], port: int) -> list[str]:
    """vLLM's arguments after the model: the user's, what the gateway's settings imply, the auto-fit
    overrides, and the private address the gateway reaches it at."""
    s = settings
    args = list(s.vllm_args)
    if s.served_model_name and arg_value(args, "--served-model-name") is None:
        args += ["--served-model-name", s.served_model_name]
    if s.upstream_api_key and arg_value(args, "--api-key") is None:
        args += ["--api-key", s.upstream_api_key]
    if s.max_model_len and arg_value(args, "--max-model-len") is None:
        # The gateway never lets longer requests through, so vLLM need not reserve for them.
        args += ["--max-model-len", str(s.max_model_len)]
    for name, value in overrides.items():
        args = with_arg(args, name, value)
    args = with_arg(args, "--host", "127.0.0.1")
    return with_arg(args, "--port", str(port))


def redact(command: Sequence[str]) -> list[str]:
    """The command with its API key hidden, for logs and /guard/status."""
    out = list(command)
    for i, a in enumerate(out):
        if a == "--api-key" and i + 1 < len(out):
            out[i + 1] = "***"
        elif a.startswith("--api-key="):
            out[i] = "--api-key=***"
    return out


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, for the engine's private address."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
