"""A fresh clone's walk through the README: its commands run as written.

A newcomer pastes the README's commands in order, so each must work as pasted, without a
download. This test takes the commands out of README.md itself (its first lines and its
fenced blocks) and runs them in a temporary working directory that holds the checkout's
files (linked, read-only use) and the virtualenv running the tests as `.venv`, with the
hub offline:

- the first lines: the set-up command's last step (`.venv/bin/nmt-incremental translate
  ...`; creating the venv and `pip install` need the package index) and the test command
  (`bash .ci/run`: the suite this test is part of) is checked to be `.ci/run`;
- shell blocks: each line in bash; a `# -> TEXT` comment is the output it must print;
- a block that starts `nmt-incremental serve` is a live session: the server starts (on a
  free port: `--port 0`, and the other commands are pointed at it), `send`
  runs until it has printed a final, a viewer subscribes like the page and must receive an
  update, `xdg-open URL` and every server URL the README names are fetched, then SIGTERM;
- `python` blocks are saved as a script and run; the output shown after one must match.

A block preceded by `<!-- readme-test: skip (WHY) -->` is not run (the hub, root); the
test says so when it skips it, and a command that needs the network outside such a block
fails `test_network_commands_are_marked`. Relative links in README.md and docs/*.md must
resolve, anchors included, and repository paths they name must exist.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from websockets.sync.client import connect

from tests.conftest import ROOT

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS, ROOT / "examples" / "README.md"]
DEFAULT_PORT = "8765"
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\s*\((?P<why>[^)]+)\)\s*-->\s*$")
SHELL_LANGS = {"", "sh", "bash", "shell", "console"}
NETWORK = r"\b(models pull|pip install|apt-get|apt install|docker|kubectl|git clone)\b"
# What the walk links into its temporary working directory.
CHECKOUT = (
    "models",
    "examples",
    "engine",
    "protocol",
    "docs",
    ".ci",
    "pyproject.toml",
    "README.md",
)


@dataclass
class Block:
    """One fenced block of the README."""

    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    section: str
    skip: str | None = None

    @property
    def commands(self) -> list[str]:
        """Its shell commands: continuation lines joined, blank lines dropped."""
        joined = re.sub(r"\\\n\s*", " ", self.text)
        return [line.strip() for line in joined.splitlines() if line.strip()]

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-")
        return f"L{self.line}-{slug}"


def blocks(text: str) -> list[Block]:
    out: list[Block] = []
    lines = text.splitlines()
    section = "top"
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        fence = re.match(r"^```(\w*)\s*$", line)
        if fence:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = SKIP.match(previous.strip())
            out.append(
                Block(
                    line=i + 1,
                    lang=fence.group(1),
                    text="\n".join(lines[i + 1 : end]),
                    section=section,
                    skip=marker.group("why") if marker else None,
                )
            )
            i = end
        i += 1
    return out


README_TEXT = README.read_text(encoding="utf-8")
BLOCKS = blocks(README_TEXT)
RUNNABLE = [b for b in BLOCKS if b.lang in SHELL_LANGS or b.lang == "python"]


def top_commands() -> list[str]:
    """The backticked commands of the README's first lines (before the first rule)."""
    head = README_TEXT.split("\n---\n", 1)[0]
    return [c for c in re.findall(r"`([^`\n]+)`", head) if " " in c]


# --- where and how the commands run ------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory that looks like a fresh checkout with its `.venv`: the checkout's files
    linked in, `.venv` the environment running these tests. Files a command writes land
    here, not in the checkout."""
    work = tmp_path_factory.mktemp("clone")
    for name in CHECKOUT:
        if (ROOT / name).exists():
            (work / name).symlink_to(ROOT / name)
    (work / ".venv").symlink_to(Path(sys.prefix))
    return work


@pytest.fixture(scope="module")
def env(workdir: Path) -> dict[str, str]:
    """What `. .venv/bin/activate` gives, offline, with no server secrets from outside."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NMT_INCREMENTAL_")}
    venv_bin = str(Path(sys.prefix) / "bin")
    env |= {
        "PATH": f"{venv_bin}{os.pathsep}{env.get('PATH', '')}",
        "VIRTUAL_ENV": sys.prefix,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(workdir / ".hf"),
        "NMT_INCREMENTAL_HOME": str(workdir / ".nmt-incremental"),
        "PYTHONUNBUFFERED": "1",
    }
    return env


