"""`nmt-incremental listen` end to end: spoken sentences (espeak-ng) through pocketsphinx
and the fixture model to JSON Lines, a live view, WebVTT/SRT files and a transcript log."""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import wave
from pathlib import Path

import pytest

import protocol
from engine.cli.main import build_parser, main
from engine.logs.format import read_log
from engine.subtitles import timestamp
from protocol import TranslationUpdate
from tests.conftest import FIXTURE_MODEL, ROOT, needs_fixture

SPEECH = ROOT / "examples" / "speech"
SENTENCES = [("Frank can clean the room", "en-us+klatt2"), ("Jack draws a map", "en-us+klatt2")]
DOMAIN = ["--lm", str(SPEECH / "fixture.lm.gz"), "--dict", str(SPEECH / "fixture.dict")]


def needs_speech() -> None:
    pytest.importorskip("pocketsphinx")
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed")
    needs_fixture()


@pytest.fixture(scope="module")
def spoken(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    """Two sentences and a second of silence between them, at espeak-ng's own 22050 Hz (so
    that listen resamples): the WAV file and its raw PCM."""
    needs_speech()
    folder = tmp_path_factory.mktemp("speech")
    parts = []
    for n, (text, voice) in enumerate(SENTENCES):
        path = folder / f"{n}.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-w", str(path), text], check=True)
        with wave.open(str(path)) as w:
            rate = w.getframerate()
            parts.append(w.readframes(w.getnframes()))
    second = b"\0\0" * rate
    pcm = second[:rate] + parts[0] + second + parts[1] + second  # 0.5 s, speech, 1 s ...
    wav = folder / "two.wav"
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)
    return wav, pcm


def updates_of(text: str) -> list[TranslationUpdate]:
    out = []
    for line in text.splitlines():
        message = protocol.parse(line)
        assert isinstance(message, TranslationUpdate), line
        out.append(message)
    return out


