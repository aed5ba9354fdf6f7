"""Every hint the command line prints leads somewhere: the commands its errors advise are
run, as printed, and must work.

A newcomer follows what an error says to the letter, so an advised command that names no
model, or an extra from a package index the project is not published on, is a dead end.
Each test here provokes one error, takes the command out of its message (the text between
backticks), runs it where it needs no network (the fake hub on loopback of
`tests/test_hub.py` stands in for the hub, pip runs `--dry-run --no-index`) and checks
what it was meant to achieve.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from importlib.metadata import metadata
from pathlib import Path

import pytest

from engine.cli.main import build_parser, main
from engine.conversion import verify as export_verify
from engine.decoding.translator import Translator
from engine.hub.files import repo_model_name
from engine.hub.settings import HubSettings
from tests.conftest import FIXTURE_MODEL, ROOT
from tests.test_hub import (
    SENTENCE,
    FakeHub,
    hub,  # noqa: F401  (the fake hub fixture, used by `fake`)
)

REPO = "Helsinki-NLP/opus-mt-en-fr"  # no catalog entry: pulled by repo id
TOKENIZER = ("config.json", "source.spm", "target.spm", "vocab.json", "tokenizer_config.json")
ONNX = ("encoder_model.onnx", "decoder_model_merged.onnx")
README = (ROOT / "README.md").read_text(encoding="utf-8")


@pytest.fixture
def fake(request: pytest.FixtureRequest) -> FakeHub:
    """test_hub's running fake hub (its environment set up and torn down by that fixture)."""
    server: FakeHub = request.getfixturevalue("hub")
    return server


