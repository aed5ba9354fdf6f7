"""The package as a user gets it: a wheel built from the checkout, installed into a fresh
virtualenv outside the checkout, runs with no checkout at all: it translates with the
fixture it ships (`--model fixture`, the README's output) and with a model directory given
by path, `serve` answers with its pages and assets, the installed writer (`send`) plays
the log the wheel ships into it and a viewer page in Chromium shows every final, and
`listen` hears a WAV with the fixture's own recognizer data; the wire schema, the model
catalog, the fixtures and the logs are all read from the installed files.

The wheel goes in with `--no-deps`; its dependencies come from this interpreter's
site-packages through a `.pth` path line (a plain path: the `.pth` files there, such as an
editable install's finder, are not run), so the test needs no network and takes seconds.
Every command runs from an empty directory with PYTHONPATH unset, and the test checks that
`engine` and `protocol` are imported from the new virtualenv.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.distribution import SHIPPED
from tests.conftest import ROOT
from tests.redis_server import free_port

FIXTURE_MODEL = ROOT / "models" / "fixture" / "model"
STATIC = ROOT / "engine" / "server" / "static"
SENTENCE = "I will meet Tom at three"
TRANSLATION = "我三点见汤姆"  # the README's first line says so
README = (ROOT / "README.md").read_text(encoding="utf-8")
WAV = ROOT / "examples" / "speech" / "wav" / "06-en-gb-x-rp-klatt2.wav"
CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOT_COPY = Path("/tmp/wheel_transcript.png")


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
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", *SHIPPED):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
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


@contextlib.contextmanager
def serving(installed: Installed, *args: str) -> Iterator[str]:
    """The installed `serve` on a free port, ready; its base URL. Stopped with SIGTERM,
    which must end it cleanly."""
    port = free_port()
    server = subprocess.Popen(
        [installed.command, "serve", *args, "--port", str(port)],
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
        yield base
    finally:
        server.send_signal(signal.SIGTERM)
        _, stderr = server.communicate(timeout=30)
    assert server.returncode == 0, stderr
    assert "Traceback" not in stderr


def readme_translations() -> list[tuple[str, str]]:
    """(source, translation) of the README's `translate` commands with the fixture."""
    argument = re.findall(
        r'nmt-incremental translate --model models/fixture/model "([^"]+)"\s+# -> (\S+)', README
    )
    piped = re.findall(
        r'echo "([^"]+)" \| nmt-incremental translate --model models/fixture/model\s+# -> (\S+)',
        README,
    )
    return [*argument, *piped]


def test_translate_with_the_shipped_fixture_gives_the_readmes_output(
    installed: Installed,
) -> None:
    pairs = readme_translations()
    assert len(pairs) >= 2 and (SENTENCE, TRANSLATION) in pairs, pairs
    for source, translation in pairs:
        done = installed.run(installed.command, "translate", "--model", "fixture", source)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == translation, source
    german = installed.run(installed.command, "translate", "--model", "fixture_de", SENTENCE)
    assert german.returncode == 0 and german.stdout.strip() == "Ich werde Tom um drei treffen"
    listed = installed.run(installed.command, "models", "list")
    assert f"fixture, fixture_de, fixture_offline in {installed.venv}" in listed.stdout


def test_serve_with_the_shipped_fixture_answers_with_the_installed_pages_and_assets(
    installed: Installed,
) -> None:
    with serving(installed, "--model", "fixture", "--model", "fixture_de") as base:
        pages = {"/": "index.html", "/speak": "speak.html", "/transcript": "transcript.html"}
        assets = {f"/{p.name}": p.name for p in STATIC.iterdir() if p.suffix in (".js", ".css")}
        for path, name in {**pages, **assets}.items():
            status, body = _get(base + path)
            assert status == 200, path
            assert body == (STATIC / name).read_bytes(), path


READ_FINALS = """() => [...document.querySelectorAll('#finals li')].map(
    li => li.querySelector('.translation').textContent)"""


def test_the_installed_writer_plays_the_shipped_log_and_a_page_shows_the_finals(
    installed: Installed,
) -> None:
    """`send fixture_en_zh` (the log the wheel ships) into `serve --model fixture`: every
    final answered, and the transcript page, open in Chromium while it plays, lists each
    final the writer got back, in order (a screenshot is kept)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} missing (run .ci/install-browser)")
    with (
        serving(installed, "--model", "fixture") as base,
        sync_api.sync_playwright() as playwright,
    ):
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            args=["--headless", "--no-sandbox", "--disable-gpu"],
            headless=True,
        )
        page = browser.new_page(viewport={"width": 900, "height": 1400})
        page.goto(f"{base}/transcript?stream=demo")
        page.wait_for_function("() => document.body.dataset.state === 'open'")
        ws = base.replace("http://", "ws://") + "/ws"
        sent = installed.run(
            installed.command, "send", "fixture_en_zh", "--to", ws, "--speed", "10", timeout=120
        )
        assert sent.returncode == 0, sent.stderr
        assert "finals 40/40 translated" in sent.stderr, sent.stderr
        finals = [line for line in sent.stdout.splitlines() if line.startswith("FINAL")]
        # "FINAL demo#0 seq 7  12 ms  zh  汤姆画马吗  <- Does Tom draw a horse"
        finals = [line.split("  <- ")[0].split("  ")[-1] for line in finals]
        assert len(finals) == 40 and all(finals), sent.stdout
        page.wait_for_function("() => document.querySelectorAll('#finals li').length >= 40")
        listed = page.evaluate(READ_FINALS)
        page.screenshot(path=str(installed.cwd / "transcript.png"), full_page=True)
        browser.close()
    assert listed == finals
    shutil.copy2(installed.cwd / "transcript.png", SCREENSHOT_COPY)


def test_listen_with_the_shipped_fixture_uses_its_recognizer_data(installed: Installed) -> None:
    """The fixture's `recognizer.json` points at the language model the wheel ships: the
    installed `listen --model fixture` hears what the checkout's fixture hears."""
    pytest.importorskip("pocketsphinx")
    argv = ["listen", str(WAV)]
    done = installed.run(installed.command, *argv, "--model", "fixture", timeout=120)
    assert done.returncode == 0, done.stderr
    checkout = subprocess.run(
        [sys.executable, "-m", "engine.cli", *argv, "--model", str(FIXTURE_MODEL)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )

    def finals(out: str) -> list[tuple[str, str]]:
        updates = [json.loads(line) for line in out.splitlines()]
        return [(u["source_text"], u["stable_text"]) for u in updates if u["is_final"]]

    heard = finals(done.stdout)
    assert heard and heard == finals(checkout.stdout)
    assert "teacher" in " ".join(source for source, _ in heard)  # the domain's model


def test_install_hints_fit_a_wheel(installed: Installed) -> None:
    """A wheel has no checkout to `pip install -e` from: the `/speak` refusal and the
    missing-pocketsphinx error name the extra's own requirements."""
    script = (
        "import sys\n"
        "sys.modules['pocketsphinx'] = None  # as if the asr extra were not installed\n"
        "from engine.asr.errors import import_extra\n"
        "from engine.server.connection import AUDIO_OFF\n"
        "print(AUDIO_OFF)\n"
        "try:\n"
        "    import_extra('pocketsphinx')\n"
        "except Exception as exc:\n"
        "    print(exc)\n"
    )
    done = installed.run(installed.python, "-c", script)
    assert done.returncode == 0, done.stderr
    refusal, missing = done.stdout.splitlines()
    for line in (refusal, missing):
        assert "pip install 'pocketsphinx>=5'" in line and "-e" not in line, line
