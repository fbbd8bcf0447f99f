"""A real redis-server for the tests of limits shared by gateway replicas: on a free port, its files in a
temporary directory, nothing saved, stopped (and waited for) when the block ends."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from testing.gateway_thread import free_port


@dataclass
class RedisServer:
    port: int
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def redis_binary() -> str:
    """The redis-server binary; the test skips, saying why, where scripts/install-redis.sh could not install it."""
    found = shutil.which("redis-server")
    if found is None:
        pytest.skip("redis-server is not installed (scripts/install-redis.sh installs Debian's package)")
    return found


@contextmanager
def running_redis(workdir: Path) -> Iterator[RedisServer]:
    port = free_port()
    process = subprocess.Popen(
        [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--save", "",
         "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    server = RedisServer(port, process)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {port}")
            time.sleep(0.02)
        yield server
    finally:
        server.stop()
