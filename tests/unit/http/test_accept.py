"""The gateway's port is accepted in bursts: the connections waiting when the socket is ready are all taken at once
(up to a bound), each served by the server's own protocol, and stopping the acceptor leaves the server's port
open."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.config import Settings
from gateway.http.accept import BurstAcceptor
from gateway.http.serving import build_server, listening_socket, private_socket
from testing.gateway_thread import free_port


class Counted(asyncio.Protocol):
    made: list[Counted] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        Counted.made.append(self)
        self.transport = transport

    @classmethod
    def fresh(cls) -> Counted:
        return cls()


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    sock.setblocking(False)
    Counted.made = []
    yield sock
    sock.close()


def connect(listener: socket.socket, count: int) -> list[socket.socket]:
    """``count`` clients whose connections wait in the listener's accept queue."""
    clients = []
    for _ in range(count):
        client = socket.create_connection(listener.getsockname())
        clients.append(client)
    return clients


async def turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def close_all(acceptor: BurstAcceptor, clients: list[socket.socket]) -> None:
    """Stop the acceptor and close both ends of every connection it took."""
    acceptor.stop()
    for protocol in Counted.made:
        protocol.transport.close()
    for client in clients:
        client.close()
    await turns()


@pytest.mark.parametrize(("pending", "burst", "taken"), [
    (40, 128, 40),  # every waiting connection at once
    (40, 16, 16),  # at most the burst; the rest at the next readiness
    (0, 128, 0),  # nothing waiting: nothing taken, no error
])
async def test_one_readiness_takes_the_waiting_connections_up_to_the_burst(
    listener: socket.socket, pending: int, burst: int, taken: int,
) -> None:
    acceptor = BurstAcceptor(listener, Counted.fresh, burst=burst)
    clients = connect(listener, pending)
    try:
        acceptor._loop = asyncio.get_running_loop()  # taken by hand: not on the loop's own readiness
        acceptor.accept_pending()
        await turns()
        assert acceptor.accepted == taken
        assert len(Counted.made) == taken  # each handed to the loop with the server's protocol
    finally:
        await close_all(acceptor, clients)


async def test_started_it_takes_a_burst_as_the_socket_is_ready_and_stopped_it_leaves_the_port_open(
    listener: socket.socket,
) -> None:
    acceptor = BurstAcceptor(listener, Counted.fresh)
    acceptor.start(asyncio.get_running_loop())
    clients = connect(listener, 30)
    try:
        for _ in range(1000):  # the loop's own readiness: turns until it came
            if len(Counted.made) == 30:
                break
            await asyncio.sleep(0)
        assert acceptor.accepted == 30 and len(Counted.made) == 30
    finally:
        await close_all(acceptor, clients)
    assert listener.fileno() != -1  # the server's own descriptor: still listening
    late = connect(listener, 1)
    conn, _ = listener.accept()
    conn.close()
    late[0].close()


async def answer(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def test_the_gateway_server_answers_a_burst_of_new_connections_on_its_port_and_stops_accepting_at_shutdown(
    tmp_path: Any,
) -> None:
    settings = Settings(host="127.0.0.1", port=free_port())
    server = build_server(answer, settings, lifespan="off", log_level="warning")
    port, private = listening_socket(settings, shared=False), private_socket(tmp_path / "app.sock")
    server.config.load()  # what uvicorn's serve does before its startup
    server.lifespan = server.config.lifespan_class(server.config)
    await server.startup(sockets=[port, private])
    try:
        assert len(server.acceptors) == 1  # the TCP port; the private Unix socket is the server's alone

        async def one() -> bytes:
            reader, writer = await asyncio.open_connection(*port.getsockname()[:2])
            writer.write(b"GET /x HTTP/1.1\r\nhost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            body = await reader.readexactly(2)
            writer.close()
            return head.split(b"\r\n")[0] + body

        answers = await asyncio.gather(*(one() for _ in range(50)))
        assert set(answers) == {b"HTTP/1.1 200 OKok"}
    finally:
        await server.shutdown(sockets=[port, private])
    assert server.acceptors == []


async def test_a_connection_taken_just_before_the_acceptor_stops_is_still_served(listener: socket.socket) -> None:
    acceptor = BurstAcceptor(listener, Counted.fresh)
    clients = connect(listener, 3)
    try:
        acceptor._loop = asyncio.get_running_loop()  # taken by hand, then stopped before the loop's next turn
        acceptor.accept_pending()
        acceptor.stop()
        await turns()
        assert acceptor.accepted == 3 and len(Counted.made) == 3
    finally:
        await close_all(acceptor, clients)
