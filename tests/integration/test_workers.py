"""``--workers 2``: two processes serve the port; the admission, the tenants' limits and what ``/metrics`` and
the access log report stay one, as with one process; a worker that dies gives back what it held and is
restarted.

The gateway under test is an admission authority in this process (its parts are inspected directly) with one
worker process beside it; the engine is the vLLM simulator, which allocates KV blocks as vLLM does and counts
its own preemptions.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import Settings
from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import SimConfig, SimServer, run_sim_server

BLOCKS = 32
BLOCK = 16
# 40 completions of 16 prompt + 32 output tokens (3 blocks each) against an engine of 32 blocks.
FLOOD, PROMPT, OUTPUT = 40, 16, 32


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": [7] * PROMPT, "max_tokens": OUTPUT, **extra}


SIM = SimConfig(model="tiny", max_model_len=2048, num_blocks=BLOCKS, block_size=BLOCK, token_delay=0.003)


def strict(tokenizer_dir: Path) -> Settings:
    """Strict admission against the simulator's small KV budget: one ledger for all processes is then visible."""
    return Settings(
        tokenizer=str(tokenizer_dir), scrape_interval=0.05, admission_policy="strict", kv_target=0.9,
        queue_timeout=30.0,
    )


@pytest.fixture(scope="module", name="sim")
def sim_server() -> Iterator[SimServer]:
    """The simulator; a module that imports this fixture gets its own (the scope is the module's)."""
    with run_sim_server(SIM) as server:
        yield server


@pytest.fixture(scope="module")
def gateway(sim: SimServer, tokenizer_dir: Path) -> Iterator[GatewayServer]:
    with run_gateway(strict(tokenizer_dir), upstream=sim.url, workers="2") as gw:
        yield gw


def worker_pid(gw: GatewayServer) -> int:
    authority = gw.parts.authority
    assert authority is not None and authority.serving() == 1
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _is_worker(int(p))]
    assert len(pids) == 1, pids
    return pids[0]


def _is_worker(pid: int) -> bool:
    """A worker process this test process started (the authority runs here, in a thread)."""
    with contextlib.suppress(OSError):
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        return b"gateway.http.worker_main" in cmd and _parent(pid) == os.getpid()
    return False


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _server_inode(port: int, client_port: int) -> int:
    """The inode of the socket a process accepted for the client's connection from ``client_port`` (0: none yet)."""
    want = (f"0100007F:{port:04X}", f"0100007F:{client_port:04X}")
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if (fields[1], fields[2]) == want:
            return int(fields[9])
    return 0


def _holds(pid: int, inode: int) -> bool:
    target = f"socket:[{inode}]"
    with contextlib.suppress(OSError):
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == target for fd in os.listdir(f"/proc/{pid}/fd"))
    return False


async def connection_on(gw: GatewayServer, worker: bool) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the gateway that the worker process accepted (``worker``), or the authority did: the kernel
    spreads connections across the processes, so the test makes some until one lands where it wants."""
    pid, port = worker_pid(gw), int(gw.url.rsplit(":", 1)[1])
    for _ in range(64):
        reader, writer, inode = await accepted(port)
        if _holds(pid, inode) == worker:
            return reader, writer
        writer.close()
    raise AssertionError("no connection landed on the process wanted")


async def accepted(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int]:
    """A new connection to the gateway's ``port``, once a process accepted it, and the inode of its server side."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    client_port = writer.get_extra_info("sockname")[1]
    deadline = time.monotonic() + 5.0
    while not (inode := _server_inode(port, client_port)):
        assert time.monotonic() < deadline, "the gateway did not accept the connection"
        await asyncio.sleep(0.01)
    return reader, writer, inode


