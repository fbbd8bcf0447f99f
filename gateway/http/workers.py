"""``--workers N``: N processes accept and relay requests on the gateway's port; the first is the admission
authority (``gateway/workers/authority.py``), or, with the authority apart (``--authority``), the authority is one
process more that listens only on its private sockets and admits for the N others.

Every process binds the port with ``SO_REUSEPORT``, so the kernel spreads connections across them and none
hands bytes to another. The authority (the process ``vllm-guard serve`` started) also listens on two Unix
sockets in a private folder: the workers' channel, and its own HTTP app, to which a worker forwards every route
that is not a guarded one (``/metrics``, ``/health``, ``/guard/*``, the models listing and the pass-through
routes): those answer from the authority's view, as one process would. The authority starts the workers once its
parts are up, restarts one that dies (its requests were released when its channel closed), and stops them on
shutdown after their requests in flight end (uvicorn's graceful shutdown in each).

The private folder is removed on the way out; an authority killed outright (``kill -9``, the OOM killer) leaves
it behind, so every start first removes the folders of this user whose authority is gone (``remove_stale``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gateway.config import Settings

log = logging.getLogger(__name__)

RESTART_BACKOFF = (0.5, 1.0, 2.0, 5.0, 10.0)  # seconds before restarting a worker that died, again and again
PREFIX = "vllm-guard-"  # the private folders: PREFIX, the authority's pid, "-", mkdtemp's random part
# A private folder's whole name (mkdtemp's random part is 8 of [a-z0-9_]), and all it ever holds: its sockets.
# Anything else under /tmp that starts with PREFIX (a user's virtual environment "vllm-guard-venv", say) is not
# the gateway's, however old, and is never removed.
_NAME = re.compile(re.escape(PREFIX) + r"(?:(\d+)-)?[a-z0-9_]{8}")
_HOLDS = frozenset({"authority.sock", "app.sock"})
# A folder without a pid in its name (made before the pid was put there) is left alone this long after its last
# change: its authority may be between making it and binding its socket.
UNNAMED_GRACE = 60.0


@dataclass(frozen=True)
class WorkerPlan:
    """Where the authority and its workers meet: a private folder with the channel and the authority's app.
    ``count``: the processes that accept and relay (``--workers``); ``apart``: the authority is not one of them
    (``--authority``), so each of them is a worker process."""

    count: int
    folder: Path
    apart: bool = False

    @property
    def workers(self) -> int:
        """The worker processes the authority starts: every serving process but itself, unless it is apart."""
        return self.count if self.apart else self.count - 1

    @property
    def channel(self) -> Path:
        return self.folder / "authority.sock"

    @property
    def private(self) -> Path:
        return self.folder / "app.sock"

    @classmethod
    def for_settings(cls, settings: Settings) -> WorkerPlan | None:
        remove_stale(Path(tempfile.gettempdir()))  # a single process too: it may follow a gateway killed outright
        count = settings.worker_count()
        if count <= 1:
            return None
        # Only this user may connect (mkdtemp: mode 0700): the channel admits requests, the app answers admin
        # routes to anyone on it. The pid in the name tells a later start whether the folder's authority lives.
        return cls(count, Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")), settings.authority_apart())

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def remove_stale(root: Path) -> list[Path]:
    """Remove the private folders under ``root`` that an authority killed outright left behind: this user's only,
    whose authority's process is gone and on whose app socket nothing listens. A live gateway's folder is kept
    (its pid is alive, or its socket answers: a gateway in another pid namespace sharing ``/tmp``). The folders
    removed are returned."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            if _NAME.fullmatch(entry.name) and _stale(Path(entry.path)):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(Path(entry.path))
    if removed:
        log.info("removed %d private folder(s) of gateways that are gone: %s", len(removed),
                 ", ".join(str(path) for path in removed))
    return removed


def _stale(folder: Path) -> bool:
    try:
        info = folder.lstat()
    except OSError:
        return False
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return False  # another user's, or not a folder (a link to one): never ours to remove
    if not _only_sockets(folder):
        return False
    pid = _pid_of(folder.name)
    gone = not _alive(pid) if pid is not None else time.time() - info.st_mtime > UNNAMED_GRACE
    return gone and not _listening(folder / "app.sock")


def _only_sockets(folder: Path) -> bool:
    """Whether the folder holds nothing but what an authority puts there: its two sockets, or less."""
    try:
        with os.scandir(folder) as entries:
            return all(
                entry.name in _HOLDS and stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode)
                for entry in entries
            )
    except OSError:
        return False


def _pid_of(name: str) -> int | None:
    found = _NAME.fullmatch(name)
    return int(found.group(1)) if found is not None and found.group(1) is not None else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process took the pid: alive, so the folder stays
    return True


def _listening(path: Path) -> bool:
    """Whether a server accepts connections on the Unix socket ``path`` (connecting to a live authority's app
    socket is harmless: a connection that sends nothing and closes)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(str(path))
        except OSError as exc:
            return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK)
        return True


class WorkerPool:
    """The worker processes, each restarted when it dies, all stopped on shutdown."""

    def __init__(self, settings: Settings, plan: WorkerPlan) -> None:
        self._settings = settings
        self._plan = plan
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False

    async def start(self) -> None:
        for index in range(1, self._plan.workers + 1):
            self._tasks.append(asyncio.create_task(self._keep(index), name=f"worker-{index}"))

    async def _keep(self, index: int) -> None:
        failures = 0
        while not self._stopping:
            proc = await self._spawn(index)
            self._procs[index] = proc
            code = await proc.wait()
            self._procs.pop(index, None)
            if self._stopping:
                return
            delay = RESTART_BACKOFF[min(failures, len(RESTART_BACKOFF) - 1)]
            failures += 1
            log.warning("gateway worker %d exited with %s; restarting it in %g s", index, code, delay)
            await asyncio.sleep(delay)

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        plan = self._plan
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.http.worker_main", "--index", str(index),
            "--channel", str(plan.channel), "--private", str(plan.private),
            stdin=asyncio.subprocess.PIPE,
        )
        assert proc.stdin is not None
        # The settings go through a pipe: never on a command line or in the environment, where keys would show.
        proc.stdin.write(self._settings.model_dump_json().encode())
        await proc.stdin.drain()
        proc.stdin.close()
        return proc

    async def stop(self, timeout: float = 15.0) -> None:
        """Ask every worker to finish what it serves and exit; kill what is left after ``timeout``."""
        self._stopping = True
        procs = list(self._procs.values())
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), timeout)
        except TimeoutError:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