def test_listen_writes_json_lines_subtitles_and_a_transcript_log(
    spoken: tuple[Path, bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import srt
    import webvtt

    wav, _ = spoken
    vtt, srt_file, log = tmp_path / "out.vtt", tmp_path / "out.srt", tmp_path / "heard.jsonl"
    argv = ["listen", str(wav), "--model", str(FIXTURE_MODEL), *DOMAIN]
    argv += ["--vtt", str(vtt), "--srt", str(srt_file), "--transcript-log", str(log)]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    updates = updates_of(out)
    finals = [u for u in updates if u.is_final]
    assert [u.segment_id for u in finals] == [0, 1]
    assert all(u.stream_id == "demo" and u.lang == "zh" for u in updates)
    for segment in (0, 1):  # stable text only grows within a segment
        shown = [u.stable_text for u in updates if u.segment_id == segment and not u.is_final]
        assert all(b.startswith(a) for a, b in itertools.pairwise(shown))
    assert finals[0].source_text == "frank can clean the room"
    assert finals[0].stable_text == "弗兰克能打扫房间"
    assert "subtitles:" in err and "heard" in err
    cues = webvtt.read(str(vtt)).captions
    assert [c.text for c in cues] == [u.stable_text for u in finals]
    # Timed by the audio: the speech starts after half a second of silence.
    assert finals[0].start_ms is not None and 300 <= finals[0].start_ms <= 700
    assert [c.start for c in cues] == [timestamp(u.start_ms or 0, "vtt") for u in finals]
    subs = list(srt.parse(srt_file.read_text(encoding="utf-8")))
    assert [s.content for s in subs] == [u.stable_text for u in finals]
    lines = read_log(log)  # a valid transcript log, replayable
    heard = [line for line in lines if line["is_final"]]
    assert [line["text"] for line in heard] == [u.source_text for u in finals]
    assert all(line["emit_ms"] >= line["end_ms"] for line in lines)


def test_the_readme_command_hears_the_fixtures_sentences(
    spoken: tuple[Path, bytes], tmp_path: Path
) -> None:
    """`nmt-incremental listen talk.wav` as the README writes it, from another working
    directory: the checkout's fixture by default, the language model its directory names,
    one final per sentence at the pause."""
    wav, _ = spoken
    talk = tmp_path / "talk.wav"
    shutil.copy(wav, talk)
    done = subprocess.run(
        [sys.executable, "-m", "engine.cli", "listen", "talk.wav"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    finals = [u for u in updates_of(done.stdout) if u.is_final]
    assert [u.source_text for u in finals] == [text.lower() for text, _ in SENTENCES]


def run(argv: list[str], stdin: bytes = b"", terminal: bool | None = None) -> tuple[int, str, str]:
    from engine.cli.listen import run_listen

    args: argparse.Namespace = build_parser().parse_args(argv)
    out, err = io.StringIO(), io.StringIO()
    code = run_listen(args, io.BytesIO(stdin), out, err, terminal=terminal)
    return code, out.getvalue(), err.getvalue()


def test_listen_reads_raw_pcm_on_stdin_like_the_file(spoken: tuple[Path, bytes]) -> None:
    wav, pcm = spoken
    model = ["--model", str(FIXTURE_MODEL), *DOMAIN]
    code, from_file, _ = run(["listen", str(wav), *model], terminal=False)
    assert code == 0
    code, from_stdin, _ = run(["listen", "-", "--rate", "22050", *model], pcm, terminal=False)
    assert code == 0
    finals = [
        [u.stable_text for u in updates_of(out) if u.is_final] for out in (from_file, from_stdin)
    ]
    assert finals[0] == finals[1] and len(finals[0]) == 2


def test_listen_on_a_terminal_shows_the_subtitles_forming(spoken: tuple[Path, bytes]) -> None:
    wav, _ = spoken
    code, out, _ = run(["listen", str(wav), "--model", str(FIXTURE_MODEL), *DOMAIN], terminal=True)
    assert code == 0
    assert "translation_update" not in out  # people get the view, not JSON
    assert "弗兰克能打扫房间" in out and "← frank can clean the room" in out
    assert "2 finals" in out and "heard" in out


def test_listen_refuses_audio_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("pocketsphinx")
    needs_fixture()
    model = ["--model", str(FIXTURE_MODEL)]
    assert main(["listen", str(tmp_path / "missing.wav"), *model]) == 2
    assert "missing.wav: No such file" in capsys.readouterr().err
    text = tmp_path / "notes.wav"
    text.write_text("not audio")
    assert main(["listen", str(text), *model]) == 2
    assert "not a WAV file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["listen", "-", "--rate", "4000", *model])
    assert exit_.value.code == 2
    assert "--rate: sample rate 4000 Hz is outside 8000..192000 Hz" in capsys.readouterr().err


def test_listen_without_the_asr_extra_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "pocketsphinx", None)  # as if not installed
    assert main(["listen", "-", "--model", str(FIXTURE_MODEL)]) == 2
    assert "pip install -e '.[asr]'" in capsys.readouterr().err


def test_the_test_set_manifest_names_its_files() -> None:
    items = [json.loads(line) for line in (SPEECH / "manifest.jsonl").read_text().splitlines()]
    assert len(items) >= 30 and len({i["voice"] for i in items}) >= 2
    assert sum(1 for i in items if i["pause_ms"]) >= 3
    for item in items:
        path = SPEECH / item["file"]
        if path.exists():  # the WAVs may be left to make_set.py
            with wave.open(str(path)) as w:
                assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16_000, 1, 2)


def test_listen_serve_shows_the_subtitles_to_viewers(
    spoken: tuple[Path, bytes], tmp_path: Path
) -> None:
    """`--serve`: a viewer of the subtitle server in the process gets the finals (even
    after the input ended: the stream stays open until Ctrl-C, which then ends it)."""
    from websockets.sync.client import connect

    wav, _ = spoken
    vtt = tmp_path / "served.vtt"
    command = [sys.executable, "-m", "engine.cli", "listen", str(wav), *DOMAIN]
    command += ["--model", str(FIXTURE_MODEL), "--serve", "127.0.0.1:0", "--vtt", str(vtt)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        command, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    lines: queue.Queue[str] = queue.Queue()
    stderr = proc.stderr
    assert stderr is not None

    def read_stderr() -> None:
        for line in stderr:
            lines.put(line)

    threading.Thread(target=read_stderr, daemon=True).start()
    try:
        url = None
        while True:
            line = lines.get(timeout=60)
            if line.startswith("subtitle page: "):
                url = line.split(": ", 1)[1].strip()
            if line.startswith("input ended"):
                break
        assert url is not None and url.endswith("?stream=demo")
        finals: list[str] = []
        with connect("ws" + url.split("?")[0][4:] + "ws") as ws:
            ws.send(json.dumps({"type": "subscribe", "stream_id": "demo"}))
            while len(finals) < 2:
                message = protocol.parse(str(ws.recv(timeout=30)))
                if isinstance(message, TranslationUpdate) and message.is_final:
                    finals.append(message.stable_text)
        assert finals[0] == "弗兰克能打扫房间"
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    assert code == 0
    assert len(read_cues(vtt)) == 2


def read_cues(path: Path) -> list[str]:
    import webvtt

    return [caption.text for caption in webvtt.read(str(path)).captions]
