"""The compiled admission (``gateway/native.py``): a build is used only while it matches every source of the package,
never half made, and what crosses the workers' channel is never compiled."""

from __future__ import annotations

import dataclasses
import sys
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest

import gateway.admission.controller
from gateway import native
from gateway.workers import messages


def checkout(tmp_path: Path) -> Path:
    """A root with a ``gateway`` package of two sources."""
    (tmp_path / "gateway" / "admission").mkdir(parents=True)
    (tmp_path / "gateway" / "__init__.py").write_text("")
    (tmp_path / "gateway" / "admission" / "queue.py").write_text("X = 1\n")
    return tmp_path


def made(root: Path, *, done: bool = True) -> Path:
    """A build folder for ``root``'s sources as they are now (``done``: finished)."""
    where = root / native.BUILDS / native.key(root)
    (where / "lib").mkdir(parents=True)
    (where / "modules").mkdir()
    if done:
        (where / native.DONE).write_text("gateway/admission/queue.py\n")
    return where


@pytest.fixture(autouse=True)
def kept_state() -> Iterator[None]:
    state, path = (native._enabled, native._active), list(sys.path)
    native._enabled = True  # as a process that did not ``disable`` (testing.pure's) sees it
    yield
    native._enabled, native._active = state
    sys.path[:] = path


def test_a_checkout_never_built_runs_the_pure_modules(tmp_path: Path) -> None:
    package_path = ["src"]
    assert native.activate(package_path, checkout(tmp_path)) is None
    assert package_path == ["src"]


def test_a_build_for_these_sources_comes_first_on_the_package_path_and_its_library_on_the_import_path(
    tmp_path: Path,
) -> None:
    root = checkout(tmp_path)
    where = made(root)
    package_path = ["src"]
    assert native.activate(package_path, root) == where
    assert package_path == [str(where / "modules"), "src"]
    assert str(where / "lib") in sys.path


@pytest.mark.parametrize("change", [
    pytest.param(lambda root: (root / "gateway" / "admission" / "queue.py").write_text("X = 2\n"),
                 id="a source edited"),
    pytest.param(lambda root: (root / "gateway" / "admission" / "order.py").write_text(""), id="a source added"),
    pytest.param(lambda root: (root / "gateway" / "admission" / "queue.py").rename(root / "gateway" / "queue.py"),
                 id="a source moved"),
])
def test_a_build_for_other_sources_is_not_used(tmp_path: Path, change: typing.Callable[[Path], object]) -> None:
    root = checkout(tmp_path)
    made(root)
    change(root)
    package_path = ["src"]
    assert native.activate(package_path, root) is None
    assert package_path == ["src"]


def test_what_is_not_a_source_does_not_change_the_key(tmp_path: Path) -> None:
    root = checkout(tmp_path)
    key = native.key(root)
    (root / "gateway" / "admission" / "notes.txt").write_text("anything")
    (root / "gateway" / "admission" / "queue.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\0")
    assert native.key(root) == key


def test_a_build_that_did_not_finish_is_never_used(tmp_path: Path) -> None:
    root = checkout(tmp_path)
    made(root, done=False)
    assert native.activate(["src"], root) is None


def test_a_disabled_process_runs_the_pure_modules_whatever_is_built(tmp_path: Path) -> None:
    root = checkout(tmp_path)
    made(root)
    native.disable()
    assert native.activate(["src"], root) is None


def _dataclasses_in(tp: object, seen: set[type]) -> None:
    for arg in typing.get_args(tp):
        _dataclasses_in(arg, seen)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp) and tp not in seen:
        seen.add(tp)
        for hint in typing.get_type_hints(tp).values():
            _dataclasses_in(hint, seen)


def test_every_value_the_workers_channel_carries_reads_back_its_own_types_compiled() -> None:
    # The channel's codec builds its decoders from these dataclasses' type hints, and a compiled module's read back
    # erased (``int | None`` as ``type``, ``Sequence[int]`` as ``Sequence``): the workers would not start. Such
    # values live in the modules kept pure, or have only fields of the classes that erase to themselves.
    carried: set[type] = set()
    for message in typing.get_args(messages.Message):
        _dataclasses_in(message, carried)
    plain = {int, str, float, bool}
    erased = {
        f"{cls.__module__}.{cls.__name__}": hints for cls in carried
        if cls.__module__.startswith(f"gateway.{native.PACKAGE}.")
        and f"{cls.__module__.rsplit('.', 1)[1]}.py" not in native.PURE
        and not set((hints := typing.get_type_hints(cls)).values()) <= plain
    }
    assert not erased, f"values the workers' channel carries, with types a compiled module erases: {erased}"
    assert {"Destination", "PromptPrefix", "Capacity"} <= {cls.__name__ for cls in carried}


def test_the_admission_runs_compiled_exactly_when_a_build_is_active() -> None:
    where = native.active()
    source = Path(gateway.admission.controller.__file__ or "")
    if where is None:
        assert source.suffix == ".py"
    else:
        assert source.parent == where / "modules" and source.suffix == ".so"


def test_a_package_mypyc_refuses_leaves_no_build_and_says_why(tmp_path: Path) -> None:
    root = checkout(tmp_path)
    (root / "gateway" / "admission" / "queue.py").write_text('X: int = "not a number"\n')
    with pytest.raises(RuntimeError, match="mypyc failed"):
        native.build(root)
    assert not (root / native.BUILDS).exists()
    assert native.activate(["src"], root) is None


def test_a_build_already_made_for_these_sources_is_kept(tmp_path: Path) -> None:
    root = checkout(tmp_path)
    where = made(root)
    assert native.build(root) == where


@pytest.mark.parametrize(("built", "says"), [(True, "compiled: "), (False, "pure Python: no build")])
def test_status_says_whether_a_build_matches_the_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], built: bool, says: str,
) -> None:
    root = checkout(tmp_path)
    if built:
        made(root)
    monkeypatch.setattr(native, "top", lambda: root)
    assert native.main(["status"]) == 0
    assert capsys.readouterr().out.startswith(says)
