"""A user's mistakes, with every subcommand: each is answered with one `error:` line and
exit status 2, never a traceback; unknown options are named with a close match under the
subcommand's own usage; a model path that is not there names the directories near it
before any request to the hub; `--model` defaults alike everywhere."""

from __future__ import annotations

import contextlib
import importlib.metadata
import socket
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

import engine.cli.args
import engine.hub.download
from engine.asr.audio import resample
from engine.bridges.audio import AudioSource
from engine.cli.main import build_parser, main, version
from engine.cli.recognizer import model_recognizer, sphinx_options
from engine.hub.nearby import near_model_dirs
from tests.conftest import FIXTURE_MODEL, ROOT, needs_fixture

SPEECH = ROOT / "examples" / "speech"
LOG = ROOT / "examples" / "logs" / "fixture_en_zh.jsonl"


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def write_wav(path: Path, rate: int, seconds: float = 1.0, channels: int = 1) -> bytes:
    """A tone at `rate` Hz (16-bit, `channels` equal channels); returns its mono PCM."""
    t = np.arange(int(rate * seconds)) / rate
    mono = (8000 * np.sin(2 * np.pi * 440 * t)).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.repeat(mono, channels).tobytes())
    return mono.tobytes()


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory with the checkout's models/, a file that is no WAV and a WAV
    at espeak-ng's 22050 Hz; the hub must not be asked."""
    needs_fixture()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").symlink_to(ROOT / "models")
    (tmp_path / "notwav.wav").write_text("hello\n")
    write_wav(tmp_path / "talk.wav", 22050)

    def no_hub(*args: object, **kwargs: object) -> None:
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(engine.hub.download, "repo_entry", no_hub)
    return tmp_path


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int | str | None, str]:
    try:
        status: int | str | None = main(argv)
    except SystemExit as exit:
        status = exit.code
    return status, capsys.readouterr().err


def assert_one_error(status: object, err: str, expected: str) -> str:
    lines = [line for line in err.splitlines() if "error:" in line]
    assert status == 2, err
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert expected in lines[0], err
    return lines[0]


M = str(FIXTURE_MODEL)

MISTAKES = [
    (["translate", "--modle", M, "hi"], "unrecognized option --modle (did you mean --model?)"),
    (["translate", "--model", "nope", "hi"], "unknown model 'nope'"),
    (["translate", "--model", M, "--model", "fixture_de", "hi"],
     f"--model given twice ({M} and fixture_de): this command translates with one model"),
    (["replay", str(LOG), "--model", "fixture", "--model", "fixture_de"], "--model given twice"),
    (["translate", "--model", M, "--beam", "0", "hi"], "argument --beam: must be >= 1"),
    (["serve", "--model", M, "--prot", "9000"], "unrecognized option --prot (did you mean --port"),
    (["serve", "--model", M, "stray"], "unrecognized arguments: stray"),
    (["serve", "--port", "99999"], "must be between 0 and 65535"),
    (["serve", "--lm", "x.lm"], "--lm is a recognizer option: it needs --asr pocketsphinx"),
    (["serve", "--asr", "pocketsphinx", "--lm", "nope.lm"], "nope.lm"),
    (["replay", "nope.jsonl"], "nope.jsonl: No such file or directory"),
    (["replay", "notwav.wav"], "notwav.wav:1: invalid JSON"),
    (["replay", str(LOG), "--policy", "bogus"], "unknown policy 'bogus'"),
    (["replay", str(LOG), "--out", "no/such/dir/x.jsonl"], "No such file or directory"),
    (["listen", "nope.wav"], "nope.wav: No such file or directory"),
    (["listen", "notwav.wav"], "notwav.wav: not a WAV file"),
    (["listen", "talk.wav", "--rate", "5"], "sample rate 5 Hz is outside"),
    (["listen", "talk.wav", "--serve", "abc"], "--serve 'abc': expected [HOST:]PORT"),
    (["listen", "talk.wav", "--silnce", "1"], "(did you mean --silence?)"),
    (["models", "verify", "nope"], "unknown model 'nope'"),
    (["models", "pull", "--quantised", "en-zh"], "(did you mean --quantized?)"),
    (["logs", "make", "nope.txt", "--lang", "en", "--out", "x.jsonl"], "nope.txt: No such file"),
    (["logs", "make", "x.txt", "--lang", "en", "--out", "x", "--limt", "3"], "--limit?"),
    (["bridge", "vosk", "--stream-id", "d"], "give the recogniser's URL, or --listen"),
    (["bridge", "vosk", "ws://127.0.0.1:1", "--stream-id", "d", "--audio", "nope.wav"],
     "nope.wav: No such file or directory"),
    (["bridge", "vosk", "ws://127.0.0.1:1", "--stream-id", "d", "--audio", "notwav.wav"],
     "notwav.wav: not a WAV file"),
    (["bridge", "whisper-streaming", "bad", "--stream-id", "d", "--audio", "talk.wav"],
     "give the whisper_streaming server as HOST:PORT"),
    (["bridge", "vosk", "ws://h:1", "--stream-id", "d", "--audio-rate", "44"], "outside"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "expected"), MISTAKES, ids=lambda v: " ".join(v)[:60])
