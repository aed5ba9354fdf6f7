"""`serve --workers N`: N `serve` processes on one port, sharing one update bus.

One `serve` process spends its event loop's core long before its model is busy, so a
machine's other cores serve streams only through more processes. Each worker is a whole
`serve` (its own model, scheduler and connections, like Triton's instance groups) that
listens on the same port with `SO_REUSEPORT`, so the kernel spreads connections over
them; they share streams through the Redis bus that several nodes already share
(`engine/streaming/redis_bus.py`): a writer's stream is owned by one worker through its
lease, and a viewer on any worker reads every update of it once and in order. With no
`--bus` a private `redis-server` is started on a unix socket in a temporary directory and
stopped after the workers (docs/deployment.md says why and what it costs).

This process (the supervisor) loads no model: it reserves the port, starts the bus and
the workers, forwards SIGINT/SIGTERM to every worker (each drains: pending finals
answered, leases released) and stops them all when one of them exits on its own.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from engine.cli.args import bind_error
from engine.distribution import install_hint
from engine.errors import EngineError
from engine.hub.download import resolve_model
from engine.streaming.redis_store import redacted

log = logging.getLogger("engine.server")

REDIS_START_S = 10.0
"""How long a private redis-server may take to answer its first PING."""
DRAIN_GRACE_S = 5.0
"""Seconds past --shutdown-timeout (whose last replies get 2 s more) before a worker that
has not exited is killed."""


BUS_SCHEMES = ("redis://", "rediss://", "unix://")


class WorkersError(Exception):
    """A `--workers` set that cannot start: the one line the CLI prints (exit 2)."""


@dataclass
class PrivateRedis:
    """A `redis-server` of this machine for one set of workers: unix socket only (no TCP
    port to collide with or expose), no persistence, its directory removed at the end."""

    process: subprocess.Popen[bytes]
    directory: Path

    @property
    def url(self) -> str:
        return f"unix://{self.directory / 'redis.sock'}?db=0"

    @classmethod
    def start(cls, binary: str) -> PrivateRedis:
        directory = Path(tempfile.mkdtemp(prefix="nmt-workers-"))
        path = directory / "redis.sock"
        command = [
            binary, "--port", "0", "--unixsocket", str(path), "--unixsocketperm", "700",
            "--save", "", "--appendonly", "no", "--dir", str(directory),
        ]  # fmt: skip
        process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C reaches the workers, not the bus they drain to
        )
        redis = cls(process, directory)
        deadline = time.monotonic() + REDIS_START_S
        while time.monotonic() < deadline:
            if process.poll() is not None:
                break
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
                s.settimeout(0.5)
                s.connect(str(path))
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return redis
            time.sleep(0.05)
        redis.stop()
        raise WorkersError(f"{binary} did not start (a private bus for --workers)")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def bus_for_workers(args: argparse.Namespace) -> str | None:
    """The bus URL the workers share: `--bus` when given (reached and checked here, so
    that a bad one is one line rather than one per worker), else None (a private Redis);
    a `WorkersError` when neither can work here."""
    try:
        import redis
    except ImportError:
        raise WorkersError(
            f"--workers needs the redis package: {install_hint('cluster')}"
        ) from None
    if not args.bus:
        if shutil.which("redis-server") is None:
            raise WorkersError(
                "--workers needs a bus: --bus redis://HOST:PORT/DB, or redis-server installed "
                "(apt-get install redis-server) for a private one"
            )
        return None
    url, shown = str(args.bus), redacted(str(args.bus))
    if not url.startswith(BUS_SCHEMES):
        raise WorkersError(f"--bus {shown!r}: expected redis://HOST:PORT/DB")
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5)
        with client:
            version = str(client.info("server").get("redis_version", "0"))
    except (redis.RedisError, OSError, ValueError) as exc:
        raise WorkersError(f"cannot reach Redis at {shown}: {exc}") from None
    if int(version.split(".")[0]) < 7:
        raise WorkersError(f"Redis at {shown} is {version}; the bus needs 7 or later")
    return url


def resolved_models(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with each `--model` turned into its directory here, once: a catalog name is
    downloaded by this process rather than by N workers racing into one cache, and a
    name that is not there is one line rather than one per worker."""
    specs = args.model if isinstance(args.model, list) else [args.model]
    paths = []
    for spec in specs:
        try:
            paths.append(str(resolve_model(str(spec), quantized=args.quantized)))
        except EngineError as exc:
            raise WorkersError(f"cannot load model {str(spec)!r}: {exc}") from None
    return argparse.Namespace(**{**vars(args), "model": paths})


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound with SO_REUSEPORT to (host, port) and never listening: it picks the
    port when `port` is 0, refuses at once a port another server holds, and keeps the
    port this set's while it lives (the kernel hands connections to listeners only)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def _worker(serve: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> None:
    # Before `serve` sets its level: each line says which worker wrote it. A terminal's
    # Ctrl-C reaches the worker too; the supervisor's forwarded signal then only logs
    # that it is still draining.
    logging.basicConfig(format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s")
    sys.exit(serve(args))


@dataclass
class _Stop:
    signum: int | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum


def run_workers(args: argparse.Namespace, serve: Callable[[argparse.Namespace], int]) -> int:
    """Run `args.workers` processes of `serve` (`run_serve`, passed down by it: the CLI
    calls this module, not the other way) until a signal or until one exits; 0 after a
    graceful stop of all, 2 when the set cannot start, else the first failure's status."""
    try:
        url = bus_for_workers(args)
        args = resolved_models(args)
        reserved = reserve_port(args.host, args.port)
    except WorkersError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {bind_error(exc, args.host, args.port, '--port')}", file=sys.stderr)
        return 2
    stop = _Stop()
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with reserved, _bus(url) as bus:
            port = reserved.getsockname()[1]
            log.info(
                "%d workers on port %d, sharing %s", args.workers, port,
                "a private redis-server" if url is None else "--bus",
            )  # fmt: skip
            return _supervise(args, serve, port, bus, stop)
    except WorkersError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def _bus(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    binary = shutil.which("redis-server")
    assert binary is not None  # bus_for_workers checked
    redis = PrivateRedis.start(binary)
    try:
        yield redis.url
    finally:
        redis.stop()  # after every worker: their drains publish through it


def _supervise(
    args: argparse.Namespace,
    serve: Callable[[argparse.Namespace], int],
    port: int,
    bus: str,
    stop: _Stop,
) -> int:
    context = multiprocessing.get_context("spawn")  # no forked threads or sessions
    ready = [context.Event() for _ in range(args.workers)]
    workers: list[Any] = []
    for i in range(args.workers):
        worker_args = argparse.Namespace(**vars(args))
        worker_args.workers = 1
        worker_args.port = port
        worker_args.bus = bus
        worker_args.reuse_port = True
        worker_args.worker_ready = ready[i]
        worker_args.worker_cores = max(1, (os.cpu_count() or 1) // args.workers)
        process = context.Process(target=_worker, args=(serve, worker_args), name=f"worker-{i + 1}")
        process.start()
        workers.append(process)
    status = 0
    announced = False
    while stop.signum is None:
        multiprocessing.connection.wait([w.sentinel for w in workers], timeout=0.2)
        exited = [w for w in workers if w.exitcode is not None]
        if exited:
            first = exited[0]
            log.error(
                "%s (pid %d) exited with status %s: stopping the others",
                first.name, first.pid, first.exitcode,
            )  # fmt: skip
            status = 2 if first.exitcode == 2 else 1
            break
        if not announced and all(event.is_set() for event in ready):
            log.info("ready: %d workers", len(workers))
            announced = True
    else:
        log.info(
            "%s: stopping %d workers (each finishes its pending finals)",
            signal.Signals(stop.signum).name, len(workers),
        )  # fmt: skip
    for w in workers:
        if w.exitcode is None and w.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, signal.SIGTERM)
    deadline = time.monotonic() + args.shutdown_timeout + 2.0 + DRAIN_GRACE_S
    for w in workers:
        w.join(max(0.0, deadline - time.monotonic()))
        if w.exitcode is None:
            log.error("%s (pid %d) did not stop in time: killed", w.name, w.pid)
            w.kill()
            w.join()
            status = status or 1
        elif w.exitcode != 0 and not (stop.signum and w.exitcode == -signal.SIGTERM):
            status = status or 1  # (killed by the forwarded signal before its handler)
    log.info("stopped %d workers", len(workers))
    return status
