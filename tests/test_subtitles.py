"""Subtitle files from finals: the layout rule (line length, lines per cue, reading speed,
no overlap) and files that independent parsers (srt, webvtt-py) read back as written."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import anyio
import pytest

from engine.cli.main import main
from engine.logs import read_log
from engine.subtitles import Cue, CueRules, Final, layout, wrap, write
from tests.conftest import FIXTURE_MODEL, ROOT, needs_fixture

LOG = ROOT / "examples" / "logs" / "fixture_two_streams.jsonl"


def test_wrap_breaks_latin_at_spaces_and_chinese_after_punctuation() -> None:
    lines = wrap("the quick brown fox jumps over the lazy dog again and again", 20)
    assert lines == ["the quick brown fox", "jumps over the lazy", "dog again and again"]
    assert all(len(line) <= 20 for line in lines)
    assert wrap("supercalifragilistic word", 10) == ["supercalifragilistic", "word"]
    zh = "我们今天下午三点，在图书馆见面吧。然后一起去吃饭"
    lines = wrap(zh, 10)
    assert lines[0] == "我们今天下午三点，"  # the comma is near the limit: break after it
    assert "".join(lines) == zh and all(len(line) <= 10 for line in lines)


def check_cues(cues: list[Cue], rules: CueRules, finals: list[Final]) -> None:
    for a, b in pairwise(cues):
        assert a.end_ms <= b.start_ms, (a, b)  # no overlap
    for cue in cues:
        assert 1 <= len(cue.lines) <= rules.max_lines
        assert cue.end_ms - cue.start_ms <= rules.max_duration_ms
        max_chars, _ = rules.for_text(cue.text)
        assert all(len(line) <= max_chars for line in cue.lines)
    starts = {cue.start_ms for cue in cues}
    assert all(round(f.start_ms) in starts for f in finals)  # each final starts on time


def test_long_finals_become_several_cues_in_their_speech_span() -> None:
    text = "我们今天下午三点在图书馆见面然后一起去吃饭再去看一场电影最后坐火车回家休息"
    finals = [Final(1000, 9000, text), Final(9400, 10000, "好的"), Final(20000, 20500, "再见")]
    rules = CueRules()
    cues = layout(finals, rules)
    check_cues(cues, rules, finals)
    first = [c for c in cues if 1000 <= c.start_ms < 9000]
    assert len(first) == 2 and "".join(c.text.replace("\n", "") for c in first) == text
    assert first[1].start_ms < 9000 and first[1].end_ms <= 9400 - rules.gap_ms
    # "好的" is spoken in 0.6 s but held for the minimum duration; "再见" too, then nothing
    short = next(c for c in cues if c.text == "好的")
    assert short.end_ms - short.start_ms == pytest.approx(rules.min_duration_ms, abs=1)
    # Reading speed: a long Latin sentence in a short span runs into the following silence.
    latin = "I will meet Tom at three in the library with my friend from school"
    cue = layout([Final(0, 1000, latin)], rules)
    shown = sum(len(line) for line in cue[0].lines)
    assert len(cue) == 1 and cue[0].end_ms >= shown / 17 * 1000 - 1 > 1000


def test_replay_writes_files_that_independent_parsers_read(tmp_path: Path) -> None:
    srt = pytest.importorskip("srt")
    webvtt = pytest.importorskip("webvtt")
    needs_fixture()
    out = tmp_path / "subs.vtt"
    argv = ["replay", "--model", str(FIXTURE_MODEL), str(LOG), "--out", str(tmp_path / "u")]
    assert main([*argv, "--vtt", str(out), "--srt", str(tmp_path / "subs.srt")]) == 0
    lines = read_log(LOG)
    for stream in ("left", "right"):
        finals = [line for line in lines if line["is_final"] and line["stream_id"] == stream]
        vtt = list(webvtt.read(str(tmp_path / f"subs.{stream}.vtt")))
        with open(tmp_path / f"subs.{stream}.srt", encoding="utf-8") as f:
            subs = list(srt.parse(f.read()))
        assert len(vtt) == len(subs) == len(finals)  # the fixture's finals fit one cue each
        for final, v, s in zip(finals, vtt, subs, strict=True):
            assert round(s.start.total_seconds() * 1000) == round(final["start_ms"])
            assert v.start_time.in_milliseconds() == round(final["start_ms"])
            assert s.content == v.text and s.content  # a translation, the same in both
            assert s.end > s.start


def test_unknown_format_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vtt or srt"):
        write(tmp_path / "subs.txt", [])


@pytest.mark.anyio
async def test_serve_records_each_streams_finals_as_they_arrive(tmp_path: Path) -> None:
    import json

    import anyio
    from websockets.asyncio.client import connect

    from engine.decoding.translator import Translator
    from engine.server.recorder import record
    from tests.test_server import serving, ws_url

    webvtt = pytest.importorskip("webvtt")
    needs_fixture()
    translator = Translator.from_dir(FIXTURE_MODEL)
    spans = [(1200.0, 2900.0), (3500.0, 5100.0)]
    async with serving(translator) as server, anyio.create_task_group() as tg:
        assert server.engine is not None
        tg.start_soon(record, server.engine, tmp_path / "rec", "vtt")
        await anyio.sleep(0.05)
        async with connect(ws_url(server)) as ws:
            for segment, (start, end) in enumerate(spans):
                await ws.send(
                    json.dumps(
                        {
                            "type": "partial_transcript",
                            "stream_id": "talk/1",  # not a safe file name as it is
                            "segment_id": segment,
                            "seq": segment,
                            "text": "Tom reads a book" if segment else "I will meet Tom",
                            "is_final": True,
                            "start_ms": start,
                            "end_ms": end,
                        }
                    )
                )
                with anyio.fail_after(20):
                    while not json.loads(await ws.recv()).get("is_final"):
                        pass
                path = tmp_path / "rec" / "talk%2F1.1.vtt"
                with anyio.fail_after(5):  # written as the final arrives, not at the end
                    while not path.exists() or len(list(webvtt.read(str(path)))) < segment + 1:
                        await anyio.sleep(0.01)
        await server.engine.aclose()
    cues = list(webvtt.read(str(path)))
    assert [c.start_time.in_milliseconds() for c in cues] == [1200, 3500]
    assert all(c.text for c in cues)


def test_the_recorder_forgets_stream_lives_that_ended(tmp_path: Path) -> None:
    """A server that runs for weeks must not hold the finals of every stream it ever
    recorded: a life's track goes when the same id's next life speaks (at once), or in a
    periodic sweep once the engine no longer has that life and it was quiet GRACE_S."""
    from engine.server.recorder import GRACE_S, _Track, forget_ended
    from protocol import TranslationUpdate

    class Engine:
        def __init__(self) -> None:
            self.open = {"a": 2, "b": 1}

        def epoch_of(self, stream_id: str) -> int | None:
            return self.open.get(stream_id)

    def update(stream_id: str, epoch: int) -> TranslationUpdate:
        return TranslationUpdate(stream_id, 0, 1, "x", "", True, 1.0, 1.0, epoch=epoch)

    tracks = {
        ("a", 1, None): _Track(tmp_path / "a1", 0.0, last_seen=0.0),
        ("a", 2, None): _Track(tmp_path / "a2", 0.0, last_seen=0.0),
        ("b", 1, None): _Track(tmp_path / "b1", 0.0, last_seen=0.0),
        ("c", 1, None): _Track(tmp_path / "c1", 0.0, last_seen=0.0),  # closed: not open
        ("d", 1, None): _Track(tmp_path / "d1", 0.0, last_seen=100.0),  # closed, recent
    }
    engine = Engine()
    assert forget_ended(engine, tracks, update("a", 2), False, 1.0) == 1  # a's first life
    assert set(tracks) == {("a", 2, None), ("b", 1, None), ("c", 1, None), ("d", 1, None)}
    now = 100.0 + GRACE_S / 2
    assert forget_ended(engine, tracks, update("b", 1), True, now) == 1  # c, long quiet
    assert set(tracks) == {("a", 2, None), ("b", 1, None), ("d", 1, None)}
    assert forget_ended(engine, tracks, update("b", 1), True, 100.0 + GRACE_S + 1) == 1
    assert set(tracks) == {("a", 2, None), ("b", 1, None)}  # the open lives stay


@pytest.mark.anyio
async def test_a_reopened_stream_gets_its_own_file_and_the_old_one_stays(tmp_path: Path) -> None:
    from engine.server.recorder import record
    from engine.streaming import IncrementalTranslator
    from protocol import PartialTranscript

    needs_fixture()
    async with (
        IncrementalTranslator.from_dir(FIXTURE_MODEL) as nmt,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(record, nmt, tmp_path, "srt")
        await anyio.sleep(0.05)
        for text in ("I will meet Tom", "Tom reads a book"):
            await nmt.push(PartialTranscript("talk", 0, 0, text, True, 0.0, 1500.0))
            await nmt.close_stream("talk")
            await nmt.wait_idle()
            assert nmt.epoch_of("talk") is None
        await nmt.aclose()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["talk.1.srt", "talk.2.srt"]
    tr = nmt.translator
    assert tr.translate(["I will meet Tom"])[0].text in (tmp_path / files[0]).read_text("utf-8")
    assert tr.translate(["Tom reads a book"])[0].text in (tmp_path / files[1]).read_text("utf-8")
