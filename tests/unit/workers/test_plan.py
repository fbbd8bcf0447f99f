"""The private folder of ``--workers``: named after its authority's pid, and the folders that authorities killed
outright left behind removed at the next start, never a live gateway's nor another user's."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.config import Settings
from gateway.http import workers
from gateway.http.serving import sockets_for
from gateway.http.workers import UNNAMED_GRACE, WorkerPlan, remove_stale
from testing.servers import free_port


@pytest.fixture
def gone_pid() -> int:
    """The pid of a process that has exited."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def listeners() -> Iterator[list[socket.socket]]:
    held: list[socket.socket] = []
    yield held
    for sock in held:
        sock.close()


def folder(root: Path, name: str, *, socket_file: bool = True) -> Path:
    path = root / name
    path.mkdir(mode=0o700)
    if socket_file:  # a socket bound and closed: its file stays, nothing listens
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(path / "app.sock"))
    return path


def test_a_start_removes_the_folder_an_authority_killed_outright_left_behind(
    tmp_path: Path, gone_pid: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    left = folder(tmp_path, f"vllm-guard-{gone_pid}-k2j_x9aa")
    plan = WorkerPlan.for_settings(Settings(workers="2"))
    assert plan is not None
    try:
        assert not left.exists()
        assert plan.folder.parent == tmp_path and plan.folder.name.startswith(f"vllm-guard-{os.getpid()}-")
        assert plan.folder.stat().st_mode & 0o777 == 0o700
    finally:
        plan.remove()


def test_a_single_process_start_removes_them_too(
    tmp_path: Path, gone_pid: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    left = folder(tmp_path, f"vllm-guard-{gone_pid}-abc_1234")
    assert WorkerPlan.for_settings(Settings()) is None
    assert not left.exists()


def _live(root: Path, pid: int, listeners: list[socket.socket]) -> Path:
    return folder(root, f"vllm-guard-{os.getpid()}-abc_1234")


def _listening(root: Path, pid: int, listeners: list[socket.socket]) -> Path:
    """Its pid is gone here, yet its socket answers (an authority in another pid namespace sharing /tmp)."""
    path = folder(root, f"vllm-guard-{pid}-abc_1234", socket_file=False)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path / "app.sock"))
    sock.listen()
    listeners.append(sock)
    return path


def _unnamed_fresh(root: Path, pid: int, listeners: list[socket.socket]) -> Path:
    return folder(root, "vllm-guard-q8w_e2rt", socket_file=False)  # its authority may be about to bind


def _a_file(root: Path, pid: int, listeners: list[socket.socket]) -> Path:
    path = root / f"vllm-guard-{pid}-abc_1234"
    path.write_text("not a folder")
    return path


def _a_link(root: Path, pid: int, listeners: list[socket.socket]) -> Path:
    target = folder(root, "elsewhere")
    path = root / f"vllm-guard-{pid}-abc_1234"
    path.symlink_to(target)
    return path


def _other_prefix(root: Path, pid: int, listeners: list[socket.socket]) -> Path:
    return folder(root, f"vllm-guardian-{pid}-abc_1234")


def _a_users_folder(root: Path, pid: int, listeners: list[socket.socket]) -> Path:
    """A virtual environment a user named after the project: not the gateway's, however old."""
    path = folder(root, "vllm-guard-venv", socket_file=False)
    (path / "bin").mkdir()
    (path / "bin" / "python").write_text("")
    _age(path)
    return path


def _random_looking_name_other_contents(root: Path, pid: int, listeners: list[socket.socket]) -> Path:
    path = folder(root, "vllm-guard-results")  # 7 letters: not mkdtemp's 8
    _age(path)
    return path


def _more_than_sockets(root: Path, pid: int, listeners: list[socket.socket]) -> Path:
    path = folder(root, f"vllm-guard-{pid}-k2j_x9aa")
    (path / "notes.txt").write_text("the user's")
    return path


def _unnamed_with_more_than_sockets(root: Path, pid: int, listeners: list[socket.socket]) -> Path:
    path = folder(root, "vllm-guard-q8w_e2rt")
    (path / "lib").mkdir()
    _age(path)
    return path


def _age(path: Path) -> None:
    long_ago = time.time() - UNNAMED_GRACE - 5
    os.utime(path, (long_ago, long_ago))


