"""A model directory's `recognizer.json` is checked before anything reads what it names
(issue 53, finding 3): paths inside the directory only (a file elsewhere only when given
on the command line), regular files within bounds, a dictionary that is one; each refusal
one `error:` line and exit 2, from `listen` and from `serve --asr` alike."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import wave
from pathlib import Path

import pytest

from engine.asr.sphinx import FILE_LIMITS
from tests.conftest import FIXTURE_MODEL, ROOT, needs_fixture

SPEECH = ROOT / "examples" / "speech"


def needs_asr() -> None:
    needs_fixture()
    pytest.importorskip("pocketsphinx")


@pytest.fixture(scope="module")
def wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("audio") / "silence.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\0\0" * 16000)
    return path


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A copy of the fixture's model directory, whose recognizer.json a test rewrites."""
    needs_asr()
    folder = tmp_path / "model"
    shutil.copytree(FIXTURE_MODEL, folder)
    return folder


def name(model: Path, **paths: str) -> None:
    (model / "recognizer.json").write_text(json.dumps(paths))


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def refused(done: subprocess.CompletedProcess[str], *words: str) -> str:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, done.stderr
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


def listen(model: Path, wav: Path, *options: str) -> subprocess.CompletedProcess[str]:
    return cli("listen", str(wav), "--model", str(model), *options)


@pytest.mark.parametrize("option", ["lm", "dict", "domain_text"])
def test_a_path_outside_the_model_directory_is_refused(option: str, model: Path, wav: Path) -> None:
    name(model, **{option: "/dev/zero"})
    refused(listen(model, wav), "recognizer.json", "outside the model directory")
    (model / "zero").symlink_to("/dev/zero")  # a link that leaves it, too
    name(model, **{option: "zero"})
    refused(listen(model, wav), "outside the model directory")
    name(model, **{option: "../../etc/passwd"})
    refused(listen(model, wav), "outside the model directory")


def test_what_is_not_a_regular_file_is_refused_from_json_and_command_line(
    model: Path, wav: Path
) -> None:
    os.mkfifo(model / "lm.fifo")  # inside, but a pipe: pocketsphinx would wait on it
    name(model, lm="lm.fifo", dict="fixture.dict")
    refused(listen(model, wav), "lm.fifo: not a regular file (language model)")
    for option in ("--lm", "--dict", "--domain-text"):  # given: elsewhere is fine, /dev/zero not
        refused(listen(model, wav, option, "/dev/zero"), "/dev/zero: not a regular file")
    (model / "recognizer.json").unlink()
    (model / "recognizer.json").mkdir()
    refused(listen(model, wav), "recognizer.json: not a regular file")


def test_a_file_over_its_bound_is_refused(model: Path, wav: Path) -> None:
    huge = model / "huge.lm"
    with open(huge, "wb") as f:
        f.truncate(FILE_LIMITS["lm"] + 1)  # sparse: no disk used
    name(model, lm="huge.lm", dict="fixture.dict")
    refused(listen(model, wav), "huge.lm", "more than a language model may be")


def test_a_dictionary_that_is_no_dictionary_is_refused(model: Path, wav: Path) -> None:
    shutil.copy(ROOT / "README.md", model / "words.dict")
    name(model, lm="fixture.lm.gz", dict="words.dict")
    refused(listen(model, wav), "words.dict: not a pronunciation dictionary", "line 1")
    # Given on the command line, the same.
    refused(listen(model, wav, "--dict", str(ROOT / "README.md")), "not a pronunciation")
    # The fixture's own is one.
    name(model, lm="fixture.lm.gz", dict="fixture.dict")
    done = listen(model, wav)
    assert done.returncode == 0, done.stderr


def test_serve_refuses_to_start(model: Path) -> None:
    shutil.copy(ROOT / "README.md", model / "words.dict")
    name(model, lm="fixture.lm.gz", dict="words.dict")
    done = cli("serve", "--port", "0", "--model", str(model), "--asr", "pocketsphinx")
    refused(done, "not a pronunciation dictionary")
    name(model, dict="/dev/zero")
    done = cli("serve", "--port", "0", "--model", str(model), "--asr", "pocketsphinx")
    refused(done, "outside the model directory")
