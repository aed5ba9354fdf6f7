"""`serve --record DIR`: finals written to subtitle files as they arrive: off the event
loop and a final at a time, never over an earlier run's files, under bounded names, a
failure logged once and caught up, a bad directory refused before serving, times of 100 h
and more kept, no temporary file left on a full disk, and files valid whenever the process
dies.

Most tests drive `record` with `FakeEngine` (what `record` reads of an engine, without a
model); the ones through a real server use the fixture model."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from engine import subtitles
from engine.server import recorder as recorder_module
from engine.server.recorder import GRACE_S, Key, _Track, forget_ended, record
from engine.streaming.subscriptions import Subscription
from protocol import TranslationUpdate
from tests.conftest import FIXTURE_MODEL, ROOT, needs_fixture, serving

webvtt = pytest.importorskip("webvtt")
srt = pytest.importorskip("srt")


class FakeEngine:
    """What `record` reads of an `IncrementalTranslator`: its languages, a subscription to
    every stream and `epoch_of`. `say` publishes, `end` closes."""

    def __init__(self, languages: tuple[str, ...] = ("zh",)) -> None:
        self.languages = list(languages)
        self.sub = Subscription(None, 10**7)
        self.open: dict[str, int] = {}

    def updates(self, stream_id: str | None = None) -> Subscription:
        return self.sub

    def epoch_of(self, stream_id: str) -> int | None:
        return self.open.get(stream_id)

    def say(self, *updates: TranslationUpdate) -> None:
        for update in updates:
            self.open[update.stream_id] = update.epoch or 0
            self.sub.put(update)

    def end(self) -> None:
        self.sub.end()


def final(
    stream: str,
    segment: int,
    text: str,
    start: float | None = None,
    end: float | None = None,
    epoch: int = 1,
) -> TranslationUpdate:
    return TranslationUpdate(
        stream, segment, segment, text, "", True, 1.0, 1.0, epoch=epoch, start_ms=start, end_ms=end
    )


def sentence(i: int) -> str:
    """Finals of varied length: one line, two, and (every 7th) two cues."""
    return f"final number {i} " + "and some more words " * (i % 3) + "long " * 20 * (i % 7 == 6)


async def recording(
    directory: Path,
    feed: Callable[[FakeEngine], Awaitable[None]],
    kind: str = "vtt",
    **kwargs: Any,
) -> int:
    """Run `record` on a `FakeEngine` while `feed` speaks; returns `record`'s result."""
    engine = FakeEngine()
    result = 0

    async def run() -> None:
        nonlocal result
        result = await record(engine, directory, kind, **kwargs)  # type: ignore[arg-type]

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await feed(engine)
        engine.end()
    return result


def cues_in(path: Path) -> int:
    return path.read_bytes().count(b" --> ") if path.exists() else 0


async def until(condition: Callable[[], bool], within: float = 20.0) -> None:
    with anyio.fail_after(within):
        while not condition():
            await anyio.sleep(0.005)


async def until_cues(path: Path, count: int, within: float = 20.0) -> None:
    """Until `path` holds `count` cues."""
    with anyio.fail_after(within):
        while cues_in(path) < count:
            await anyio.sleep(0.005)


def only_file(directory: Path, pattern: str = "*.vtt") -> Path:
    (path,) = directory.glob(pattern)
    return path


# --- off the event loop, a final at a time ------------------------------------------------


_opened: list[tuple[str, int]] = []
_watch: list[str] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    path = args[0] if event == "open" and _watch else None
    if isinstance(path, (str, os.PathLike)) and str(path).startswith(_watch[0]):
        _opened.append((str(path), threading.get_ident()))


_audit_added = False


@pytest.fixture
def opened_files(tmp_path: Path) -> Iterator[list[tuple[str, int]]]:
    """Every file opened under `tmp_path` during the test, with the opening thread (an
    audit hook: it sees any way of opening, whatever the recorder calls)."""
    global _audit_added
    if not _audit_added:
        sys.addaudithook(_audit)
        _audit_added = True
    _opened.clear()
    _watch[:] = [str(tmp_path)]
    yield _opened
    _watch.clear()