async def exchange(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], method: str, path: str,
    body: dict[str, Any] | None = None, headers: dict[str, str] | None = None, timeout: float = 30.0,
) -> tuple[int, dict[str, str], bytes]:
    """One request on the connection, which then closes: the status, the headers (lower case), the whole body
    (``timeout``: a request that gets no answer fails the test rather than hang it)."""
    reader, writer = conn
    data = b"" if body is None else orjson.dumps(body)
    head = [f"{method} {path} HTTP/1.1", "host: gateway", "connection: close", f"content-length: {len(data)}"]
    if body is not None:
        head.append("content-type: application/json")
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
    try:
        raw = await asyncio.wait_for(reader.read(-1), timeout)
    finally:
        writer.close()
    top, _, rest = raw.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    got = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), {k.lower(): v for k, v in got.items()}, rest


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def flood(url: str, n: int, body: dict[str, Any]) -> list[httpx.Response]:
    """n requests at once, each on its own connection (so the kernel spreads them over both processes)."""
    async def one() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60.0) as client:
            return await client.post(url + "/v1/completions", json=body)

    return await asyncio.gather(*(one() for _ in range(n)))


def committed_peak(gw: GatewayServer, stop: list[bool], seen: list[int]) -> None:
    while not stop[0]:
        seen.append(gw.status()["committed_blocks"])
        time.sleep(0.002)


def watched_flood(gw: GatewayServer) -> tuple[list[httpx.Response], int]:
    """The flood that fills the KV budget, and the most blocks the books held at once meanwhile."""
    import threading

    stop, seen = [False], [0]
    watcher = threading.Thread(target=committed_peak, args=(gw, stop, seen))
    watcher.start()
    try:
        answers = asyncio.run(flood(gw.url, FLOOD, completion(ignore_eos=True)))
    finally:
        stop[0] = True
        watcher.join()
    return answers, max(seen)


def test_both_processes_serve_and_the_books_never_pass_the_budget(gateway: GatewayServer, sim: SimServer) -> None:
    pid = worker_pid(gateway)
    before_worker, preempted = cpu_seconds(pid), sim.sim.preemptions_total
    answers, peak = watched_flood(gateway)
    assert [r.status_code for r in answers] == [200] * FLOOD
    assert cpu_seconds(pid) > before_worker, "the worker process served none of the flood"
    assert peak <= int(0.9 * BLOCKS) and sim.sim.preemptions_total == preempted  # strict: one ledger for both
    gateway.wait_ledger_empty()


def test_metrics_add_up_every_process(gateway: GatewayServer) -> None:
    def served() -> float:
        text = httpx.get(gateway.url + "/metrics").text
        for family in text_string_to_metric_families(text):
            if family.name == "vllm_guard_requests":
                return sum(s.value for s in family.samples
                           if s.name.endswith("_total") and s.labels == {"route": "completions", "outcome": "ok"})
        return 0.0

    before = served()
    answers = asyncio.run(flood(gateway.url, 12, completion()))
    assert all(r.status_code == 200 for r in answers)
    assert served() - before == 12
    own = gateway.parts.metrics.requests.labels("completions", "ok")._value.get()
    assert own < served(), "the authority's own count alone: the worker's requests were not added"


def test_a_worker_that_dies_gives_back_what_it_held_and_comes_back(gateway: GatewayServer) -> None:
    async def streams() -> None:
        async with httpx.AsyncClient(timeout=30.0) as client:
            async def one() -> None:
                with contextlib.suppress(httpx.HTTPError):
                    async with client.stream("POST", gateway.url + "/v1/completions",
                                             json=completion(max_tokens=400, stream=True, ignore_eos=True)) as r:
                        async for _ in r.aiter_bytes():
                            pass

            tasks = [asyncio.create_task(one()) for _ in range(8)]
            await asyncio.sleep(0.5)
            os.kill(worker_pid(gateway), signal.SIGKILL)
            await asyncio.gather(*tasks)

    asyncio.run(streams())
    gateway.wait_ledger_empty(timeout=10.0)
    gateway.wait_workers(1, timeout=60.0)
    answers = asyncio.run(flood(gateway.url, 8, completion()))
    assert [r.status_code for r in answers] == [200] * 8
