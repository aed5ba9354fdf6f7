"""`replay` on a terminal: a view a person can read instead of hundreds of JSON lines.

With stdout a terminal and no `--out`, `replay` draws `LiveView` (each stream's stable
text and tentative tail told apart, finals as lines, a count) and then the metrics table;
into a file or a pipe the JSON Lines are exactly what they were. Checked three ways: the
view fed updates by hand and its escape codes played on a small screen model (what a
person ends up seeing), the command in this process with the terminal check forced, and
the real command on a pseudo-terminal (`pty`), where it decides by itself.
"""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

from engine.cli.main import build_parser
from engine.cli.replay import LiveView, clip_left, clip_right, display_width, run_replay
from engine.logs.updates import TimedUpdate
from protocol import TranslationUpdate
from tests.conftest import FIXTURE_MODEL, ROOT, needs_fixture

TWO_STREAMS = ROOT / "examples" / "logs" / "fixture_two_streams.jsonl"
ESCAPE = re.compile(r"\x1b\[(\d*)([A-Za-z])")


def screen(raw: str, width: int = 80) -> list[str]:
    """The rows a terminal shows after `raw`: printing (a row `width` columns wide: longer
    text goes on in the next row), \\r, \\n (as a tty's ONLCR does it), cursor up (A),
    erase to the end of the line (K) and the whole line (2K); colours (m) are dropped. Wide
    characters take two columns, as in a terminal."""
    lines: list[list[str]] = [[]]
    row = col = 0
    i = 0
    while i < len(raw):
        match = ESCAPE.match(raw, i)
        if match:
            count, code = match.groups()
            if code == "A":
                row = max(0, row - int(count or 1))
            elif code == "K":
                line = lines[row]
                lines[row] = [] if count == "2" else line[:col]
            i = match.end()
            continue
        ch = raw[i]
        i += 1
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row, col = row + 1, 0
            while len(lines) <= row:
                lines.append([])
        else:
            if display_width("".join(lines[row][:col])) + display_width(ch) > width:
                row, col = row + 1, 0  # the terminal wraps
                while len(lines) <= row:
                    lines.append([])
            line = lines[row]
            line[col : col + 1] = [ch]
            col += 1
            for _ in range(display_width(ch) - 1):  # the second column of a wide character
                line[col : col + 1] = [""]
                col += 1
    while lines and not lines[-1]:
        lines.pop()
    return ["".join(line).rstrip() for line in lines]


def timed(
    segment: int,
    stable: str,
    tentative: str = "",
    *,
    final: bool = False,
    source: str = "",
    stream: str = "s1",
    seq: int = 0,
    done_ms: float = 0.0,
    revised: bool = False,
    lang: str = "zh",
) -> TimedUpdate:
    update = TranslationUpdate(
        stream_id=stream,
        segment_id=segment,
        seq=seq,
        stable_text=stable,
        unstable_text=tentative,
        is_final=final,
        latency_ms=1.0,
        compute_ms=1.0,
        revised=revised,
        source_text=source,
        lang=lang,
    )
    return TimedUpdate(update, emit_ms=done_ms, done_ms=done_ms)


def view(out: io.StringIO, **options: object) -> LiveView:
    settings: dict[str, object] = {
        "segments": 2,
        "streams": ["s1"],
        "log_span_ms": 4000.0,
        "width": 60,
        "interval": 0.0,
    }
    settings.update(options)
    return LiveView(out, **settings)  # type: ignore[arg-type]


def test_stable_and_tentative_are_told_apart_and_the_stream_line_is_redrawn() -> None:
    out = io.StringIO()
    live = view(out)
    live.update(timed(0, "汤姆", "画", source="Does Tom draw", done_ms=500))
    frame = out.getvalue()
    assert "汤姆\x1b[2m画\x1b[0m" in frame  # the tentative tail dimmed, the stable text not
    assert screen(frame, 60) == [
        "#0  汤姆画",
        "    Does Tom draw",
        "1 updates · 0/2 finals · log 0.5 s of 4.0 s",
    ]
    live.update(timed(0, "汤姆画马吗", final=True, source="Does Tom draw a horse", seq=1))
    live.update(timed(1, "", "露西", source="Lucy", seq=2, done_ms=2500))
    assert screen(out.getvalue(), 60) == [
        "#0  汤姆画马吗  ← Does Tom draw a horse",  # the final stays, as a line
        "#1  露西",
        "    Lucy",
        "3 updates · 1/2 finals · log 2.5 s of 4.0 s",
    ]
    live.update(timed(1, "露西想见杰克", final=True, source="Lucy wants to meet Jack", seq=3))
    live.close()
    assert screen(out.getvalue(), 60) == [
        "#0  汤姆画马吗  ← Does Tom draw a horse",
        "#1  露西想见杰克  ← Lucy wants to meet Jack",
        "4 updates · 2/2 finals · log 2.5 s of 4.0 s",
    ]