def bash(command: str, cwd: Path, env: dict[str, str], timeout: float = 60) -> str:
    done = subprocess.run(
        ["bash", "-c", f"set -euo pipefail\n{command}"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"{command}\nexit {done.returncode}\n{done.stderr[-3000:]}"
    return done.stdout


def expected_output(command: str) -> str | None:
    """`... # -> TEXT`: the output the README promises."""
    match = re.search(r"#\s*->\s*(.+)$", command)
    return match.group(1).strip() if match else None


def needs_network(command: str, workdir: Path) -> bool:
    """A hub download, a package index or a system package manager."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        words = command.split()
    text = " ".join(words)
    if re.search(NETWORK, text):
        return True
    models = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--model"]
    return any(not (workdir / model).exists() for model in models)


# --- the first lines ---------------------------------------------------------------------


def test_first_lines_set_up_run_and_test(workdir: Path, env: dict[str, str]) -> None:
    """The contract of the first lines: one command that sets up and runs the main job,
    one that runs the tests."""
    commands = top_commands()
    setup = next(c for c in commands if "nmt-incremental translate" in c)
    assert "bash .ci/run" in commands
    assert re.search(r"\bpytest\b", (ROOT / ".ci" / "run").read_text(encoding="utf-8"))
    steps = [step.strip() for step in setup.split("&&")]
    assert steps[0].startswith("python3 -m venv .venv"), steps
    assert steps[1] == ".venv/bin/pip install -e .", steps
    # Creating the venv and installing need the package index: the venv running this test
    # stands in for them. The main job runs as written.
    out = bash(steps[2], workdir, env)
    assert out.strip() == "我三点见汤姆", out


# --- the blocks --------------------------------------------------------------------------


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_readme_block_runs(block: Block, workdir: Path, env: dict[str, str]) -> None:
    if block.skip:
        pytest.skip(f"README line {block.line} not run ({block.skip}): {block.commands}")
    if block.lang == "python":
        run_python(block, workdir, env)
    elif block.commands[0].startswith("nmt-incremental serve"):
        run_live_session(block, workdir, env)
    else:
        for command in block.commands:
            out = bash(command, workdir, env)
            want = expected_output(command)
            assert out.strip(), command
            if want is not None:
                assert out.strip() == want, f"{command}\nprinted {out!r}"


def shown_output(block: Block) -> str | None:
    """The `text` block right after a python block: what the README says it prints."""
    after = BLOCKS[BLOCKS.index(block) + 1 :]
    if after and after[0].lang == "text" and after[0].section == block.section:
        return after[0].text
    return None


def run_python(block: Block, workdir: Path, env: dict[str, str]) -> None:
    script = workdir / f"readme_line_{block.line}.py"
    script.write_text(block.text + "\n", encoding="utf-8")
    out = bash(f"python {script.name}", workdir, env, timeout=90)
    printed = [line.rstrip() for line in out.splitlines()]
    shown = shown_output(block)
    if shown is None:
        assert printed, "the snippet printed nothing"
        return
    want = [line.rstrip() for line in shown.splitlines()]
    # Partials may be skipped when the machine is busy (latest wins): the final is exact,
    # and partial updates (lines labelled like the shown ones) came before it.
    assert printed[-1] == want[-1], out
    label = want[0].split()[0]
    assert len(printed) >= 2 and all(line.startswith(label) for line in printed[:-1]), out
    # A partial shown with stable text and a tentative tail ("partial 我[要见汤姆]"): the
    # snippet really prints one.
    tail = re.compile(r"\S\[[^\]]+\]$")
    if any(tail.search(line) for line in want[:-1]):
        assert any(tail.search(line) for line in printed[:-1]), out


# --- a live session: serve, a writer, a viewer, the pages ---------------------------------


@dataclass
class Process:
    """A background command and the output lines it has written so far."""

    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    seen: threading.Condition = field(default_factory=threading.Condition)
    reading: bool = True  # its output is still being read

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        with self.seen:
            while True:
                for line in self.lines:
                    match = re.search(pattern, line)
                    if match:
                        return match
                left = deadline - time.monotonic()
                if left <= 0 or not self.reading:
                    raise AssertionError(f"no {pattern!r} in:\n" + "\n".join(self.lines[-40:]))
                self.seen.wait(min(left, 0.2))


@contextlib.contextmanager
def started(argv: list[str], cwd: Path, env: dict[str, str]) -> Iterator[Process]:
    """A background command, its stdout and stderr lines collected as they come; ended
    with SIGTERM (then SIGKILL) on the way out if still running."""
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    running = Process(proc)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with running.seen:
                running.lines.append(line.rstrip("\n"))
                running.seen.notify_all()
        with running.seen:
            running.reading = False
            running.seen.notify_all()

    threading.Thread(target=read, daemon=True).start()
    try:
        yield running
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[str], timeout: float = 20) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def fetch(url: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.headers.get("Content-Type", ""), response.read().decode()


def readme_urls(text: str) -> set[str]:
    """Every page of the default server the README names (http, not the WebSocket)."""
    found = re.findall(rf"http://127\.0\.0\.1:{DEFAULT_PORT}[^\s`'\"<>)]*", text)
    return {url.rstrip(".,;:") for url in found}


def run_live_session(block: Block, workdir: Path, env: dict[str, str]) -> None:
    serve, *others = block.commands
    with started([*shlex.split(serve, comments=True), "--port", "0"], workdir, env) as server:
        base = server.wait_for(r"subtitle page: (http://127\.0\.0\.1:(\d+)/)", 60)
        server.wait_for(r" ready$", 60)
        url, port = base.group(1), base.group(2)
        langs = re.findall(r"--model", serve)
        writers = [c for c in others if c.startswith("nmt-incremental send ")]
        opened = [c for c in others if c.startswith("xdg-open")]
        assert writers and opened and len(writers) + len(opened) == len(others), others
        for command in writers:
            argv = [*shlex.split(command, comments=True), "--url", f"ws://127.0.0.1:{port}/ws"]
            with started(argv, workdir, env) as writer:
                page = writer.wait_for(r"subtitle page: (\S+)", 30).group(1)
                assert page == f"{url}?stream=demo", page
                writer.wait_for(r"^FINAL ", 60)  # its first final came back
                for command_open in opened:
                    [_, target] = shlex.split(command_open, comments=True)
                    view_page(target.replace(f":{DEFAULT_PORT}/", f":{port}/"), port, len(langs))
                for target in sorted(readme_urls(README_TEXT)):
                    status, kind, body = fetch(target.replace(f":{DEFAULT_PORT}/", f":{port}/"))
                    assert status == 200 and kind.startswith("text/html"), target
                    assert "<html" in body.lower(), target
        server_status = stop(server.proc)
        assert server_status == 0, "\n".join(server.lines[-20:])
        server.wait_for(r"stopped$", 10)


def view_page(page: str, port: str, models: int) -> None:
    """What the page does: it loads, subscribes to its stream (and language) over /ws and
    receives the stream's updates."""
    status, kind, body = fetch(page)
    assert status == 200 and kind.startswith("text/html") and "subtitles.js" in body, page
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(page).query))
    subscribe = {"type": "subscribe", "stream_id": query.get("stream", "demo")}
    if "lang" in query:
        subscribe["lang"] = query["lang"]
    with connect(f"ws://127.0.0.1:{port}/ws", open_timeout=10) as ws:
        ws.send(json.dumps(subscribe))
        deadline = time.monotonic() + 30
        while True:
            message = json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            assert message["type"] != "error", message
            text = message.get("stable_text", "") + message.get("unstable_text", "")
            if message["type"] == "translation_update" and text:
                break
    if "lang" in query:
        assert message["lang"] == query["lang"], message
    if query.get("lang") == "de":
        assert re.search(r"[A-Za-z]", text), message
    elif models == 1 or query.get("lang") == "zh":
        assert re.search(r"[\u4e00-\u9fff]", text), message