Make = Callable[[Path, int, list[socket.socket]], Path]


@pytest.mark.parametrize(
    "make",
    [_live, _listening, _unnamed_fresh, _a_file, _a_link, _other_prefix, _a_users_folder,
     _random_looking_name_other_contents, _more_than_sockets, _unnamed_with_more_than_sockets],
    ids=["its authority lives", "its socket answers", "no pid, just made", "a file", "a link", "another name",
         "a user's vllm-guard-venv", "not mkdtemp's name", "more than sockets", "no pid, more than sockets"],
)
def test_what_may_still_be_in_use_or_is_not_a_gateways_folder_is_kept(
    tmp_path: Path, gone_pid: int, listeners: list[socket.socket], make: Make
) -> None:
    path = make(tmp_path, gone_pid, listeners)
    assert remove_stale(tmp_path) == []
    assert path.exists()


def test_an_unnamed_folder_nothing_listens_on_is_removed_once_old(tmp_path: Path) -> None:
    path = folder(tmp_path, "vllm-guard-q8w_e2rt")
    long_ago = time.time() - UNNAMED_GRACE - 5
    os.utime(path, (long_ago, long_ago))
    assert remove_stale(tmp_path) == [path]
    assert not path.exists()


def test_another_users_folder_is_kept(tmp_path: Path, gone_pid: int, monkeypatch: pytest.MonkeyPatch) -> None:
    path = folder(tmp_path, f"vllm-guard-{gone_pid}-abc_1234")
    monkeypatch.setattr(workers.os, "getuid", lambda: path.stat().st_uid + 1)
    assert remove_stale(tmp_path) == []
    assert path.exists()


def test_a_root_that_cannot_be_read_removes_nothing(tmp_path: Path) -> None:
    assert remove_stale(tmp_path / "missing") == []


@pytest.mark.parametrize(
    ("workers", "authority", "apart", "started"),
    [
        ("2", "auto", False, 1),  # a serving authority and one worker: the same bound as apart, one process less
        ("3", "auto", True, 3),  # from three on the authority's core fills first: apart
        ("8", "auto", True, 8),
        ("4", "serving", False, 3),
        ("2", "apart", True, 2),
    ],
)
def test_the_authority_serves_or_stands_apart_and_starts_a_worker_for_every_other_serving_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: str, authority: str, apart: bool, started: int
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    plan = WorkerPlan.for_settings(Settings(workers=workers, authority=authority))
    assert plan is not None
    try:
        assert (plan.apart, plan.workers, plan.count) == (apart, started, int(workers))
    finally:
        plan.remove()


@pytest.mark.parametrize("authority", ["auto", "serving", "apart"])
def test_one_process_has_no_authority_to_set_apart(authority: str) -> None:
    settings = Settings(workers="1", authority=authority)
    assert not settings.authority_apart() and WorkerPlan.for_settings(settings) is None


def test_an_authority_apart_listens_only_on_its_private_socket(tmp_path: Path) -> None:
    settings = Settings(workers="2", host="127.0.0.1", port=free_port())
    (tmp_path / "apart").mkdir()
    (tmp_path / "serving").mkdir()
    apart = sockets_for(settings, WorkerPlan(2, tmp_path / "apart", apart=True))
    serving = sockets_for(settings, WorkerPlan(2, tmp_path / "serving", apart=False))
    try:
        assert [(s.family, s.getsockname()) for s in apart] == [(socket.AF_UNIX, str(tmp_path / "apart/app.sock"))]
        assert [s.family for s in serving] == [socket.AF_INET, socket.AF_UNIX]
    finally:
        for sock in apart + serving:
            sock.close()


def test_an_unknown_authority_mode_is_refused() -> None:
    with pytest.raises(ValidationError, match="authority"):
        Settings(workers="2", authority="elsewhere")


def test_an_authority_apart_says_at_its_start_that_another_program_holds_the_port(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        settings = Settings(workers="3", host="127.0.0.1", port=held.getsockname()[1])
        with pytest.raises(OSError, match="in use"):
            sockets_for(settings, WorkerPlan(3, tmp_path, apart=True))
    assert not (tmp_path / "app.sock").exists()