def repo_files(folder: str = "onnx") -> dict[str, bytes]:
    """The fixture laid out as an Optimum export repo: tokenizer on top, ONNX in `folder`."""
    files = {name: (FIXTURE_MODEL / name).read_bytes() for name in TOKENIZER}
    files |= {f"{folder}/{name}": (FIXTURE_MODEL / name).read_bytes() for name in ONNX}
    return files


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`nmt-incremental ARGV` in this process: status, stdout, stderr."""
    capsys.readouterr()
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def advised(message: str, program: str = "nmt-incremental") -> list[list[str]]:
    """The commands of `program` a message advises, as argument lists (the text between
    backticks, as the messages quote them)."""
    commands = [shlex.split(c) for c in re.findall(r"`([^`]+)`", message)]
    return [c[1:] for c in commands if c and c[0] == program]


def test_offline_pull_of_a_repo_advises_a_pull_that_works_and_what_to_copy(
    fake: FakeHub, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.add_repo(REPO, repo_files())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    status, _, err = cli(capsys, "models", "pull", REPO)
    assert status == 2 and "HF_HUB_OFFLINE=1 forbids" in err, err
    assert fake.requests == []
    [command] = advised(err)
    assert command == ["models", "pull", REPO]  # not the directory name "owner--name"
    settings = HubSettings.from_env()
    assert str(settings.hub_cache) in err and str(settings.models_root) in err

    # "on a machine with internet access": the advised command, as printed
    monkeypatch.delenv("HF_HUB_OFFLINE")
    status, out, err = cli(capsys, *command)
    assert status == 0, err
    model_dir = Path(out.strip().splitlines()[-1])
    assert model_dir == settings.models_root / repo_model_name(REPO)

    # "copy its cache and the model directory it prints ... and set HF_HUB_OFFLINE=1"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = len(fake.requests)
    status, out, err = cli(capsys, "translate", "--model", REPO, SENTENCE)
    assert status == 0, err
    # the fixture's weights, pulled without its >>cmn_Hans<< (this repo's catalog has none)
    assert out.strip() == Translator.from_dir(model_dir).translate([SENTENCE])[0].text != ""
    assert len(fake.requests) == before
    # the cache alone is not enough for a repo: the model directory holds its layout
    shutil.rmtree(model_dir)
    status, _, err = cli(capsys, "translate", "--model", REPO, SENTENCE)
    assert status == 2 and "forbids listing" in err


def test_offline_pull_of_a_repo_subfolder_advises_the_subfolder(
    fake: FakeHub, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    status, _, err = cli(capsys, "models", "pull", REPO, "--subfolder", "en-fr")
    assert status == 2
    assert advised(err) == [["models", "pull", REPO, "--subfolder", "en-fr"]]


def test_a_repo_with_several_models_advises_a_subfolder_that_pulls(
    fake: FakeHub, capsys: pytest.CaptureFixture[str]
) -> None:
    """Top-level ONNX files and a second model in a folder: the example must name a
    folder (no --subfolder value picks the top level out of the two)."""
    files = repo_files(folder="") | repo_files(folder="opus-mt-en-fr")
    fake.add_repo(REPO, {path.lstrip("/"): data for path, data in files.items()})
    status, _, err = cli(capsys, "models", "pull", REPO)
    assert status == 2 and "2 models" in err, err
    [command] = advised(err)
    assert command == ["models", "pull", REPO, "--subfolder", "opus-mt-en-fr"]
    status, out, err = cli(capsys, *command)
    assert status == 0, err
    assert Path(out.strip().splitlines()[-1]).is_dir()


def test_verify_of_a_catalog_model_not_pulled_advises_the_pull(
    fake: FakeHub, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = cli(capsys, "models", "verify", "en-zh")
    assert status == 2 and "not in the cache" in err, err
    [command] = advised(err)
    assert command == ["models", "pull", "en-zh"]
    status, _, err = cli(capsys, *command)
    assert status == 0, err
    status, out, err = cli(capsys, "models", "verify", "en-zh")
    assert status == 0 and out.rstrip().endswith("ok"), out + err


def test_verify_of_a_repo_not_pulled_advises_the_pull(
    fake: FakeHub, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.add_repo(REPO, repo_files())
    status, _, err = cli(capsys, "models", "verify", REPO)
    assert status == 2 and "unknown model" in err, err
    [command] = advised(err)
    assert command == ["models", "pull", REPO]
    assert cli(capsys, *command)[0] == 0
    status, out, err = cli(capsys, "models", "verify", REPO)
    assert status == 0 and out.rstrip().endswith("ok"), out + err


def test_export_without_its_extra_advises_an_install_that_pip_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(export_verify, "missing_export_modules", lambda: ["torch"])
    status, _, err = cli(capsys, "models", "export", str(tmp_path / "ckpt"), str(tmp_path / "o"))
    assert status == 2 and "needs the `export` extra" in err, err
    [install] = re.findall(r"pip install [^ ]+ '[^']+'", err)
    assert install == "pip install -e '.[export]'"
    assert install in README  # the README says the same
    # pip, from the checkout, offline: it must find the project and its extra
    args = [*shlex.split(install)[2:], "--dry-run", "--no-deps", "--no-index"]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-build-isolation", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "Would install nmt-incremental" in done.stdout
    # the extra it names is one the project declares (pip checks extras only with deps)
    [extra] = re.findall(r"\[(\w+)\]", install)
    assert extra in (metadata("nmt-incremental").get_all("Provides-Extra") or [])


def test_export_help_names_the_same_install() -> None:
    help_text = subcommand(build_parser(), "models", "export").format_help()
    assert "pip install -e '.[export]'" in " ".join(help_text.split())


def test_hf_login_hint_names_a_command_that_exists() -> None:
    """Gated and private repos advise `hf auth login` (huggingface_hub's command line,
    installed with it): it must be there and know the subcommand."""
    hf = Path(sys.executable).with_name("hf")
    assert hf.is_file()
    done = subprocess.run(
        [str(hf), "auth", "login", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "token" in done.stdout.lower()


def subcommand(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    for name in names:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


@pytest.mark.parametrize(
    ("command", "metavar"), [("pull", "NAME_OR_REPO"), ("verify", "DIR_OR_NAME")]
)
def test_models_synopsis_and_help_name_the_argument_alike(command: str, metavar: str) -> None:
    """The README's synopsis and `--help` say what the argument accepts in the same words."""
    parser = subcommand(build_parser(), "models", command)
    positional = [a for a in parser._actions if not a.option_strings and a.dest != "help"]
    assert [a.metavar for a in positional] == [metavar]
    assert f"nmt-incremental models {command} {metavar}" in README


def test_verify_accepts_what_its_help_says(capsys: pytest.CaptureFixture[str]) -> None:
    """DIR_OR_NAME: a directory works (a name is checked above, through the fake hub)."""
    status, out, err = cli(capsys, "models", "verify", str(FIXTURE_MODEL))
    assert status == 0, out + err


def test_install_hints_from_elsewhere_name_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`-e '.[asr]'` is right only in the checkout: from another directory the hint names
    the checkout's path (a wheel's hints: tests/test_wheel.py)."""
    from engine.distribution import install_hint

    assert install_hint("asr") == "pip install -e '.[asr]'"  # the tests run in the checkout
    monkeypatch.chdir(tmp_path)
    assert install_hint("asr") == f"pip install -e '{ROOT}[asr]'"