# --- rules about the README itself -------------------------------------------------------


def test_network_commands_are_marked(workdir: Path) -> None:
    """A command that needs the network sits in a block marked skip, so the walk above
    never fails for want of a network and never silently skips a local command."""
    unmarked = [
        (b.line, c)
        for b in RUNNABLE
        if not b.skip and b.lang != "python"
        for c in b.commands
        if needs_network(c, workdir)
    ]
    assert not unmarked, f"mark these blocks <!-- readme-test: skip (WHY) -->: {unmarked}"
    assert all(b.skip.strip() for b in BLOCKS if b.skip is not None)


def test_the_readme_runs_the_main_paths() -> None:
    """The walk covers what the README promises a newcomer, offline."""
    run = [c for b in RUNNABLE if not b.skip for c in b.commands]
    assert any(c.startswith("nmt-incremental translate --model models/fixture/model") for c in run)
    serves = [c for c in run if c.startswith("nmt-incremental serve")]
    assert "nmt-incremental serve --model models/fixture/model" in serves
    assert any("models/fixture_de/model" in c for c in serves)
    assert any(b.lang == "python" and "anyio.run(main)" in b.text for b in RUNNABLE)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*]", "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    return {slug(h) for h in re.findall(r"^#+ +(.+)$", text, flags=re.MULTILINE)}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        missing_anchor = anchor and resolved.suffix == ".md" and anchor not in anchors(resolved)
        if not resolved.exists() or missing_anchor:
            broken.append(target)
    assert not broken, broken


