#!/usr/bin/env python3
"""Redis, N identical `serve` nodes and HAProxy on this machine, all on loopback and free
ports: the deployment of examples/deploy/ in one command, to try it or to break it.

    python examples/deploy/cluster.py [--nodes 3] [--model models/fixture/model] [-- SERVE ARGS]

Waits until every node's /readyz answers 200 and HAProxy sees it up, prints the URLs
(writers: HAProxy's ws URL; viewers: any node's page), then runs until Ctrl-C or SIGTERM
and stops everything in order: nodes drain first (their owed finals still go out through
HAProxy, their leases are released in Redis), then HAProxy, then Redis.

It is also what the tests use (`tests/test_deploy.py`): `Cluster` is a context manager
with a synchronous API that kills, pauses and restarts nodes and Redis on their ports.
Every process writes its log to a file under `Cluster.workdir`, read them when a test fails.
Needs Debian's `redis-server` and `haproxy` (apt-get install redis-server haproxy) and the
redis client (pip install -e '.[cluster]'); only the standard library here.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DEFAULT_MODEL = ROOT / "models" / "fixture" / "model"
HAPROXY_TEMPLATE = HERE / "haproxy.cfg"
HOST = "127.0.0.1"
# serve's --shutdown-timeout default, and what a drain may take past it (the last replies
# and close handshakes): a node that has not exited by then plus MARGIN is killed.
SHUTDOWN_TIMEOUT = 10.0
DRAIN_GRACE = 2.0
MARGIN = 3.0
INSTALL_HINT = "apt-get install redis-server haproxy"

# Loopback requests never go through an http_proxy from the environment.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class MissingDependency(RuntimeError):
    """A binary or package the cluster needs is not installed (tests skip on it)."""


def _binary(name: str) -> str | None:
    # Debian puts haproxy in /usr/sbin, which a user's PATH often lacks.
    found = shutil.which(name)
    if found is not None:
        return found
    for folder in ("/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin"):
        path = Path(folder) / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def missing() -> list[str]:
    """What is not installed, one sentence each naming how to get it (empty: all there)."""
    problems = [
        f"{name} is not installed ({INSTALL_HINT})"
        for name in ("redis-server", "haproxy")
        if _binary(name) is None
    ]
    if importlib.util.find_spec("redis") is None:
        problems.append("the redis package is not installed (pip install -e '.[cluster]')")
    return problems


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free now on loopback (another process may take one before it is
    bound).

    All `n` sockets stay bound until every port is chosen: asked one at a time, the kernel
    may hand the same port out twice (it did: a node was given Redis's port and could not
    bind it).
    """
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind((HOST, 0))
        return [int(s.getsockname()[1]) for s in sockets]


def http_status(url: str, timeout: float = 1.0) -> int | None:
    """The HTTP status `url` answers with, or None when nothing answers."""
    try:
        with _opener.open(url, timeout=timeout) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, urllib.error.URLError):
        return None


def haproxy_config(
    template: str,
    *,
    bind: str,
    stats_bind: str,
    socket_path: Path,
    servers: Sequence[str],
) -> str:
    """`template` (haproxy.cfg) with its addresses filled in: the `server nmt1` line
    repeated once per address in `servers` (nmt1, nmt2, ...), the others dropped, and each
    "${VAR-default}" replaced."""
    lines: list[str] = []
    pattern = re.compile(r"^(\s*)server\s+nmt\d+\s+\S+(.*)$")
    for line in template.splitlines():
        match = pattern.match(line)
        if match is None:
            lines.append(line)
        elif not any(pattern.match(done) for done in lines):
            indent, rest = match.groups()
            lines += [f"{indent}server nmt{i} {addr}{rest}" for i, addr in enumerate(servers, 1)]
    values = {"LB_BIND": bind, "STATS_BIND": stats_bind, "HAPROXY_SOCKET": str(socket_path)}

    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in values:
            raise ValueError(f"haproxy template: no value for ${{{name}}}")
        return values[name]

    variable = re.compile(r'"\$\{(\w+)-[^}"]*\}"')
    lines = [line if line.lstrip().startswith("#") else variable.sub(fill, line) for line in lines]
    if not servers or any("${" in line and not line.lstrip().startswith("#") for line in lines):
        raise ValueError("haproxy template: unfilled variable or no server")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class NodeInfo:
    """One node as it is now. `index` counts from 0; HAProxy calls it nmt{index + 1}."""

    index: int
    port: int
    pid: int | None  # None while it is not running
    url: str  # http://127.0.0.1:PORT/ : the subtitle page is URL?stream=ID
    ws_url: str  # this node alone, bypassing HAProxy
    log: Path


