"""Starting and stopping the processes a benchmark measures: each in its own session, its output in a log file,
pinned to cores when asked, killed with its whole group at the end (vLLM forks an engine core; a stray one keeps
a core busy on a small machine)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_PR_SET_PDEATHSIG = 1


def pinned(cpus: str | None) -> list[str]:
    """``taskset -c CPUS`` before a command, when cores are named and the machine can pin; else nothing."""
    if not cpus or shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2:
        return []
    return ["taskset", "-c", cpus]


def cpu_list(spec: str) -> set[int]:
    """The cores of a taskset list such as ``0``, ``1,2`` or ``2-5``."""
    out: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


def offline_env() -> dict[str, str]:
    """Nothing downloads at run time: models and tokenizers are local directories."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


@dataclass
class Server:
    """One server subprocess: ``argv`` (without the pinning), listening on ``port``, logging to ``log_path``."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    cpus: str | None = None
    cwd: Path = ROOT
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        return self.proc.pid

    @property
    def command(self) -> list[str]:
        return [*pinned(self.cpus), *self.argv]

    def start(self) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"$ {' '.join(self.command)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.command, cwd=self.cwd, env={**offline_env(), **self.env}, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent,
            )  # fmt: skip
        return self

    def restart(self) -> Server:
        """The same command started again on the same port (after a kill), its log appended to. From the main
        thread: a server is sent SIGTERM when the thread that started it ends."""
        self.proc = None
        return self.start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return f"(no log at {self.log_path})"

    def wait_ready(self, paths: Sequence[str], timeout: float, *, clock: Callable[[], float] = time.monotonic,
                   pause: Callable[[float], None] = time.sleep) -> Server:
        """Until every path answers 200; fails at once, with the log's tail, if the process exits."""
        deadline = clock() + timeout
        pending = list(paths)
        while pending:
            if not self.alive():
                raise StartError(self, f"{self.name} exited before it was ready")
            if answers_ok(self.url + pending[0]):
                pending.pop(0)
                continue
            if clock() >= deadline:
                raise StartError(self, f"{self.name} was not ready within {timeout:.0f} s ({pending[0]})")
            pause(0.2)
        return self

    def signal(self, sig: signal.Signals) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM to the whole group, SIGKILL after ``grace`` seconds; idempotent."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            self.signal(signal.SIGCONT)  # a stopped process cannot take its SIGTERM
            self.signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                proc.wait(timeout=grace)
        self.signal(signal.SIGKILL)  # the leader may be gone while a child lingers in its group


class StartError(RuntimeError):
    def __init__(self, server: Server, message: str) -> None:
        super().__init__(f"{message}\n--- last lines of {server.log_path} ---\n{server.log_tail()}")


def answers_ok(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def python(module: str, *args: str) -> list[str]:
    """This interpreter running a module of this repository."""
    return [sys.executable, "-m", module, *args]


def stop_all(servers: Iterable[Server]) -> None:
    for server in servers:
        with contextlib.suppress(Exception):
            server.stop()


def _die_with_parent() -> None:
    # Between fork and exec: if the benchmark is killed outright, the kernel sends the server SIGTERM.
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1 (the server binds it right after)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