def test_streams_get_a_line_each_and_a_revised_final_says_so() -> None:
    out = io.StringIO()
    live = view(out, streams=["left", "right"])
    live.update(timed(0, "凯特", source="Kate", stream="left"))
    live.update(timed(0, "他", "要", source="He will", stream="right"))
    assert screen(out.getvalue(), 60)[:4] == [
        "left  #0  凯特",
        "          Kate",
        "right #0  他要",
        "          He will",
    ]
    live.update(timed(0, "她", final=True, source="She", stream="right", seq=1, revised=True))
    live.close()
    assert "right #0  她 (revised what was shown)  ← She" in screen(out.getvalue(), 60)


def test_long_lines_keep_their_end_within_the_width() -> None:
    """The newest words are the ones to show; wide characters count two columns, so a
    Chinese line cut by characters would wrap and break the redraw."""
    text = "我" * 50 + "三点"
    clipped = clip_left(text, 30)
    assert clipped.startswith("…") and clipped.endswith("三点") and display_width(clipped) <= 30
    assert clip_left("short", 30) == clip_right("short", 30) == "short"
    assert clip_right("三点" * 10, 7) == "三点三…"
    out = io.StringIO()
    live = view(out, width=30)
    live.update(timed(0, text[:40], text[40:], source="word " * 20))
    rows = screen(out.getvalue(), 30)
    assert rows[0].startswith("#0  …") and rows[0].endswith("三点")  # in one row, not wrapped
    assert rows[1].startswith("    …") and rows[1].endswith("word")
    assert rows[2].startswith("1 updates") and rows[2].endswith("…")


def test_words_of_a_language_with_spaces_are_not_glued() -> None:
    """The protocol's stable text and tentative tail carry no space between them: German
    needs one (Chinese none, above)."""
    out = io.StringIO()
    live = view(out)
    update = timed(0, "Ich werde", "Tom treffen", source="i will meet tom", lang="de")
    live.update(update)
    assert screen(out.getvalue(), 60)[0] == "#0  Ich werde Tom treffen"
    plain = io.StringIO()
    live = view(plain, color=False)
    live.update(update)
    assert screen(plain.getvalue(), 60)[0] == "#0  Ich werde [Tom treffen]"


def test_without_colour_the_tentative_tail_is_bracketed() -> None:
    out = io.StringIO()
    live = view(out, color=False)
    live.update(timed(0, "汤姆", "画", source="Does Tom draw"))
    assert "\x1b[2m" not in out.getvalue() and "\x1b[1m" not in out.getvalue()
    assert screen(out.getvalue(), 60)[0] == "#0  汤姆[画]"


def test_a_dumb_terminal_gets_the_finals_and_the_count_only() -> None:
    out = io.StringIO()
    live = view(out, ansi=False)
    live.update(timed(0, "汤姆", "画", source="Does Tom draw"))
    live.update(timed(0, "汤姆画马吗", final=True, source="Does Tom draw a horse", seq=1))
    live.close()
    assert "\x1b" not in out.getvalue()
    assert out.getvalue().splitlines() == [
        "#0  汤姆画马吗  ← Does Tom draw a horse",
        "2 updates · 1/2 finals · log 0.0 s of 4.0 s",
    ]