class _Process:
    """One child process with its log file, restartable with the same command."""

    def __init__(self, name: str, command: list[str], log: Path, cwd: Path) -> None:
        self.name = name
        self.command = command
        self.log = log
        self.cwd = cwd
        self.popen: subprocess.Popen[bytes] | None = None
        self._file: IO[bytes] | None = None
        self.pids: list[int] = []

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.running and self.popen is not None else None

    def start(self) -> None:
        if self.running:
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self.reap()
        self._file = self.log.open("ab")
        stamp = time.strftime("%H:%M:%S")
        self._file.write(f"--- {stamp} start: {' '.join(self.command)}\n".encode())
        self._file.flush()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # A session of its own: Ctrl-C in the terminal reaches cluster.py alone, which then
        # stops the children in order (nodes drain before HAProxy and Redis go).
        self.popen = subprocess.Popen(
            self.command,
            cwd=self.cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.pids.append(self.popen.pid)

    def signal(self, sig: int) -> None:
        if self.running and self.popen is not None:
            self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None if still running after `timeout` seconds."""
        if self.popen is None:
            return None
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> int | None:
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.kill()
        code = self.popen.wait()
        self.reap()
        return code

    def reap(self) -> None:
        """Forget an exited process and close its log handle."""
        if self.popen is not None and self.popen.poll() is not None:
            self.popen = None
        if self.popen is None and self._file is not None:
            self._file.close()
            self._file = None

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class Cluster:
    """Redis + `nodes` serve nodes + HAProxy on loopback; `with Cluster() as c:` starts them
    and waits until they are ready; leaving stops them (nodes drain first).

    Nodes are numbered from 0. Ports stay the same for the cluster's life, so a killed node
    or Redis restarts where clients and HAProxy expect it."""

    def __init__(
        self,
        nodes: int = 3,
        model: str | Path = DEFAULT_MODEL,
        node_args: Sequence[str] = (),
        *,
        shutdown_timeout: float = SHUTDOWN_TIMEOUT,
        workdir: str | Path | None = None,
        ready_timeout: float = 120.0,
    ) -> None:
        problems = missing()
        if problems:
            raise MissingDependency("; ".join(problems))
        if nodes < 1:
            raise ValueError("a cluster needs at least one node")
        self.model = Path(model)
        self.node_args = list(node_args)
        self.shutdown_timeout = shutdown_timeout
        self.ready_timeout = ready_timeout
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="nmt-cluster-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.redis_port, self.lb_port, self.stats_port, *self.node_ports = free_ports(3 + nodes)
        self.haproxy_socket = self.workdir / "haproxy.sock"
        self.haproxy_cfg = self.workdir / "haproxy.cfg"
        self.started_s: float | None = None  # how long start() took
        redis_dir = self.workdir / "redis"
        redis_dir.mkdir(exist_ok=True)
        # No persistence: a test cluster's data dies with it, and a Redis that comes back
        # empty is the harder case for the bus (leases, epochs and histories all gone). In
        # production consider `--appendonly yes` (fsync every second), so that a restarted
        # Redis keeps the streams' histories and epochs.
        self._redis = _Process(
            "redis",
            [_need("redis-server"), "--port", str(self.redis_port), "--bind", HOST,
             "--save", "", "--appendonly", "no", "--dir", str(redis_dir)],
            self.workdir / "redis.log",
            self.workdir,
        )  # fmt: skip
        self._haproxy = _Process(
            "haproxy",
            [_need("haproxy"), "-f", str(self.haproxy_cfg), "-db"],
            self.workdir / "haproxy.log",
            self.workdir,
        )
        self._nodes = [
            _Process(f"node{i}", self._node_command(port), self.workdir / f"node{i}.log", ROOT)
            for i, port in enumerate(self.node_ports)
        ]

    def _node_command(self, port: int) -> list[str]:
        return [
            sys.executable, "-m", "engine.cli", "serve",
            "--model", str(self.model),
            "--host", HOST,
            "--port", str(port),
            "--bus", self.redis_url,
            "--shutdown-timeout", f"{self.shutdown_timeout:g}",
            # Behind HAProxy every connection comes from its address: no per-address cap.
            "--max-connections-per-address", "0",
            *self.node_args,
        ]  # fmt: skip

    # -- addresses ----------------------------------------------------------------

    @property
    def redis_url(self) -> str:
        return f"redis://{HOST}:{self.redis_port}/0"

    @property
    def lb_url(self) -> str:
        """Where writers connect: HAProxy's WebSocket URL."""
        return f"ws://{HOST}:{self.lb_port}/ws"

    @property
    def lb_http_url(self) -> str:
        return f"http://{HOST}:{self.lb_port}/"

    @property
    def stats_url(self) -> str:
        return f"http://{HOST}:{self.stats_port}/"

    @property
    def node_urls(self) -> list[str]:
        """Each node's own URL (viewers: URL?stream=ID; /readyz, /metrics)."""
        return [f"http://{HOST}:{port}/" for port in self.node_ports]

    def node(self, i: int) -> NodeInfo:
        port = self.node_ports[i]
        return NodeInfo(
            i, port, self._nodes[i].pid, self.node_urls[i], f"ws://{HOST}:{port}/ws",
            self._nodes[i].log,
        )  # fmt: skip

    @property
    def nodes(self) -> list[NodeInfo]:
        return [self.node(i) for i in range(len(self._nodes))]

    def pids(self) -> list[int]:
        """Every process id this cluster ever started (to check none is left)."""
        return [pid for p in self._all() for pid in p.pids]

    def log(self, name: str, lines: int = 30) -> str:
        """The last lines of a log: 'redis', 'haproxy' or 'node0', 'node1', ..."""
        return {p.name: p for p in self._all()}[name].tail(lines)

    def _all(self) -> list[_Process]:
        return [self._redis, *self._nodes, self._haproxy]

    # -- whole cluster --------------------------------------------------------------

    def start(self) -> None:
        """Redis, then the nodes (they refuse to start without their bus), then HAProxy;
        returns when every node is ready and HAProxy sees it up."""
        begin = time.monotonic()
        try:
            self.start_redis()
            for i in range(len(self._nodes)):
                self.start_node(i, wait=False)
            self.haproxy_cfg.write_text(
                haproxy_config(
                    HAPROXY_TEMPLATE.read_text(),
                    bind=f"{HOST}:{self.lb_port}",
                    stats_bind=f"{HOST}:{self.stats_port}",
                    socket_path=self.haproxy_socket,
                    servers=[f"{HOST}:{port}" for port in self.node_ports],
                )
            )
            self._haproxy.start()
            for i in range(len(self._nodes)):
                self.wait_ready(i)
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - begin

    def stop(self) -> None:
        """Drain the nodes (SIGTERM; killed past shutdown timeout + 2 s + a margin), then
        stop HAProxy and Redis. Idempotent; whatever is interrupted is killed."""
        try:
            running = [p for p in self._nodes if p.running]
            for p in running:
                p.signal(signal.SIGTERM)
                p.signal(signal.SIGCONT)  # a paused node would never see its SIGTERM
            deadline = time.monotonic() + self.shutdown_timeout + DRAIN_GRACE + MARGIN
            for p in running:
                if p.wait(max(0.0, deadline - time.monotonic())) is None:
                    print(f"cluster: {p.name} did not drain in time, killed", file=sys.stderr)
                p.kill()
            for p in (self._haproxy, self._redis):
                p.signal(signal.SIGTERM)
                p.wait(5.0)
        finally:
            for p in self._all():
                p.kill()

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- nodes -------------------------------------------------------------------------

    def start_node(self, i: int, wait: bool = True) -> None:
        """(Re)start node `i` on its port; with `wait`, until it is ready and HAProxy sees it."""
        self._nodes[i].start()
        if self._haproxy.running:
            self.lb_ready(i)
        if wait:
            self.wait_ready(i)

    def kill_node(self, i: int, sig: int = signal.SIGKILL, wait: bool = True) -> int | None:
        """Send `sig` to node `i`. SIGKILL and SIGTERM (a drain) are waited for with `wait`,
        and the exit status is returned; SIGSTOP pauses it (HAProxy's checks time out, its
        lease runs out), SIGCONT resumes it."""
        p = self._nodes[i]
        if not p.running:
            raise RuntimeError(f"node {i} is not running")
        p.signal(sig)
        if sig == signal.SIGTERM:
            p.signal(signal.SIGCONT)
        if not wait or sig not in (signal.SIGKILL, signal.SIGTERM):
            return None
        return self.wait_exit(i)

    def wait_exit(self, i: int) -> int:
        """Wait for node `i` to exit (a drain's bound, then it is killed); its status."""
        p = self._nodes[i]
        code = p.wait(self.shutdown_timeout + DRAIN_GRACE + MARGIN)
        if code is None:
            p.kill()
            raise RuntimeError(f"node {i} did not exit in time; killed\n{p.tail()}")
        p.reap()
        return code

    def wait_ready(self, i: int, timeout: float | None = None) -> None:
        """Until node `i` answers /readyz with 200 and HAProxy has it UP (its checks passed)."""
        deadline = time.monotonic() + (self.ready_timeout if timeout is None else timeout)
        p = self._nodes[i]
        url = self.node_urls[i] + "readyz"
        while http_status(url) != 200:
            if not p.running:
                raise RuntimeError(f"node {i} exited while starting:\n{p.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {i}: {url} not 200 in time\n{p.tail()}")
            time.sleep(0.1)
        while self.lb_state(i) != "UP":
            if not self._haproxy.running:
                raise RuntimeError(f"haproxy exited:\n{self._haproxy.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"HAProxy does not see node {i} up: {self.lb_state(i)}")
            time.sleep(0.1)

    # -- Redis -------------------------------------------------------------------------

    def start_redis(self) -> None:
        """(Re)start Redis on its port and folder; returns once it answers PING."""
        self._redis.start()
        deadline = time.monotonic() + 10
        while not _redis_ping(self.redis_port):
            if not self._redis.running or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start:\n{self._redis.tail()}")
            time.sleep(0.05)

    def kill_redis(self, sig: int = signal.SIGKILL) -> None:
        """Kill Redis (SIGKILL: it dies mid-talk) and wait for it."""
        self._redis.signal(sig)
        self._redis.wait(10.0)
        self._redis.kill()

    # -- HAProxy -------------------------------------------------------------------------

    def lb_command(self, command: str) -> str:
        """One command on HAProxy's runtime API (its stats socket); the answer."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            s.connect(str(self.haproxy_socket))
            s.sendall(command.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def lb_states(self) -> dict[str, str]:
        """HAProxy's view of each server, e.g. {'nmt1': 'UP', 'nmt2': 'DOWN', ...}: 'UP' only
        once its last check passed; 'DOWN', 'MAINT', 'DRAIN', 'UP 1/2' (going down) ...;
        {} while HAProxy does not answer."""
        try:
            text = self.lb_command("show stat")
        except OSError:
            return {}
        rows = csv.DictReader(text.lstrip("# ").splitlines())
        states = {}
        for row in rows:
            if row.get("pxname") == "nmt" and row.get("svname", "").startswith("nmt"):
                check = (row.get("check_status") or "").lstrip("* ")
                status = row.get("status", "")
                states[row["svname"]] = status if status != "UP" or check == "L7OK" else "INI"
        return states

    def lb_state(self, i: int) -> str:
        return self.lb_states().get(f"nmt{i + 1}", "?")

    def lb_drain(self, i: int) -> None:
        """Drain node `i` on HAProxy's side only (no new connections, checks off), e.g. to
        take it out of rotation without stopping it. A SIGTERM needs none of this: the
        node's /readyz turns 404 and `disable-on-404` drains it. `lb_ready` undoes it."""
        self._lb_ok(f"disable health nmt/nmt{i + 1}")
        self._lb_ok(f"set server nmt/nmt{i + 1} state drain")

    def drain_node(self, i: int) -> int:
        """SIGTERM, and wait: a planned restart (the node's /readyz 404 tells HAProxy to
        drain it: no new connections, its writers closed by the node). The exit status."""
        code = self.kill_node(i, signal.SIGTERM)
        assert code is not None
        return code

    def lb_ready(self, i: int) -> None:
        """Undo `lb_drain`: checks on again and new connections welcome once they pass."""
        self._lb_ok(f"enable health nmt/nmt{i + 1}")
        self._lb_ok(f"set server nmt/nmt{i + 1} state ready")

    def _lb_ok(self, command: str) -> None:
        answer = self.lb_command(command).strip()
        if answer:
            raise RuntimeError(f"haproxy: {command}: {answer}")


def _need(name: str) -> str:
    path = _binary(name)
    if path is None:
        raise MissingDependency(f"{name} is not installed ({INSTALL_HINT})")
    return path


def _redis_ping(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.2) as s:
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith(b"+PONG")
    return False


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Arguments after -- go to every `serve`, e.g. -- --threads 1 --token SECRET",
    )
    parser.add_argument("--nodes", type=int, default=3, help="serve nodes (default 3)")
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="model for every node")
    parser.add_argument(
        "--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT, help="serve's, per node"
    )
    parser.add_argument("--workdir", help="where logs go (default: a new temporary folder)")
    args, serve_args = parser.parse_known_args(argv)
    if serve_args[:1] == ["--"]:
        serve_args = serve_args[1:]
    for signum in (signal.SIGTERM, signal.SIGINT):  # SIGINT too: ignored when run with &
        signal.signal(signum, _raise_interrupt)
    try:
        cluster = Cluster(
            args.nodes,
            args.model,
            serve_args,
            shutdown_timeout=args.shutdown_timeout,
            workdir=args.workdir,
        )
        print(f"starting redis, {args.nodes} nodes and haproxy; logs in {cluster.workdir}")
        with cluster:
            print(f"ready in {cluster.started_s:.1f} s")
            print(f"writers:  {cluster.lb_url}   (HAProxy: any node)")
            for node in cluster.nodes:
                print(f"node {node.index}:   {node.url}?stream=demo   (pid {node.pid}; viewers)")
            print(f"through HAProxy: {cluster.lb_http_url}?stream=demo")
            print(f"HAProxy stats: {cluster.stats_url}")
            print(f"redis:    {cluster.redis_url}")
            print("Ctrl-C to stop (nodes drain first)", flush=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        print("stopped")
    except MissingDependency as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
