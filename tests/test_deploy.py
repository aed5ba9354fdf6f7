"""examples/deploy/: its HAProxy config, compose file and Kubernetes manifest parse, and
`cluster.py` runs the deployment for real on loopback (Redis, three `serve --bus` nodes with
the fixture model, HAProxy): every node ready, a final through HAProxy answered, a node killed
with SIGKILL while new connections through HAProxy still work and a final it had answered is
answered again from the history on another node, a drain closing writers with 1012, and
nothing left running afterwards. Skips when redis-server or haproxy is not installed
(apt-get install redis-server haproxy; `.ci/install-cluster` does it as root)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.conftest import FIXTURE_MODEL, ROOT, needs_fixture

DEPLOY = ROOT / "examples" / "deploy"


def _load_cluster() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nmt_deploy_cluster", DEPLOY / "cluster.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


cluster_py = _load_cluster()


def final(url: str, stream: str, seq: int = 0, text: str = "I will meet Tom") -> dict[str, Any]:
    """Send one final on a new connection; its one reply (an update or an error)."""
    with connect(url, proxy=None, open_timeout=10) as ws:
        event = {
            "type": "partial_transcript",
            "stream_id": stream,
            "segment_id": 0,
            "seq": seq,
            "text": text,
            "is_final": True,
        }
        ws.send(json.dumps(event))
        while True:
            reply: dict[str, Any] = json.loads(ws.recv(timeout=15))
            if reply["type"] == "error" or reply.get("is_final"):
                return reply


def sessions_alive(sids: list[int]) -> list[int]:
    """Processes still in any of these sessions (each child was a session leader)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # state ppid pgrp session ...
        if int(fields[3]) in sids:
            alive.append(int(entry.name))
    return alive


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    problems = cluster_py.missing()
    if problems:
        pytest.skip("; ".join(problems))
    needs_fixture()
    workdir = tmp_path_factory.mktemp("cluster")
    # One ONNX thread per node (three nodes share this machine's cores); a short lease so
    # that a killed node's streams move on within a second.
    node_args = ["--threads", "1", "--lease-ms", "1000"]
    with cluster_py.Cluster(3, FIXTURE_MODEL, node_args, workdir=workdir) as running:
        print(f"cluster started in {running.started_s:.1f} s; logs in {workdir}")
        yield running


def test_config_files_parse() -> None:
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert {"redis", "nmt1", "nmt2", "nmt3", "haproxy"} <= set(services)
    manifests = list(yaml.safe_load_all((DEPLOY / "k8s.yaml").read_text()))
    kinds = sorted(m["kind"] for m in manifests if m)
    assert kinds.count("Deployment") == 2 and kinds.count("Service") == 2
    # The drain (shutdown timeout + 2 s) fits in the time each orchestrator grants.
    for name in ("nmt1", "nmt2", "nmt3"):
        assert services[name]["stop_grace_period"] == "15s"
    node = next(
        m for m in manifests if m and m["kind"] == "Deployment" and m["spec"]["replicas"] == 3
    )
    assert node["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 12
    if cluster_py._binary("haproxy") is not None:
        check = subprocess.run(
            [cluster_py._binary("haproxy"), "-c", "-f", str(DEPLOY / "haproxy.cfg")],
            capture_output=True,
            text=True,
        )
        assert check.returncode == 0, check.stderr


def test_haproxy_template_fills_every_server() -> None:
    text = cluster_py.haproxy_config(
        (DEPLOY / "haproxy.cfg").read_text(),
        bind="127.0.0.1:1",
        stats_bind="127.0.0.1:2",
        socket_path=Path("/tmp/x.sock"),
        servers=["127.0.0.1:11", "127.0.0.1:12", "127.0.0.1:13", "127.0.0.1:14"],
    )
    servers = [
        line.split()[1:3] for line in text.splitlines() if line.strip().startswith("server ")
    ]
    assert servers == [[f"nmt{i}", f"127.0.0.1:{10 + i}"] for i in range(1, 5)]
    settings = [line.strip() for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert "bind 127.0.0.1:1" in settings and "bind 127.0.0.1:2" in settings
    assert not [line for line in settings if "${" in line or "/tmp/nmt-haproxy" in line]


def test_every_node_ready_and_haproxy_routes(cluster: Any) -> None:
    for url in cluster.node_urls:
        assert cluster_py.http_status(url + "readyz") == 200
        assert cluster_py.http_status(url + "healthz") == 200
    assert cluster.lb_states() == {"nmt1": "UP", "nmt2": "UP", "nmt3": "UP"}
    reply = final(cluster.lb_url, "t")
    assert reply["type"] == "translation_update" and reply["is_final"] is True
    assert reply["stable_text"] == "我要见汤姆"


def test_sigkill_fails_over(cluster: Any) -> None:
    answered = final(cluster.node(0).ws_url, "killed")  # node 0 owns this stream
    pid = cluster.node(0).pid
    assert cluster.kill_node(0, signal.SIGKILL) == -signal.SIGKILL
    # At once, before HAProxy's checks notice: the connect fails and is retried elsewhere.
    for k in range(4):
        reply = final(cluster.lb_url, f"after-kill-{k}")
        assert reply["type"] == "translation_update" and reply["is_final"] is True
    deadline = time.monotonic() + 5
    while cluster.lb_state(0) != "DOWN":
        assert time.monotonic() < deadline, cluster.lb_states()
        time.sleep(0.05)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    # The writer's rule: the final resent through HAProxy (another node now) is answered
    # from the stream's history: the same update, not a second translation.
    again = final(cluster.lb_url, "killed")
    assert again["type"] == "translation_update"
    assert (again["cursor"], again["stable_text"]) == (answered["cursor"], answered["stable_text"])
    cluster.start_node(0)  # same port; ready and UP in HAProxy again
    assert cluster.node(0).port == cluster.node_ports[0] and cluster.lb_state(0) == "UP"


def test_sigterm_drains_with_1012(cluster: Any) -> None:
    with connect(cluster.node(1).ws_url, proxy=None) as ws:
        ws.send(
            json.dumps(
                {
                    "type": "partial_transcript",
                    "stream_id": "drained",
                    "segment_id": 0,
                    "seq": 0,
                    "text": "I will",
                    "is_final": False,
                }
            )
        )
        ws.recv(timeout=10)
        cluster.kill_node(1, signal.SIGTERM, wait=False)
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                ws.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012
    assert cluster.wait_exit(1) == 0
    assert final(cluster.lb_url, "after-drain")["type"] == "translation_update"


def test_stops_cleanly(cluster: Any) -> None:
    pids = cluster.pids()
    assert len(pids) >= 5  # redis, three nodes, haproxy (and restarts)
    began = time.monotonic()
    cluster.stop()
    assert time.monotonic() - began < 10
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    if Path("/proc/self/stat").is_file():
        assert sessions_alive(pids) == []
    cluster.stop()  # idempotent