def test_for_terminal_reads_the_log_and_the_environment() -> None:
    lines = [
        {"stream_id": "a", "segment_id": 0, "emit_ms": 1000.0},
        {"stream_id": "bb", "segment_id": 0, "emit_ms": 1500.0},
        {"stream_id": "bb", "segment_id": 1, "emit_ms": 4000.0},
    ]
    live = LiveView.for_terminal(io.StringIO(), lines, {"COLUMNS": "77", "NO_COLOR": "1"})
    assert (live.segments, live.several, live.id_width, live.width) == (3, True, 2, 77)
    assert (live.log_span_ms, live.log_start_ms, live.color, live.ansi) == (3000, 1000, False, True)
    dumb = LiveView.for_terminal(io.StringIO(), lines, {"TERM": "dumb"})
    assert not dumb.ansi and not dumb.color
    # segment numbers up to #10 pad #9 so that the texts after them line up
    out = io.StringIO()
    many = LiveView.for_terminal(out, [*lines, {**lines[0], "segment_id": 10}], {"COLUMNS": "60"})
    many.update(timed(9, "汤姆", final=True, stream="a"))
    many.update(timed(10, "露西", final=True, stream="bb", seq=1))
    many.close()
    assert screen(out.getvalue(), 60)[:2] == ["a  #9   汤姆", "bb #10  露西"]


# -- the command --------------------------------------------------------------------------


def replay_args(*extra: str) -> list[str]:
    return ["replay", "--model", str(FIXTURE_MODEL), str(TWO_STREAMS), *extra]


def test_a_terminal_gets_the_view_and_a_file_or_pipe_the_json_lines(tmp_path: Path) -> None:
    needs_fixture()
    parser = build_parser()
    shown, table = io.StringIO(), io.StringIO()
    assert run_replay(parser.parse_args(replay_args()), shown, table, terminal=True) == 0
    rows = screen(shown.getvalue(), 200)
    assert not any('"translation_update"' in row for row in rows)
    finals = [row for row in rows if "←" in row]
    assert len(finals) == 6 and rows[-1].startswith("59 updates · 6/6 finals")
    assert "left  #0  凯特明天晚上想在花园给弗兰克打电话" in finals[1]
    assert "final exact match" in table.getvalue()

    piped = io.StringIO()
    assert run_replay(parser.parse_args(replay_args()), piped, io.StringIO(), terminal=False) == 0
    updates = [json.loads(line) for line in piped.getvalue().splitlines()]
    assert len(updates) == 59 and {u["type"] for u in updates} == {"translation_update"}
    assert sum(u["is_final"] for u in updates) == 6
    assert {u["stable_text"] for u in updates if u["is_final"]} == {
        row.split("  ")[-2].strip() for row in finals
    }

    # --out takes the JSON Lines even on a terminal, and the terminal stays as it was
    to_file, out_path = io.StringIO(), tmp_path / "updates.jsonl"
    args = parser.parse_args(replay_args("--out", str(out_path)))
    assert run_replay(args, to_file, io.StringIO(), terminal=True) == 0
    assert to_file.getvalue() == ""
    assert out_path.read_text("utf-8").count("\n") == 59


def run_on_pty(argv: list[str], columns: int = 100) -> tuple[str, str, int]:
    """`python -m engine.cli ARGV` with stdout on a pseudo-terminal (stderr a pipe): what
    the terminal received, stderr, the exit status."""
    leader, follower = pty.openpty()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": str(columns), "TERM": "xterm"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", *argv],
        stdout=follower,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=env,
    )
    os.close(follower)
    received = bytearray()
    while True:
        ready, _, _ = select.select([leader], [], [], 120)
        if not ready:
            proc.kill()
            raise AssertionError("no output for 120 s")
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the follower side closed: the process is done writing
            break
        if not chunk:
            break
        received += chunk
    os.close(leader)
    assert proc.stderr is not None
    err = proc.stderr.read().decode()
    return received.decode(), err, proc.wait(timeout=60)


def test_the_command_draws_the_view_on_a_real_terminal() -> None:
    needs_fixture()
    raw, err, status = run_on_pty(replay_args("--realtime", "--speed", "20"))
    assert status == 0, err
    text = raw.replace("\r\n", "\n")
    assert '"translation_update"' not in text
    # live: the stream lines were drawn and redrawn during the run, partials included
    assert len(re.findall(r"\x1b\[\d+A", text)) >= 3
    heard = re.findall(r"\n {10}\x1b\[2m([^\x1b]+)\x1b\[0m", text)  # under a stream line
    assert heard and not set(heard) <= {"Kate"}, heard
    rows = screen(text, 100)
    assert len([row for row in rows if "←" in row]) == 6  # a long final may take two rows
    assert rows[-1].startswith("59 updates · 6/6 finals · log 11.7 s of 11.7 s")
    assert "final exact match" in err  # the table, after the view