def test_a_mistake_gets_one_error_line_and_exit_2(
    argv: list[str], expected: str, files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, err = run(argv, capsys)
    assert_one_error(status, err, expected)


@pytest.mark.parametrize(
    ("argv", "prog", "unknown", "listed"),
    [
        (["serve", "--prot", "9000"], "nmt-incremental serve", "--prot", "options"),
        (["translate", "--modle", "x"], "nmt-incremental translate", "--modle", "options"),
        (
            ["logs", "hint", "x", "--out", "y", "--lagg", "2"],
            "nmt-incremental logs hint",
            "--lagg",
            "options",
        ),
        (["--verison"], "nmt-incremental", "--verison", "commands"),
    ],
)
def test_an_unknown_option_is_one_line_naming_the_command_and_where_its_help_is(
    argv: list[str], prog: str, unknown: str, listed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """No usage block before it (8 lines that buried the one that matters): the error,
    then where the options are."""
    status, err = run(argv, capsys)
    assert_one_error(status, err, f"unrecognized option {unknown} (did you mean")
    first, *rest = err.splitlines()
    assert first.startswith(f"{prog}: error: unrecognized option {unknown} (did you mean --")
    assert rest == [f"(`{prog} --help` lists the {listed})"], err


@pytest.mark.parametrize(
    ("argv", "commands"),
    [([], "translate, replay, logs, serve, send"), (["models"], "pull, list, verify, fp16")],
)
def test_a_missing_command_names_the_commands(
    argv: list[str], commands: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, err = run(argv, capsys)
    assert_one_error(status, err, f"error: give a command: {commands}")
    assert len(err.splitlines()) == 2, err


def test_an_unknown_option_without_a_close_one_gets_no_guess(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, err = run(["logs", "make", "a", "--lang", "en", "--out", "b", "--bogus"], capsys)
    assert assert_one_error(status, err, "unrecognized option --bogus").endswith("--bogus")


def test_version_is_the_packages(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    status, out = exit.value.code, capsys.readouterr().out
    assert status == 0
    assert out.strip() == f"nmt-incremental {importlib.metadata.version('nmt-incremental')}"
    assert version() != "unknown (not installed)"


# --- a model that is not there --------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "meant"),
    [
        ("fixture/model", "models/fixture/model"),  # the start left off: no hub request
        ("models/fixtur/model", "models/fixture/model"),
        ("./models/fixture_d/model", "models/fixture_de/model"),
        ("model/fixture/model", "models/fixture/model"),
    ],
)
def test_a_model_path_that_is_not_there_names_the_near_ones(
    spec: str, meant: str, files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, err = run(["translate", "--model", spec, "hi"], capsys)
    line = assert_one_error(status, err, "no such directory")
    assert line.endswith(f"did you mean {meant}?)"), line


def test_near_directories_only_end_a_repo_id_search_when_the_path_ends_with_it(
    files: Path,
) -> None:
    assert near_model_dirs("fixture/model", close=False) == ["models/fixture/model"]
    assert near_model_dirs("Helsinki-NLP/opus-mt-en-zh", close=False) == []
    assert near_model_dirs("totally/else/here") == []


# --- one --model rule -----------------------------------------------------------------


COMMANDS = [["translate", "hi"], ["replay", "x.jsonl"], ["serve"], ["listen", "x.wav"]]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda v: v[0])
def test_every_command_defaults_to_the_checkouts_fixture(argv: list[str]) -> None:
    needs_fixture()
    model = build_parser().parse_args(argv).model
    assert model in (str(FIXTURE_MODEL), [str(FIXTURE_MODEL)])
    given = build_parser().parse_args([*argv, "--model", "elsewhere"]).model
    assert given in ("elsewhere", ["elsewhere"])  # replaces the default, never joins it


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda v: v[0])
def test_without_a_checkout_every_command_requires_model(
    argv: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(engine.cli.args, "CHECKOUT_FIXTURE", tmp_path / "none")
    status, err = run(argv, capsys)
    line = assert_one_error(status, err, "the following arguments are required: --model")
    assert "a catalog name such as en-zh" in line


# --- bridges take what listen takes ---------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("channels", [1, 2])
async def test_a_bridge_resamples_a_wav_as_listen_does(tmp_path: Path, channels: int) -> None:
    wav = tmp_path / "tone.wav"
    mono = write_wav(wav, 22050, channels=channels)
    source = AudioSource(str(wav), rate=16000, speed=1000.0)
    sent = b"".join([chunk async for chunk in source.chunks(1600)])
    source.close()
    assert source.sample_rate == 16000
    assert sent == resample(mono, 22050, 16000)  # the same bytes as the recognizer seam's
    vosk = AudioSource(str(wav), rate=None)  # vosk is told the file's rate
    assert vosk.sample_rate == 22050
    vosk.close()


def test_a_bridge_with_no_server_says_so_in_one_line(files: Path) -> None:
    """The real command, as a user runs it: our server is not up (and the recogniser's
    neither), the WAV is at 22050 Hz."""
    to = f"ws://127.0.0.1:{closed_port()}/ws"
    upstream = f"ws://127.0.0.1:{closed_port()}"
    argv = ["whisperlive", upstream, "--stream-id", "d", "--audio", "talk.wav", "--to", to]
    done = subprocess.run(
        [sys.executable, "-m", "engine.cli", "bridge", *argv, "--reconnect-for", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=files,
    )
    line = assert_one_error(done.returncode, done.stderr, f"cannot reach nmt-incremental at {to}")
    assert "is `nmt-incremental serve` running there?" in line
    assert "bridge: connecting to" in done.stderr.splitlines()[0]  # said before it waits


# --- a model's own recognizer data ----------------------------------------------------


def test_the_fixtures_name_their_domains_language_model() -> None:
    needs_fixture()
    named = model_recognizer(str(FIXTURE_MODEL))
    assert named == {
        "lm": str(FIXTURE_MODEL / "fixture.lm.gz"),
        "dict": str(FIXTURE_MODEL / "fixture.dict"),
    }
    for model in ROOT.glob("models/*/model"):  # inside each model directory: copies, kept equal
        for name in ("fixture.lm.gz", "fixture.dict"):
            assert (model / name).read_bytes() == (SPEECH / name).read_bytes()
    serve = build_parser().parse_args(["serve", "--asr", "pocketsphinx"])
    with contextlib.ExitStack() as stack:
        options = sphinx_options(serve, stack, print)
        assert options.language_model == FIXTURE_MODEL / "fixture.lm.gz"
        given = build_parser().parse_args(["listen", "x.wav", "--dict", "my.dict"])
        assert sphinx_options(given, stack, print).language_model is None  # the user's choice


def test_a_bad_recognizer_json_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "recognizer.json").write_text('{"lm": 3}')
    write_wav(tmp_path / "a.wav", 16000)
    status, err = run(["listen", str(tmp_path / "a.wav"), "--model", str(tmp_path)], capsys)
    assert_one_error(status, err, "recognizer.json: expected an object of paths")


@pytest.mark.parametrize("command", ["serve", "listen"])
def test_a_busy_port_says_so_and_names_the_option_that_picks_another(
    command: str, files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not the OS's `[Errno 98] error while attempting to bind on address ...`."""
    if command == "listen":
        pytest.importorskip("pocketsphinx")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = (
            ["serve", "--model", M, "--port", str(port)]
            if command == "serve"
            else ["listen", "talk.wav", "--model", M, "--serve", str(port)]
        )
        status, err = run(argv, capsys)
    option = "--port" if command == "serve" else "--serve"
    line = assert_one_error(status, err, f"error: port {port} on 127.0.0.1 is already in use")
    assert line.endswith(f"choose another port with {option} (0: any free one)"), line
    assert "Errno" not in err
