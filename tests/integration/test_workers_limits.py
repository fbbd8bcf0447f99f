"""``--max-connections`` with ``--workers 2``: each process accepts its share of client connections, and a
worker's forwarded routes (``/health``, the models listing: over the authority's private app socket) are served
even while the authority holds its whole share; they are never counted as a client's."""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.config import Settings
from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import SimConfig, SimServer, run_sim_server

CAP = 4  # two client connections for each of the two processes


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    with run_sim_server(SimConfig(model="tiny", max_model_len=2048, num_blocks=64, block_size=16)) as server:
        yield server


@pytest.fixture(scope="module")
def gateway(sim: SimServer, tokenizer_dir: Path) -> Iterator[GatewayServer]:
    # Fresh connections wait for their first request for the shorter of the two: long enough to hold them.
    settings = Settings(
        tokenizer=str(tokenizer_dir), scrape_interval=0.05, max_connections=CAP, header_timeout=30.0,
        keep_alive_timeout=30.0,
    )
    with run_gateway(settings, upstream=sim.url, workers="2") as gw:
        yield gw


def accepted_here(client: socket.socket, port: int, timeout: float = 5.0) -> bool:
    """Whether the gateway's end of ``client``'s connection was accepted by this process (the authority runs in
    the test's process) rather than by the worker: its socket's inode is among this process's descriptors."""
    mine = client.getsockname()[1]
    deadline = time.monotonic() + timeout
    while True:
        inode = _server_inode(port, mine)
        if inode is not None:
            return f"socket:[{inode}]" in _own_sockets()
        assert time.monotonic() < deadline, "the gateway accepted no connection"
        time.sleep(0.01)


def _server_inode(port: int, peer: int) -> str | None:
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, inode = fields[1], fields[2], fields[9]
        if int(local.split(":")[1], 16) == port and int(remote.split(":")[1], 16) == peer and inode != "0":
            return inode
    return None


def _own_sockets() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found.add(os.readlink(f"/proc/self/fd/{fd}"))
    return found


def get(sock: socket.socket, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", timeout=10)
    conn.sock = sock  # this connection, whose process is known
    conn.request("GET", path)
    response = conn.getresponse()
    return response.status, response.read()


def test_a_workers_forwarded_routes_are_served_while_the_authority_holds_its_share(gateway: GatewayServer) -> None:
    port = int(gateway.url.rsplit(":", 1)[1])
    held: list[socket.socket] = []
    try:
        for _ in range(200):  # the kernel spreads connections: keep the authority's, until it holds its share
            sock = socket.create_connection(("127.0.0.1", port))
            if accepted_here(sock, port) and len(held) < CAP // 2:
                held.append(sock)
                continue
            if accepted_here(sock, port):  # past its share: refused, as it should be
                sock.close()
                continue
            if len(held) < CAP // 2:
                sock.close()
                continue
            with sock:  # a connection the worker accepted, the authority holding both of its own
                assert get(sock, "/health")[0] == 200
                status, body = get(sock, "/v1/models")
                assert status == 200, body
                assert b'"tiny"' in body
            return
        pytest.fail("no connection reached the worker")
    finally:
        for sock in held:
            sock.close()