@pytest.mark.anyio
async def test_finals_are_written_off_the_event_loop(
    tmp_path: Path, opened_files: list[tuple[str, int]]
) -> None:
    """No file is opened on the event loop: a write there would hold every stream's
    updates while it lasts."""
    loop_thread = threading.get_ident()

    async def feed(engine: FakeEngine) -> None:
        for i in range(30):
            engine.say(final("demo", i, sentence(i), i * 2000.0, i * 2000.0 + 1500))
            await anyio.sleep(0)

    await recording(tmp_path, feed)
    opened = list(opened_files)  # before the test reads the file itself
    assert opened, "the recorder opened no file at all?"
    assert all(thread != loop_thread for _, thread in opened), opened
    assert cues_in(only_file(tmp_path)) >= 30


def written_bytes() -> int:
    """Bytes this process has written (all threads), from /proc/self/io."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


@pytest.mark.anyio
async def test_a_final_costs_the_same_however_many_came_before(tmp_path: Path) -> None:
    """A final appends (the previous final's cues rewritten in place) rather than rewriting
    the whole file, so a long run does not slow down: the bytes written for the last 50 of
    400 finals are those of the first 50."""
    if not Path("/proc/self/io").is_file():
        pytest.skip("needs /proc/self/io (Linux)")
    path = tmp_path / "none"
    counts: list[int] = []

    async def feed(engine: FakeEngine) -> None:
        nonlocal path
        said = 0
        for batch in (50, 300, 50):
            before = written_bytes()
            for _ in range(batch):
                engine.say(final("demo", said, sentence(said), said * 2000.0, said * 2000.0 + 1500))
                said += 1
            if said == 50:
                await until(lambda: any(tmp_path.glob("*.vtt")))
                path = only_file(tmp_path)
            expected = said + said // 7  # every 7th final has two cues
            await until_cues(path, expected)
            counts.append(written_bytes() - before)

    await recording(tmp_path, feed)
    first, _, last = counts
    assert last < 1.5 * first, counts


# --- the layout: what subtitles.write writes ----------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["vtt", "srt"])
async def test_a_file_written_a_final_at_a_time_is_what_layout_writes(
    tmp_path: Path, kind: str
) -> None:
    """For finals in time order, the file grown a final at a time is byte for byte the
    file `subtitles.write` makes of all of them at once (the last cue of a final ends where
    the next final lets it, empty finals give no cue, long finals several)."""
    rng = random.Random(7)
    finals: list[subtitles.Final] = []
    at = 0.0
    for i in range(60):
        at += rng.choice([300.0, 900.0, 2500.0, 9000.0])
        text = rng.choice(["", "好的", "我们今天下午三点在图书馆见面然后一起去吃饭", sentence(i)])
        finals.append(subtitles.Final(at, at + rng.choice([200.0, 1500.0]), text))
        at += 1500.0

    async def feed(engine: FakeEngine) -> None:
        for i, f in enumerate(finals):
            engine.say(final("demo", i, f.text, f.start_ms, f.end_ms))
            if i % 5 == 0:
                await anyio.sleep(0.01)  # some finals written alone, some several at once

    await recording(tmp_path / "rec", feed, kind)
    expected = subtitles.write(tmp_path / f"all.{kind}", subtitles.layout(finals), kind)
    got = only_file(tmp_path / "rec", f"*.{kind}")
    assert got.read_bytes() == expected.read_bytes()


# --- files valid whenever the process dies ------------------------------------------------

CHILD = r"""
import json, logging, os, resource, signal, sys
import anyio
from engine.server import recorder
from engine.server.recorder import record
from engine.streaming.subscriptions import Subscription
from protocol import TranslationUpdate

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
failed = __import__("threading").Event()
class Failed(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.ERROR:
            failed.set()
logging.getLogger().addHandler(Failed())
mode, directory, arg = sys.argv[1], sys.argv[2], int(sys.argv[3])
recorder.RETRY_S = 0.0

class Engine:
    languages = ["zh"]
    def __init__(self):
        self.sub = Subscription(None, 10**7)
    def updates(self, stream_id=None):
        return self.sub
    def epoch_of(self, stream_id):
        return 1

def final(stream, i):
    text = f"final {i} of {stream} " + "word " * (i % 9) + "long " * 20 * (i % 7 == 6)
    return TranslationUpdate(stream, i, i, text, "", True, 1.0, 1.0, epoch=1,
                             start_ms=i * 2000.0, end_ms=i * 2000.0 + 1500.0)

async def main():
    engine = Engine()
    async with anyio.create_task_group() as tg:
        tg.start_soon(record, engine, __import__("pathlib").Path(directory), "vtt")
        if mode == "forever":  # until killed
            i = 0
            while True:
                for stream in ("a", "b/c", "d"):
                    engine.sub.put(final(stream, i))
                i += 1
                if i == 3:
                    print("started", flush=True)
                await anyio.sleep(0.0005)
        # "full": writes of more than `arg` bytes fail (a full disk), then room again
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (arg, hard))
        for i in range(20):
            engine.sub.put(final("demo", i))
            await anyio.sleep(0.02)
        assert await anyio.to_thread.run_sync(failed.wait, 30)  # the writer has failed
        await anyio.sleep(0.2)
        names = sorted(os.listdir(directory))
        contents = {n: open(os.path.join(directory, n), encoding="utf-8").read() for n in names}
        print(json.dumps({"names": names, "contents": contents}), flush=True)
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        for i in range(20, 25):
            engine.sub.put(final("demo", i))
        engine.sub.end()

anyio.run(main)
"""


def child(mode: str, directory: Path, arg: int = 0) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, str(directory), str(arg)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def child_text(stream: str, i: int) -> str:
    return f"final {i} of {stream} " + "word " * (i % 9) + "long " * 20 * (i % 7 == 6)


def check_file(path: Path, stream: str) -> int:
    """`path` parses as WebVTT, its cues numbered 1.. in time order, its text the first
    finals of `stream` in order; returns how many finals it holds."""
    text = path.read_text(encoding="utf-8")
    assert text.startswith("WEBVTT\n\n") and (text.endswith("\n\n") or text == "WEBVTT\n\n")
    cues = list(webvtt.from_string(text))
    numbers = [int(block.split("\n", 1)[0]) for block in text[8:].split("\n\n") if block]
    assert numbers == list(range(1, len(cues) + 1))
    starts = [cue.start_in_seconds for cue in cues]
    assert starts == sorted(starts)
    said = " ".join(" ".join(cue.text.split()) for cue in cues)
    n = 0
    expected = ""
    while len(expected) < len(said):
        expected = (expected + " " + " ".join(child_text(stream, n).split())).strip()
        n += 1
    assert said == expected
    return n


def test_files_are_valid_whenever_the_process_is_killed(tmp_path: Path) -> None:
    """The guarantee of the whole-file rewrite kept by appending: a SIGKILL at any moment
    leaves every file valid, holding the first finals in order, and no temporary file."""
    held = []
    for run in range(6):
        directory = tmp_path / str(run)
        proc = child("forever", directory)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "started", proc.stderr
        threading.Event().wait(random.uniform(0.05, 0.6))
        proc.kill()
        proc.communicate()
        names = sorted(p.name for p in directory.iterdir())
        assert not [n for n in names if n.endswith(".tmp")], names
        streams = {urllib.parse.unquote(n.split(".")[0]): directory / n for n in names}
        assert set(streams) == {"a", "b/c", "d"}, names
        held += [check_file(path, stream) for stream, path in streams.items()]
    assert max(held) > 10  # killed mid-stream, not before the first write


def test_sigterm_to_serve_leaves_every_answered_final_in_the_file(tmp_path: Path) -> None:
    """`serve --record`: the finals answered before SIGTERM are all in the file after the
    graceful stop (the writer thread finishes its queue before the process exits)."""
    from websockets.sync.client import connect

    needs_fixture()
    rec = tmp_path / "rec"
    texts = ["I will meet Tom", "Tom reads a book", "the cat sleeps"] * 4
    with serving(["--model", str(FIXTURE_MODEL), "--record", str(rec)], 60) as served:
        port = re.search(r"ws://127\.0\.0\.1:(\d+)/ws", served.text)
        assert port, served.text
        with connect(f"ws://127.0.0.1:{port.group(1)}/ws") as ws:
            for segment, text in enumerate(texts):
                message = {
                    "type": "partial_transcript",
                    "stream_id": "demo",
                    "segment_id": segment,
                    "seq": segment,
                    "text": text,
                    "is_final": True,
                    "start_ms": segment * 2000.0,
                    "end_ms": segment * 2000.0 + 1500.0,
                }
                ws.send(json.dumps(message))
            finals = 0
            while finals < len(texts):
                reply = json.loads(ws.recv(timeout=30))
                assert reply["type"] == "translation_update", reply
                finals += reply["is_final"]
            served.proc.send_signal(signal.SIGTERM)
            assert served.proc.wait(timeout=30) == 0
    (path,) = rec.iterdir()
    assert re.fullmatch(r"demo\.\d{8}T\d{6}Z\.1\.vtt", path.name), path.name
    cues = list(webvtt.read(str(path)))
    assert [c.start_time.in_milliseconds() for c in cues] == [i * 2000 for i in range(12)]


# --- a restart never overwrites -----------------------------------------------------------


@pytest.mark.anyio
async def test_a_restart_never_writes_over_the_last_runs_files(tmp_path: Path) -> None:
    """Epochs start at 1 in every run, so names carry the run and a name taken gets `-2`:
    run two's `demo.1.vtt` never replaces run one's."""

    def speaking(text: str) -> Callable[[FakeEngine], Awaitable[None]]:
        async def feed(engine: FakeEngine) -> None:
            engine.say(final("demo", 0, text, 0.0, 1500.0))

        return feed

    await recording(tmp_path, speaking("the first run"))
    await recording(tmp_path, speaking("the second run"))  # most often in the same second
    files = sorted(tmp_path.iterdir())
    assert len(files) == 2, files
    said = sorted(path.read_text(encoding="utf-8").split("\n")[-3] for path in files)
    assert said == ["the first run", "the second run"]
    # Two runs with one stamp (a restart loop within a second): the second gets `-2`.
    await recording(tmp_path / "same", speaking("one"), run="20261124T101503Z")
    await recording(tmp_path / "same", speaking("two"), run="20261124T101503Z")
    names = sorted(p.name for p in (tmp_path / "same").iterdir())
    assert names == ["demo.20261124T101503Z-2.1.vtt", "demo.20261124T101503Z.1.vtt"]
    assert "two" in (tmp_path / "same" / names[0]).read_text(encoding="utf-8")


# --- any stream id is recorded, a failure logged once -------------------------------------


@pytest.mark.anyio
async def test_long_stream_ids_are_recorded_under_bounded_names(tmp_path: Path) -> None:
    """Ids whose percent-encoded name would pass 255 bytes (a 28-character Chinese id among
    them) are recorded too, under a name of a readable prefix and a hash, distinct for
    distinct ids."""
    ids = [
        "demo",
        "会议室" * 9 + "一",  # 28 characters, 252 bytes encoded
        "会" * 128,  # the longest id the protocol takes
        "%" * 128,
        "x" * 120 + "-one",
        "x" * 120 + "-two",  # same first 120 characters as the one before
        'a/b\\c:d*e?f"g<h>i|j' * 6,
    ]

    async def feed(engine: FakeEngine) -> None:
        for n, stream in enumerate(ids):
            engine.say(final(stream, 0, f"said on stream {n}", 0.0, 1500.0))

    assert await recording(tmp_path, feed) == len(ids)
    names = {p.name for p in tmp_path.iterdir()}
    assert len(names) == len(ids)
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    assert all(len(name.encode()) < min(name_max, 160) for name in names), names
    for n, stream in enumerate(ids):
        readable = urllib.parse.quote(stream, safe="")[:60]  # the name starts with the id
        holding = [m for m in names if f"said on stream {n}" in (tmp_path / m).read_text("utf-8")]
        assert len(holding) == 1 and holding[0].startswith(readable), (stream, holding)
    assert any(re.fullmatch(r"demo\.\d{8}T\d{6}Z\.1\.vtt", name) for name in names), names


@pytest.mark.anyio
async def test_stream_ids_starting_with_a_dot_are_recorded_in_files_that_are_not_hidden(
    tmp_path: Path,
) -> None:
    ids = [".hidden", "..", ".", "." * 128]

    async def feed(engine: FakeEngine) -> None:
        for n, stream in enumerate(ids):
            engine.say(final(stream, 0, f"said on stream {n}", 0.0, 1500.0))

    assert await recording(tmp_path, feed) == len(ids)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == len(ids) and not any(name.startswith(".") for name in names), names
    assert any(name.startswith("%2Ehidden.") for name in names), names
    assert recorder_module.file_stem(".x") == "%2Ex" and recorder_module.file_stem("a.b") == "a.b"


@pytest.mark.anyio
async def test_a_failure_to_record_is_logged_once_and_caught_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream that cannot be recorded logs one line when writing fails and one when it
    works again, not an ERROR per final; the finals meanwhile are kept and written then."""
    monkeypatch.setattr(recorder_module, "RETRY_S", 0.05, raising=False)
    directory = tmp_path / "rec"
    caplog.set_level(logging.INFO, logger="engine.server.recorder")

    async def feed(engine: FakeEngine) -> None:
        await anyio.sleep(0.05)  # recording has started
        if directory.exists():
            directory.rmdir()
        directory.write_text("a file where the directory should be")
        for i in range(20):
            engine.say(final("demo", i, sentence(i), i * 2000.0, i * 2000.0 + 1500))
            await anyio.sleep(0.01)
        await until(lambda: any(r.levelno >= logging.ERROR for r in caplog.records))
        await anyio.sleep(0.1)  # more finals tried meanwhile (RETRY_S), none logged
        directory.unlink()
        directory.mkdir()
        engine.say(final("demo", 20, sentence(20), 40000.0, 41500.0))
        await until(lambda: any(directory.glob("*.vtt")))

    await recording(directory, feed)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "cannot write" in errors[0].getMessage(), errors
    assert sum(r.getMessage().endswith(" again") for r in caplog.records) == 1
    cues = list(webvtt.read(str(only_file(directory))))
    assert len(cues) == 21 + 3  # finals 6, 13 and 20 have two cues each


# --- a bad --record directory is a bad option ---------------------------------------------


def bad_directories(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "file").write_text("x")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    return {
        "a file": tmp_path / "file",
        "under a file": tmp_path / "file" / "rec",
        "in /proc": Path("/proc/nmt-record"),
        "/proc itself": Path("/proc"),
        "read-only": Path("/sys/nmt-record"),
        "not writable": locked,
    }


@pytest.mark.parametrize(
    "case", ["a file", "under a file", "in /proc", "/proc itself", "read-only", "not writable"]
)
def test_a_record_directory_that_cannot_be_written_exits_2_before_serving(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Such a directory is refused at start with a message, like a bad option, rather than
    failing the server after /readyz has said 200."""
    from engine.cli.main import main

    directory = bad_directories(tmp_path)[case]
    linux = Path("/proc/self").is_dir() and Path("/sys/kernel").is_dir()
    if str(directory).startswith(("/proc", "/sys")) and not linux:
        pytest.skip("needs Linux's /proc and /sys")
    if case == "not writable" and os.geteuid() == 0:
        pytest.skip("root writes in any directory")

    def served(*args: Any) -> int:
        raise AssertionError("the server started")

    monkeypatch.setattr(anyio, "run", served)  # what serve calls to start serving
    assert main(["serve", "--model", str(FIXTURE_MODEL), "--record", str(directory)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --record {directory}: "), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


# --- times of 100 h and more --------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["vtt", "srt"])
async def test_a_recogniser_clock_in_unix_milliseconds_gives_real_cues(
    tmp_path: Path, kind: str
) -> None:
    """A life whose first final starts 100 h or more in (a recogniser sending Unix-epoch
    milliseconds) is timed from that final, not written as zero-length cues at
    99:59:59.999."""
    epoch_ms = 1_764_000_000_000.0

    async def feed(engine: FakeEngine) -> None:
        for i in range(3):
            start = epoch_ms + i * 3000.0
            engine.say(final("demo", i, f"line {i}", start, start + 1500.0))

    await recording(tmp_path, feed, kind)
    text = only_file(tmp_path, f"*.{kind}").read_text(encoding="utf-8")
    subs = list(srt.parse(text.replace("WEBVTT\n\n", "")))  # the srt parser reads both
    assert [round(s.start.total_seconds() * 1000) for s in subs] == [0, 3000, 6000]
    assert all(s.end > s.start for s in subs)
    assert [s.content for s in subs] == ["line 0", "line 1", "line 2"]


@pytest.mark.parametrize("kind", ["vtt", "srt"])
def test_times_past_99_hours_keep_their_value(tmp_path: Path, kind: str) -> None:
    """A stream that runs past 100 h (timed from its start): hours take three digits, as
    WebVTT allows, instead of every cue clamped to 99:59:59.999 (what pysubs2 writes)."""
    hour = 3600_000
    cues = subtitles.layout(
        [
            subtitles.Final(99 * hour + 1000, 99 * hour + 2000, "before"),
            subtitles.Final(100 * hour, 100 * hour + 1500, "after"),
            subtitles.Final(123 * hour + 4567, 123 * hour + 6000, "later"),
        ]
    )
    path = subtitles.write(tmp_path / f"long.{kind}", cues, kind)
    text = path.read_text(encoding="utf-8")
    assert "100:00:00" in text and "123:00:04" in text
    if kind == "vtt":
        got = [
            (c.start_time.in_milliseconds(), c.end_time.in_milliseconds())
            for c in webvtt.read(str(path))
        ]
    else:
        got = [
            (round(s.start.total_seconds() * 1000), round(s.end.total_seconds() * 1000))
            for s in srt.parse(text)
        ]
    assert got == [(c.start_ms, c.end_ms) for c in cues]
    assert all(end > start for start, end in got)


# --- a full disk --------------------------------------------------------------------------


@pytest.mark.parametrize("room", [0, 700])
def test_a_full_disk_leaves_no_temporary_file_and_the_file_valid(tmp_path: Path, room: int) -> None:
    """On a full disk, writes that fail (here: past RLIMIT_FSIZE, `room` bytes, in a child
    process) leave no 0-byte `.tmp`, the file as it was (`room` 700: its first finals) and
    one ERROR; once there is room again every final is written."""
    directory = tmp_path / "rec"
    directory.mkdir()
    proc = child("full", directory, room)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    during = json.loads(out.splitlines()[0])
    assert not [n for n in during["names"] if n.endswith(".tmp")], during["names"]
    if room == 0:
        assert during["names"] == []
    else:
        (name,) = during["names"]
        assert 0 < len(during["contents"][name].encode()) <= room
        (directory / "during.vtt").write_text(during["contents"][name], encoding="utf-8")
        assert 0 < check_file(directory / "during.vtt", "demo") < 20
        (directory / "during.vtt").unlink()
    assert err.count("ERROR") == 1 and "cannot write" in err, err
    assert err.count("writing") == 1, err  # ... "again"
    (path,) = directory.iterdir()
    assert check_file(path, "demo") == 25


# --- stream lives -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_serve_records_each_streams_finals_as_they_arrive(tmp_path: Path) -> None:
    from websockets.asyncio.client import connect

    from engine.decoding.translator import Translator
    from tests.live_server import serving as serving_in_process
    from tests.live_server import ws_url

    needs_fixture()
    translator = Translator.from_dir(FIXTURE_MODEL)
    spans = [(1200.0, 2900.0), (3500.0, 5100.0)]
    path = tmp_path / "rec" / "talk%2F1.RUN.1.vtt"
    async with serving_in_process(translator) as server, anyio.create_task_group() as tg:
        assert server.engine is not None
        tg.start_soon(record, server.engine, tmp_path / "rec", "vtt", "RUN")
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
                # written as the final arrives, not at the end
                await until_cues(path, segment + 1)
        await server.engine.aclose()
    cues = list(webvtt.read(str(path)))
    assert [c.start_time.in_milliseconds() for c in cues] == [1200, 3500]
    assert all(c.text for c in cues)


def test_the_recorder_forgets_stream_lives_that_ended() -> None:
    """A server that runs for weeks must not hold the state of every stream it ever
    recorded: a life's track goes when the same id's next life speaks (at once), or in a
    periodic sweep once the engine no longer has that life and it was quiet GRACE_S."""

    class Engine:
        def __init__(self) -> None:
            self.open = {"a": 2, "b": 1}

        def epoch_of(self, stream_id: str) -> int | None:
            return self.open.get(stream_id)

    def update(stream_id: str, epoch: int) -> TranslationUpdate:
        return TranslationUpdate(stream_id, 0, 1, "x", "", True, 1.0, 1.0, epoch=epoch)

    tracks: dict[Key, _Track] = {
        ("a", 1, None): _Track(0.0, last_seen=0.0),
        ("a", 2, None): _Track(0.0, last_seen=0.0),
        ("b", 1, None): _Track(0.0, last_seen=0.0),
        ("c", 1, None): _Track(0.0, last_seen=0.0),  # closed: not open
        ("d", 1, None): _Track(0.0, last_seen=100.0),  # closed, recent
    }
    engine: Any = Engine()
    assert forget_ended(engine, tracks, update("a", 2), False, 1.0) == [("a", 1, None)]
    assert set(tracks) == {("a", 2, None), ("b", 1, None), ("c", 1, None), ("d", 1, None)}
    now = 100.0 + GRACE_S / 2
    assert forget_ended(engine, tracks, update("b", 1), True, now) == [("c", 1, None)]
    assert set(tracks) == {("a", 2, None), ("b", 1, None), ("d", 1, None)}
    assert forget_ended(engine, tracks, update("b", 1), True, 100.0 + GRACE_S + 1) == [
        ("d", 1, None)
    ]
    assert set(tracks) == {("a", 2, None), ("b", 1, None)}  # the open lives stay


@pytest.mark.anyio
async def test_a_reopened_stream_gets_its_own_file_and_the_old_one_stays(tmp_path: Path) -> None:
    from engine.streaming.controller import IncrementalTranslator
    from protocol import PartialTranscript

    needs_fixture()
    async with (
        IncrementalTranslator.from_dir(FIXTURE_MODEL) as nmt,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(record, nmt, tmp_path, "srt", "RUN")
        await anyio.sleep(0.05)
        for text in ("I will meet Tom", "Tom reads a book"):
            await nmt.push(PartialTranscript("talk", 0, 0, text, True, 0.0, 1500.0))
            await nmt.close_stream("talk")
            await nmt.wait_idle()
            assert nmt.epoch_of("talk") is None
        await nmt.aclose()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["talk.RUN.1.srt", "talk.RUN.2.srt"]
    tr = nmt.translator
    assert tr.translate(["I will meet Tom"])[0].text in (tmp_path / files[0]).read_text("utf-8")
    assert tr.translate(["Tom reads a book"])[0].text in (tmp_path / files[1]).read_text("utf-8")
