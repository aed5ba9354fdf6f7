"""The `nmt-incremental` command line: translate, replay and logs, and its error handling."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import protocol
from engine.cli.main import main
from engine.decoding.translator import Translator
from engine.logs.format import read_log
from engine.logs.updates import read_updates
from tests.conftest import FIXTURE_DIR, FIXTURE_MODEL, ROOT, needs_fixture, serving

LOGS = ROOT / "examples" / "logs"
EN_ZH_LOG = LOGS / "fixture_en_zh.jsonl"


@pytest.fixture(scope="module")
def heldout_sources() -> list[str]:
    needs_fixture()
    rows = (FIXTURE_DIR / "heldout.tsv").read_text(encoding="utf-8").splitlines()
    return [r.split("\t")[0] for r in rows if r.strip()][:3]


@pytest.fixture(scope="module")
def offline(heldout_sources: list[str]) -> list[str]:
    translator = Translator.from_dir(FIXTURE_MODEL)
    return [translator.translate_long(s).text for s in heldout_sources]


def set_stdin(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


def short_log(tmp_path: Path, segments: int = 2) -> Path:
    """The first segments of the committed fixture log."""
    if not EN_ZH_LOG.is_file():
        pytest.skip("examples/logs not made yet (see examples/logs/README.md)")
    lines = EN_ZH_LOG.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if json.loads(line)["segment_id"] < segments]
    path = tmp_path / "short.jsonl"
    path.write_text("\n".join(kept) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------
# translate


def test_translate_arguments(
    capsys: pytest.CaptureFixture[str], heldout_sources: list[str], offline: list[str]
) -> None:
    assert main(["translate", "--model", str(FIXTURE_MODEL), *heldout_sources[:2]]) == 0
    assert capsys.readouterr().out.splitlines() == offline[:2]


def test_translate_stdin_with_a_bad_line(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    heldout_sources: list[str],
    offline: list[str],
) -> None:
    first, second = (s.encode() for s in heldout_sources[:2])
    set_stdin(monkeypatch, first + b"\n\xff\xfe broken\n" + second + b"\n")
    assert main(["translate", "--model", str(FIXTURE_MODEL)]) == 1
    captured = capsys.readouterr()
    # The bad line gets an empty output line, so output stays aligned with input.
    assert captured.out.split("\n") == [offline[0], "", offline[1], ""]
    assert "error: line 2: invalid UTF-8" in captured.err
    assert "Traceback" not in captured.err


def test_translate_missing_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-model"
    assert main(["translate", "--model", str(missing), "hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(missing) in err
    assert "Traceback" not in err


@pytest.mark.skipif(shutil.which("nmt-incremental") is None, reason="entry point not installed")
def test_installed_entry_point(heldout_sources: list[str], offline: list[str]) -> None:
    done = subprocess.run(
        ["nmt-incremental", "translate", "--model", str(FIXTURE_MODEL)],
        input="\n".join(heldout_sources) + "\n",
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == offline


# ---------------------------------------------------------------------------------------
# replay


def test_replay_writes_updates_and_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    needs_fixture()
    log = short_log(tmp_path)
    refs = tmp_path / "refs.txt"
    refs.write_text("参考一\n参考二\n", encoding="utf-8")
    out, report = tmp_path / "updates.jsonl", tmp_path / "report.json"
    argv = ["replay", "--model", str(FIXTURE_MODEL), str(log), "--policy", "mask:2"]
    argv += ["--references", str(refs), "--out", str(out), "--report", str(report)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "normalized erasure" in captured.err and "final exact match" in captured.err

    timed = read_updates(out)
    updates = [t.update for t in timed]
    finals = [u for u in updates if u.is_final]
    assert [u.segment_id for u in finals] == [0, 1]
    assert all(t.done_ms >= t.emit_ms for t in timed)

    data = json.loads(report.read_text(encoding="utf-8"))
    assert data["final_exact_match"] == 1.0
    assert data["settings"]["policy"] == "mask-2"
    assert data["settings"]["log"] == str(log)
    assert data["counts"]["updates"] == len(updates)
    assert data["report"]["segments"] == 2
    assert data["report"]["bleu"] is not None


def test_replay_updates_to_stdout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    needs_fixture()
    log = short_log(tmp_path, segments=1)
    assert main(["replay", "--model", str(FIXTURE_MODEL), str(log), "--beam", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # Each line is the wire message plus its times on the log's clock.
    updates = [protocol.parse(re.sub(r',"emit_ms":.*}$', "}", line)) for line in lines]
    assert updates and all(isinstance(u, protocol.TranslationUpdate) for u in updates)
    assert isinstance(updates[-1], protocol.TranslationUpdate) and updates[-1].is_final


def test_realtime_report_can_be_recomputed_from_the_files(tmp_path: Path) -> None:
    """The realtime updates file carries each update's finish time on the log's clock, so
    the report's compute-aware latency can be recomputed from the log and that file."""
    from engine.evaluation.report import build_report
    from engine.replay import _traces

    needs_fixture()
    log = short_log(tmp_path)
    out, report = tmp_path / "updates.jsonl", tmp_path / "report.json"
    argv = ["replay", "--model", str(FIXTURE_MODEL), str(log), "--realtime", "--speed", "20"]
    assert main([*argv, "--out", str(out), "--report", str(report)]) == 0
    data = json.loads(report.read_text(encoding="utf-8"))["report"]
    translator = Translator.from_dir(FIXTURE_MODEL)
    again = build_report(_traces(read_log(log), read_updates(out), translator))
    assert again.laal_ms == pytest.approx(data["laal_ms"], abs=1e-6)
    assert again.yaal_ms == pytest.approx(data["yaal_ms"], abs=1e-6)


