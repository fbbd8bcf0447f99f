"""Session fixtures for the end-to-end suite: one real vLLM (CPU build) per session, gateways in front.

vLLM starts once (about 45 s); each gateway policy variant starts once, on first use. Every server
runs in its own process group and is killed as a group by the fixture's finalizer and, should the
session die before finalizers run, by an atexit hook. A failing test shows the tail of every
server's log.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import openai
import pytest

from testing.servers import (
    API_KEY,
    DEFAULT_MAX_MODEL_LEN,
    GATEWAY_MAX_MODEL_LEN,
    GATEWAY_READY_PATHS,
    VLLM_READY_PATHS,
    ServerProcess,
    ServerStartError,
    ensure_tiny_model,
    gateway_server,
    vllm_server,
    vllm_unavailable_reason,
)

# About 45 s on an idle 2-core machine; several times that while other work shares the cores.
VLLM_START_TIMEOUT = 300.0
GATEWAY_START_TIMEOUT = 90.0

_servers_key = pytest.StashKey[list[ServerProcess]]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_servers_key] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed:
        for server in item.config.stash.get(_servers_key, []):
            report.sections.append((f"{server.name} log ({server.log_path})", server.log_tail(40)))
    return report


def _start(config: pytest.Config, server: ServerProcess, paths: tuple[str, ...], timeout: float) -> None:
    config.stash[_servers_key].append(server)
    # atexit covers an interrupted session whose finalizers never ran; stop() is idempotent.
    atexit.register(server.stop)
    server.start()
    server.wait_ready(paths, timeout)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if reason := vllm_unavailable_reason():
        pytest.skip(reason)
    with (_log_dir(tmp_path_factory) / "tinymodel.log").open("w", encoding="utf-8") as log:
        return ensure_tiny_model(DEFAULT_MAX_MODEL_LEN, log=log)


@pytest.fixture(scope="session")
def vllm(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = vllm_server(tiny_model, _log_dir(tmp_path_factory) / "vllm.log")
    request.addfinalizer(server.stop)
    try:
        _start(request.config, server, VLLM_READY_PATHS, VLLM_START_TIMEOUT)
    except ServerStartError as exc:
        if _import_failed(server):
            pytest.skip(f"vLLM cannot run here, its import fails:\n{server.log_tail(15)}")
        raise exc
    yield server


def _gateway_fixture(*args: str) -> Callable[..., Iterator[ServerProcess]]:
    def fixture(
        request: pytest.FixtureRequest, vllm: ServerProcess, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[ServerProcess]:
        name = request.fixturename or "gateway"
        server = gateway_server(
            vllm.url, _log_dir(tmp_path_factory) / f"{name}.log", ["--api-key", API_KEY, *args], name=name
        )
        request.addfinalizer(server.stop)
        _start(request.config, server, GATEWAY_READY_PATHS, GATEWAY_START_TIMEOUT)
        yield server

    return fixture


reject_gateway = pytest.fixture(scope="session", name="reject_gateway")(
    _gateway_fixture("--on-prompt-overflow", "reject", "--max-model-len", str(GATEWAY_MAX_MODEL_LEN))
)
truncate_gateway = pytest.fixture(scope="session", name="truncate_gateway")(
    _gateway_fixture("--on-prompt-overflow", "truncate")
)


@pytest.fixture(scope="session")
def client(reject_gateway: ServerProcess) -> Iterator[openai.OpenAI]:
    """An OpenAI SDK client pointed at the reject gateway; no retries, so every answer is seen as sent."""
    with openai.OpenAI(base_url=f"{reject_gateway.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def truncating_client(truncate_gateway: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{truncate_gateway.url}/v1", api_key=API_KEY, max_retries=0, timeout=120
    ) as c:
        yield c


@pytest.fixture(scope="session")
def vllm_client(vllm: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{vllm.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _log_dir(factory: pytest.TempPathFactory) -> Path:
    path = factory.getbasetemp() / "e2e-logs"
    path.mkdir(exist_ok=True)
    return path


def _import_failed(server: ServerProcess) -> bool:
    """vLLM died while importing itself: the package cannot run here (as opposed to a real failure)."""
    if server.alive():
        return False
    tail = server.log_tail(80)
    return any(marker in tail for marker in ("ModuleNotFoundError", "ImportError")) and "vllm" in tail
