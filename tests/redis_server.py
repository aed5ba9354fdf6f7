"""A real `redis-server` on loopback for the bus tests: started on a free port, killed and
restarted on the same port (a Redis that dies mid-talk), stopped at the end. Tests that
need it skip with the reason when Debian's `redis-server` is not installed."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def needs_redis() -> None:
    if not Path(REDIS_SERVER).is_file():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.skip("the redis package is not installed (pip install -e '.[cluster]')")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisServer:
    """One `redis-server` without persistence (a restart loses its data, the harder case
    for the bus: epochs, leases and histories all gone)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="nmt-redis-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s,
            ):
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def redis_server() -> Iterator[RedisServer]:
    needs_redis()
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