@pytest.mark.parametrize(
    "page", [README, *DOCS], ids=[str(p.relative_to(ROOT)) for p in PAGES[:-1]]
)
def test_repository_paths_exist(page: Path) -> None:
    """Files and folders of the repository the page names in backticks exist (a stale
    name, such as a module that moved, fails here)."""
    named = re.findall(
        r"`((?:engine|protocol|examples|models|tests|docs|\.ci)/[\w./*-]*)`",
        page.read_text(encoding="utf-8"),
    )
    missing = [
        name
        for name in named
        if not (any(ROOT.glob(name)) if "*" in name else (ROOT / name).exists())
    ]
    assert not missing, missing


def test_the_readme_fits_in_250_lines() -> None:
    """A newcomer's page: detail goes to docs/."""
    assert len(README_TEXT.splitlines()) <= 250


def test_inline_commands_name_files_that_exist() -> None:
    """A command quoted in the text (not a block, so not run) names files of the checkout
    that are there (`listen talk.wav` named none)."""
    spans = re.findall(
        r"`(nmt-incremental [^`]+)`", re.sub(r"```.*?```", "", README_TEXT, flags=re.S)
    )
    assert spans
    missing = []
    for span in spans:
        for word in shlex.split(span, comments=True)[1:]:
            looks_like_file = "/" in word or re.search(r"\.(wav|jsonl|txt|gz|dict)$", word)
            placeholder = word.upper() == word or "://" in word or word.startswith("-")
            if looks_like_file and not placeholder and not (ROOT / word).exists():
                missing.append((span, word))
    assert not missing, missing


def test_manual_cluster_nodes_start_redis_first() -> None:
    """docs/deployment.md: a block of `serve --bus redis://...` nodes starts Redis before
    them, and is not the `cluster.py` block (which starts its own)."""
    text = (ROOT / "docs" / "deployment.md").read_text(encoding="utf-8")
    manual = [b for b in blocks(text) if "--bus redis://" in b.text and "serve" in b.text]
    assert manual
    for block in manual:
        commands = block.commands
        first_node = next(i for i, c in enumerate(commands) if "--bus redis://" in c)
        assert any(c.startswith("redis-server") for c in commands[:first_node]), commands
        assert "cluster.py" not in block.text, commands
