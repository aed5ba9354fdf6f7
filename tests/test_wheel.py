"""The package as a user gets it: a wheel built from the checkout, installed into a fresh
virtualenv outside the checkout, translates with a model directory given by path, and
`serve` answers with its pages and assets, the wire schema and the model catalog all read
from the installed files, none from the checkout.

The wheel goes in with `--no-deps`; its dependencies come from this interpreter's
site-packages through a `.pth` path line (a plain path: the `.pth` files there, such as an
editable install's finder, are not run), so the test needs no network and takes seconds.
Every command runs from an empty directory with PYTHONPATH unset, and the test checks that
`engine` and `protocol` are imported from the new virtualenv.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.redis_server import free_port

FIXTURE_MODEL = ROOT / "models" / "fixture" / "model"
STATIC = ROOT / "engine" / "server" / "static"
SENTENCE = "I will meet Tom at three"
TRANSLATION = "我三点见汤姆"  # the README's first line says so


@dataclass(frozen=True)
class Installed:
    """The virtualenv the wheel went into, and an empty directory to run it from."""

    venv: Path
    cwd: Path
    env: dict[str, str]

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def command(self) -> Path:
        return self.venv / "bin" / "nmt-incremental"

    def run(self, *args: str | Path, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(a) for a in args],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def _build_wheel(out: Path) -> Path:
    """`pip wheel` of a copy of the package's sources (the build writes `build/` and
    `*.egg-info` beside them: not into the checkout, which others may be using)."""
    source = out / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("engine", "protocol"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    # The build backend at hand: no download; without one, pip fetches it in isolation.
    try:
        at_hand = int(importlib.metadata.version("setuptools").split(".")[0]) >= 68
    except importlib.metadata.PackageNotFoundError:
        at_hand = False
    flags = ["--no-build-isolation"] if at_hand else []
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *flags, str(source)],
        cwd=out,
        check=True,
        timeout=300,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    (wheel,) = out.glob("nmt_incremental-*.whl")
    return wheel


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("wheel")
    wheel = _build_wheel(base)
    venv = base / "venv"
    # Nothing of the checkout on the path, from the install on: with PYTHONPATH naming it,
    # pip would take its metadata for the wheel's, already installed.
    unset = ("PYTHONPATH", "VIRTUAL_ENV", "NMT_INCREMENTAL_CATALOG")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(HF_HUB_OFFLINE="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120, env=env)
    python = venv / "bin" / "python"
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        timeout=120,
        env=env,
    )
    # After the install, for the same reason: this interpreter's packages, the project's
    # own (editable) metadata among them.
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = Path(subprocess.check_output([python, "-c", where], text=True, env=env).strip())
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (purelib / "_nmt_test_dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")
    cwd = base / "elsewhere"
    cwd.mkdir()
    return Installed(venv, cwd, env)


def test_the_installed_package_is_the_wheels_not_the_checkouts(installed: Installed) -> None:
    where = installed.run(
        installed.python,
        "-c",
        "import engine, protocol, protocol.codec as c; "
        "print(engine.__file__); print(protocol.__file__); print(len(c.load_schema()))",
    )
    assert where.returncode == 0, where.stderr
    engine_file, protocol_file, schema_keys = where.stdout.split()
    for path in (engine_file, protocol_file):
        assert Path(path).is_relative_to(installed.venv), path
    assert int(schema_keys) > 0  # protocol/wire.schema.json shipped and readable
    catalog = installed.run(installed.command, "models", "list")
    assert catalog.returncode == 0, catalog.stderr
    assert f"catalog: {installed.venv}" in catalog.stdout and "en-zh" in catalog.stdout


def test_translate_with_a_model_directory_given_by_path(installed: Installed) -> None:
    done = installed.run(installed.command, "translate", "--model", FIXTURE_MODEL, SENTENCE)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == TRANSLATION
    assert "Traceback" not in done.stderr


def test_serve_without_a_model_says_so_in_a_line_and_exits_2(installed: Installed) -> None:
    done = installed.run(installed.command, "serve")
    assert done.returncode == 2
    assert "--model" in done.stderr and "Traceback" not in done.stderr


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_serve_answers_with_the_installed_pages_and_assets(installed: Installed) -> None:
    port = free_port()
    server = subprocess.Popen(
        [installed.command, "serve", "--model", str(FIXTURE_MODEL), "--port", str(port)],
        cwd=installed.cwd,
        env=installed.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, server.communicate()[1]
            try:
                if _get(base + "/readyz")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "serve never became ready"
            time.sleep(0.2)
        pages = {"/": "index.html", "/speak": "speak.html", "/transcript": "transcript.html"}
        assets = {f"/{p.name}": p.name for p in STATIC.iterdir() if p.suffix in (".js", ".css")}
        for path, name in {**pages, **assets}.items():
            status, body = _get(base + path)
            assert status == 200, path
            assert body == (STATIC / name).read_bytes(), path
    finally:
        server.send_signal(signal.SIGTERM)
        _, stderr = server.communicate(timeout=30)
    assert server.returncode == 0, stderr
    assert "Traceback" not in stderr