def test_replay_bad_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "bad.jsonl"
    log.write_text('{"type": "partial_transcript"}\n', encoding="utf-8")
    # The log is read before the model is loaded, so this needs no model.
    assert main(["replay", "--model", str(tmp_path / "unused"), str(log)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {log}:1: missing field")
    assert "Traceback" not in err


def test_replay_missing_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.jsonl"
    assert main(["replay", "--model", str(tmp_path), str(missing)]) == 2
    assert capsys.readouterr().err == f"error: {missing}: No such file or directory\n"
    log = tmp_path / "ok.jsonl"
    log.write_text(
        '{"type":"partial_transcript","stream_id":"s","segment_id":0,"seq":0,'
        '"text":"hi","is_final":true,"emit_ms":1}\n',
        encoding="utf-8",
    )
    assert main(["replay", "--model", str(tmp_path / "nope"), str(log)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(tmp_path / "nope") in err
    refs = tmp_path / "refs.txt"
    refs.write_text("a\nb\n", encoding="utf-8")
    assert main(["replay", "--model", str(tmp_path), str(log), "--references", str(refs)]) == 2
    assert "2 references for 1 segments" in capsys.readouterr().err


def test_replay_bad_policy(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--model", "m", "log.jsonl", "--policy", "wait-k:3"])
    assert exc.value.code == 2
    assert "unknown policy 'wait-k:3'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# logs


def test_logs_make(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("I will go home now.\nHe added that.\nThe fox jumps.\n", encoding="utf-8")
    ref.write_text("我现在回家。\n他补充说。\n狐狸跳。\n", encoding="utf-8")
    out = tmp_path / "made.jsonl"
    argv = ["logs", "make", str(src), "--lang", "en", "--out", str(out)]
    argv += ["--references", str(ref), "--limit", "2", "--seed", "3", "--stream-id", "mic-7"]
    assert main(argv) == 0
    assert "2 segments" in capsys.readouterr().err
    lines = read_log(out)
    assert {line["stream_id"] for line in lines} == {"mic-7"}
    assert [line["text"] for line in lines if line["is_final"]] == [
        "I will go home now.",
        "He added that.",
    ]
    assert (tmp_path / "made.ref.txt").read_text(encoding="utf-8") == "我现在回家。\n他补充说。\n"
    again = tmp_path / "again.jsonl"
    argv[argv.index(str(out))] = str(again)
    assert main(argv) == 0
    assert again.read_bytes() == out.read_bytes()  # deterministic for a seed


def test_logs_make_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.jsonl"
    assert main(["logs", "make", str(tmp_path / "none.txt"), "--lang", "en", "--out", str(out)])
    assert "none.txt: No such file or directory" in capsys.readouterr().err
    src = tmp_path / "src.txt"
    src.write_text("one\n\nthree\n", encoding="utf-8")
    assert main(["logs", "make", str(src), "--lang", "en", "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"error: {src}:2: empty source line\n"
    with pytest.raises(SystemExit):
        main(["logs", "make", str(src), "--lang", "fr", "--out", str(out)])


def test_logs_merge(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src.txt"
    src.write_text("I will go home now.\nHe added that.\n", encoding="utf-8")
    a, b, merged = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "ab.jsonl"
    assert (
        main(["logs", "make", str(src), "--lang", "en", "--out", str(a), "--stream-id", "a"]) == 0
    )
    argv = ["logs", "make", str(src), "--lang", "en", "--out", str(b), "--stream-id", "b"]
    assert main([*argv, "--seed", "1"]) == 0
    assert main(["logs", "merge", str(a), str(b), "--out", str(merged)]) == 0
    lines = read_log(merged)
    assert len(lines) == len(read_log(a)) + len(read_log(b))
    assert [x["emit_ms"] for x in lines] == sorted(x["emit_ms"] for x in lines)
    capsys.readouterr()
    assert main(["logs", "merge", str(a), str(a), "--out", str(merged)]) == 2
    [line] = capsys.readouterr().err.splitlines()  # one line, naming the way out
    assert line.startswith(f"error: stream 'a' is in both {a} and {a}: ")
    assert line.endswith("(make one again with `nmt-incremental logs make ... --stream-id OTHER`)")


def test_serve_says_where_it_is_and_when_it_is_ready_then_stops_on_sigterm() -> None:
    """A user who runs `serve` sees the subtitle page and WebSocket URLs, the model and
    "ready" (the URLs are real: /readyz answers 200 there), and after SIGTERM a summary and
    "stopped", exit status 0."""
    import re
    import signal
    import urllib.request

    needs_fixture()
    with serving(["--model", str(FIXTURE_MODEL)], ready_within=60) as served:
        text = served.text
        page = re.search(r"subtitle page: (http://127\.0\.0\.1:(\d+)/)\?stream=demo", text)
        assert page, text
        assert f"websocket: ws://127.0.0.1:{page.group(2)}/ws" in text
        assert re.search(r"model: .*fixture/model \(en->zh, split decoder: ", text), text
        with urllib.request.urlopen(page.group(1) + "readyz", timeout=10) as response:
            assert response.status == 200
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(timeout=30) == 0
        served.reader.join(10)
        last = served.lines[-1]
        assert last.endswith("stopped") and "delivered 0 updates" in last, served.lines
