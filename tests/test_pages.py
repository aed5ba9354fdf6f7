"""The viewer pages as a newcomer and a viewer meet them, in headless Chromium:
the subtitle page says what it waits for and why it cannot show a stream, fades lines out
after silence, shows the recognised source on request; the transcript page lists a
stream's finals with their times, follows it across a reconnect and builds subtitle files
that independent parsers read. One default stream id, `demo`, everywhere.

Browser tests use Debian's /usr/bin/chromium through Playwright (`.ci/install-browser`)
and skip without it or without the fixture model; the others need neither.
"""

from __future__ import annotations

import json
import re
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from websockets.asyncio.client import ClientConnection, connect

from engine.cli.serve import DEFAULT_STREAM, page_url
from engine.decoding.translator import Translator
from engine.server.app import ServerOptions, SubtitleServer
from engine.server.handshake import PAGES, STATIC_FILES, Route, route
from tests.conftest import FIXTURE_MODEL, ROOT, needs_fixture
from tests.live_server import http_get, recv, serving

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu"]
STATIC = ROOT / "engine" / "server" / "static"
LOGS = ROOT / "examples" / "logs"

SENTENCES = [
    "Does Tom draw a horse",
    "Lucy wants to meet Jack on the train",
    "Peter will find a car",
    "Does Linda drink water",
    "She will draw a tree with you this evening",
]

READ_LINES = """() => [...document.querySelectorAll('#subtitles .line')].map(line => [
    line.querySelector('.stable').textContent,
    line.querySelector('.tentative').textContent,
])"""

READ_FINALS = """() => [...document.querySelectorAll('#finals li')].map(li => [
    li.querySelector('.when').textContent,
    (li.querySelector('.source') || {textContent: null}).textContent,
    li.querySelector('.translation').textContent,
])"""


WATCH_LINES = """() => {
    // Each change to the lines, with its time: an update drawn, a fade begun, a line gone.
    window.changes = [];
    const lines = document.getElementById('subtitles');
    new MutationObserver(records => {
        const now = performance.now();
        for (const r of records) {
            const node = r.target.nodeType === 1 ? r.target : r.target.parentElement;
            const gone = [...r.removedNodes].some(n => n.classList && n.classList.contains('line'));
            let kind = 'update';
            if (gone) kind = 'removed';
            else if (r.type === 'attributes' && node.classList.contains('leaving')) {
                kind = 'leaving';
            }
            window.changes.push([kind, now]);
        }
    }).observe(lines, {childList: true, subtree: true, characterData: true,
                       attributes: true, attributeFilter: ['class']});
}"""


def needs_browser() -> Any:
    """Playwright's async API, or skip (no Playwright, no Chromium)."""
    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} missing (run .ci/install-browser)")
    return pytest.importorskip("playwright.async_api")


@pytest.fixture(scope="module")
def translator() -> Translator:
    needs_fixture()
    needs_browser()
    return Translator.from_dir(FIXTURE_MODEL)


async def launch(playwright: Any) -> Any:
    return await playwright.chromium.launch(
        executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
    )


async def viewers(server: SubtitleServer, count: int) -> None:
    """Wait until `count` viewers subscribed (a page is open before anything is said)."""
    with anyio.fail_after(10):
        while server.role_counts()["viewer"] != count:
            await anyio.sleep(0.01)


async def say(
    ws: ClientConnection,
    stream: str,
    sentences: list[str],
    *,
    segment: int = 0,
    seq: int = 0,
    timed: bool = False,
) -> list[dict[str, Any]]:
    """Send each sentence word by word, then final (segments from `segment`, seqs from
    `seq`; `timed`: with audio times, segment k from 1 s + 4 s x k, 0.5 s a word); return
    the final updates, in order."""
    finals = []
    for k, sentence in enumerate(sentences):
        words = sentence.split()
        for i in range(1, len(words) + 1):
            message: dict[str, Any] = {
                "type": "partial_transcript",
                "stream_id": stream,
                "segment_id": segment + k,
                "seq": seq,
                "text": " ".join(words[:i]),
                "is_final": i == len(words),
            }
            if timed:
                start = 1000 + 4000 * (segment + k)
                message |= {"start_ms": start, "end_ms": start + 500 * i}
            await ws.send(json.dumps(message))
            seq += 1
        while True:
            update = await recv(ws)
            assert update["type"] == "translation_update", update
            if update["is_final"] and update["segment_id"] == segment + k:
                finals.append(update)
                break
    return finals


async def shown_status(page: Any) -> str | None:
    """The status note if a viewer can see it (not display:none, not empty), else None."""
    if not await page.is_visible("#status"):
        return None
    return str(await page.text_content("#status"))


async def wait_for_lines(page: Any, expected: list[list[str]]) -> list[list[str]]:
    await page.wait_for_function(
        f"(want) => JSON.stringify(({READ_LINES})()) === JSON.stringify(want)",
        arg=expected,
        timeout=10000,
    )
    shown: list[list[str]] = await page.evaluate(READ_LINES)
    return shown


# --- one default stream id; the routes (no browser) -------------------------------------


def test_one_default_stream_id_everywhere(capsys: pytest.CaptureFixture[str]) -> None:
    """The page without ?stream, the server's banner and the replay client all say `demo`;
    the client still sends a log's own ids with `--stream-id=`."""
    script = (STATIC / "subtitles.js").read_text("utf-8")
    assert f'const DEFAULT_STREAM = "{DEFAULT_STREAM}";' in script
    assert DEFAULT_STREAM == "demo"
    options = ServerOptions(viewer_token="v t")
    assert page_url("http://h:1/", options) == "http://h:1/?stream=demo&token=v%20t"
    assert page_url("http://h:1/", ServerOptions(), page="transcript") == (
        "http://h:1/transcript?stream=demo"
    )

    sys.path.insert(0, str(ROOT / "examples"))
    from replay_client import main

    def pages(*args: str) -> list[str]:
        # Port 1: nothing listens, so the client prints its page URLs and gives up.
        status = main([*args, "--url", "ws://127.0.0.1:1/ws", "--reconnect-for", "0"])
        assert status == 2
        return re.findall(r"subtitle page: \S+\?stream=(\S+)", capsys.readouterr().err)

    assert pages(str(LOGS / "fixture_en_zh.jsonl")) == ["demo"]
    assert pages(str(LOGS / "fixture_two_streams.jsonl")) == ["demo-left", "demo-right"]
    assert pages(str(LOGS / "fixture_en_zh.jsonl"), "--stream-id=") == ["s1"]
    assert pages(str(LOGS / "fixture_two_streams.jsonl"), "--stream-id=") == ["left", "right"]
    assert pages(str(LOGS / "fixture_en_zh.jsonl"), "--stream-id", "mic-1") == ["mic-1"]


def test_the_transcript_route_and_its_files() -> None:
    assert route("/transcript?stream=s1&token=t") is Route.TRANSCRIPT
    assert route("/transcript.js") is route("/transcript.css") is Route.STATIC
    for name in [*PAGES.values(), *(path.lstrip("/") for path in STATIC_FILES)]:
        assert (STATIC / name).is_file(), name
    html = (STATIC / "transcript.html").read_text("utf-8")
    # The shared part (stream ids, connection) comes from subtitles.js, loaded first.
    assert html.index('src="subtitles.js"') < html.index('src="transcript.js"')


# --- the subtitle page ------------------------------------------------------------------


@pytest.mark.anyio
async def test_the_page_says_what_it_waits_for_until_lines_show(translator: Translator) -> None:
    async_api = needs_browser()
    async with serving(translator) as server, async_api.async_playwright() as playwright:
        browser = await launch(playwright)
        default, talk, quiet = [await browser.new_page() for _ in range(3)]
        await default.goto(server.url)  # no ?stream: what the banner links to
        await talk.goto(f"{server.url}?stream=talk")
        await quiet.goto(f"{server.url}?stream=talk&status=off")
        for page in (default, talk, quiet):
            await page.wait_for_selector("body[data-state=open]")
        await viewers(server, 3)
        assert await shown_status(default) == "waiting for stream “demo” (nothing said yet)"
        assert await shown_status(talk) == "waiting for stream “talk” (nothing said yet)"
        assert await shown_status(quiet) is None  # status=off: nothing but subtitles

        async with connect(f"ws://127.0.0.1:{server.port}/ws") as writer:
            (final,) = await say(writer, "talk", SENTENCES[:1])
        want = [[final["stable_text"], ""]]
        assert await wait_for_lines(talk, want) == want
        # Lines show: the note keeps out of the way.
        assert await shown_status(talk) is None
        assert await shown_status(default) == "waiting for stream “demo” (nothing said yet)"
        await browser.close()


@pytest.mark.anyio
async def test_a_language_the_server_lacks_is_said_visibly(translator: Translator) -> None:
    """`?lang=de` on a server translating into Chinese alone: the server's refusal shows,
    in the middle of the page (the old CSS rule hid every note of an open connection)."""
    async_api = needs_browser()
    async with serving(translator) as server, async_api.async_playwright() as playwright:
        browser = await launch(playwright)
        page = await browser.new_page(viewport={"width": 960, "height": 360})
        await page.goto(f"{server.url}?lang=de")
        await page.wait_for_selector("body[data-state=refused]", timeout=10000)
        style = await page.evaluate(
            """() => {
                const s = getComputedStyle(document.getElementById('status'));
                const box = document.getElementById('status').getBoundingClientRect();
                return [s.display, s.visibility, s.opacity, box.width > 100, box.height > 20];
            }"""
        )
        assert style == ["block", "visible", "1", True, True]
        note = await shown_status(page)
        assert note is not None
        assert "Cannot show stream “demo”" in note
        assert "no translation into 'de' here; languages: zh" in note, note
        await anyio.sleep(0.3)
        assert server.role_counts()["viewer"] == 0  # refused, and it does not retry
        await browser.close()


@pytest.mark.anyio
async def test_source_shows_above_its_translation(translator: Translator) -> None:
    async_api = needs_browser()
    async with serving(translator) as server, async_api.async_playwright() as playwright:
        browser = await launch(playwright)
        source, plain = await browser.new_page(), await browser.new_page()
        await source.goto(f"{server.url}?stream=s1&source=1&lines=2")
        await plain.goto(f"{server.url}?stream=s1")
        for page in (source, plain):
            await page.wait_for_selector("body[data-state=open]")
        await viewers(server, 2)
        async with connect(f"ws://127.0.0.1:{server.port}/ws") as writer:
            finals = await say(writer, "s1", SENTENCES[:2])
        want = [[final["stable_text"], ""] for final in finals]
        assert await wait_for_lines(source, want) == want
        assert await wait_for_lines(plain, want) == want
        layout = await source.evaluate(
            """() => [...document.querySelectorAll('.line')].map(line => {
                const src = line.querySelector('.source'), text = line.querySelector('.text');
                return [src.textContent, src.getBoundingClientRect().bottom
                        <= text.getBoundingClientRect().top + 1,
                        parseFloat(getComputedStyle(src).fontSize)
                        < parseFloat(getComputedStyle(text).fontSize)];
            })"""
        )
        assert layout == [[sentence, True, True] for sentence in SENTENCES[:2]]
        assert await plain.locator(".source").count() == 2
        assert not await plain.locator(".source").first.is_visible()  # only on request
        await browser.close()


@pytest.mark.anyio
async def test_lines_clear_after_the_silence_asked_for(translator: Translator) -> None:
    """`?clear=1`: the lines go about a second after the last update; `clear=0` keeps them."""
    async_api = needs_browser()
    async with serving(translator) as server, async_api.async_playwright() as playwright:
        browser = await launch(playwright)
        clearing, keeping = await browser.new_page(), await browser.new_page()
        await clearing.goto(f"{server.url}?stream=s1&clear=1")
        await keeping.goto(f"{server.url}?stream=s1&clear=0")
        for page in (clearing, keeping):
            await page.wait_for_selector("body[data-state=open]")
        await viewers(server, 2)
        await clearing.evaluate(WATCH_LINES)
        async with connect(f"ws://127.0.0.1:{server.port}/ws") as writer:
            (final,) = await say(writer, "s1", SENTENCES[:1])
            want = [[final["stable_text"], ""]]
            assert await wait_for_lines(clearing, want) == want
            await clearing.wait_for_function(
                "() => !document.querySelector('#subtitles .line')", timeout=8000
            )
        # Timed in the page (a MutationObserver), free of this process's own delays: the
        # fade starts a second after the last update was drawn, and the line goes after it.
        changes: list[tuple[str, float]] = await clearing.evaluate("() => window.changes")
        kinds = [kind for kind, _ in changes]
        leaving = changes[kinds.index("leaving")][1]
        removed = changes[kinds.index("removed")][1]
        last_update = max(at for kind, at in changes if kind == "update" and at < leaving)
        assert 990 <= leaving - last_update <= 2500, changes
        assert 500 <= removed - leaving <= 2500, changes
        assert await keeping.evaluate(READ_LINES) == want
        assert await shown_status(clearing) == "stream “s1”: waiting for the next words"
        await browser.close()


@pytest.mark.anyio
async def test_no_italics_anywhere(translator: Translator) -> None:
    """Browsers slant CJK glyphs for italics (there are none in CJK fonts): tentative
    text is told apart by opacity and weight, no rule of either page sets an italic, and
    the pages forbid synthesising one."""
    async_api = needs_browser()
    async with serving(translator) as server, async_api.async_playwright() as playwright:
        browser = await launch(playwright)
        page = await browser.new_page()
        for path in ["?stream=s1&lang=zh", "transcript?stream=s1"]:
            await page.goto(server.url + path)
            await page.wait_for_selector("body[data-state=open]")
            italic = await page.evaluate(
                """() => [...document.styleSheets].flatMap(sheet => [...sheet.cssRules])
                    .filter(rule => rule.style && /italic|oblique/.test(rule.style.fontStyle))
                    .map(rule => rule.cssText)"""
            )
            assert italic == [], (path, italic)
            synthesis = await page.evaluate(
                "() => getComputedStyle(document.documentElement).fontSynthesisStyle"
            )
            assert synthesis == "none", path
        await page.goto(server.url + "?stream=s1&lang=zh")
        await page.wait_for_selector("body[data-state=open]")
        async with connect(f"ws://127.0.0.1:{server.port}/ws") as writer:
            await writer.send(
                json.dumps(
                    {
                        "type": "partial_transcript",
                        "stream_id": "s1",
                        "segment_id": 0,
                        "seq": 0,
                        "text": "Lucy wants to meet Jack on",
                        "is_final": False,
                    }
                )
            )
            await page.wait_for_selector("#subtitles .line")
        style = await page.evaluate(
            """() => { const s = getComputedStyle(document.querySelector('.tentative'));
                       return [s.fontStyle, s.opacity, s.fontWeight]; }"""
        )
        assert style == ["normal", "0.6", "400"]
        await browser.close()


# --- the transcript page ------------------------------------------------------------------


def stream_time(ms: float) -> str:
    """The page's audio times: m:ss.s."""
    tenths = round(ms / 100)
    return f"{tenths // 600}:{(tenths % 600) / 10:04.1f}"


@pytest.mark.anyio
async def test_transcript_lists_finals_with_times_and_builds_subtitle_files(
    translator: Translator,
) -> None:
    """Finals said before the page opened (from the server's history, `after: "0-0"`) and
    after, in order, each once, with audio times, source and translation; its VTT and SRT
    parse with webvtt-py and srt, with the same cues; the download is that file."""
    import srt
    import webvtt

    async_api = needs_browser()
    async with (
        serving(translator) as server,
        async_api.async_playwright() as playwright,
        connect(f"ws://127.0.0.1:{server.port}/ws") as writer,
    ):
        browser = await launch(playwright)
        page = await browser.new_page(accept_downloads=True)
        status = await http_get(server, "/transcript?stream=talk")
        assert status.status == 200 and status.headers["Content-Type"].startswith("text/html")
        assert "Content-Security-Policy" in status.headers
        finals = await say(writer, "talk", SENTENCES[:3], timed=True)
        await page.goto(f"{server.url}transcript?stream=talk")
        await page.wait_for_function("() => document.querySelectorAll('#finals li').length === 3")
        finals += await say(writer, "talk", SENTENCES[3:], segment=3, seq=100, timed=True)
        await page.wait_for_function("() => document.querySelectorAll('#finals li').length === 5")
        await anyio.sleep(0.3)  # nothing more comes: partials and repeats are not listed

        spans = [(f["start_ms"], f["end_ms"]) for f in finals]
        assert spans == [(1000 + 4000 * k, 1000 + 4000 * k + 500 * len(s.split()))
                         for k, s in enumerate(SENTENCES)]  # fmt: skip
        listed = await page.evaluate(READ_FINALS)
        assert listed == [
            [f"{stream_time(start)}–{stream_time(end)}", sentence, f["stable_text"]]
            for (start, end), sentence, f in zip(spans, SENTENCES, finals, strict=True)
        ]
        assert all(f["stable_text"] for f in finals)
        assert await page.text_content("#status") == "5 finals; following live"
        assert await page.text_content("#title") == "Transcript of stream “talk”"

        vtt_text = await page.evaluate("() => nmtTranscript.buildVtt(nmtTranscript.finals())")
        srt_text = await page.evaluate("() => nmtTranscript.buildSrt(nmtTranscript.finals())")
        captions = webvtt.from_string(vtt_text).captions
        assert [(c.start, c.end, c.text) for c in captions] == [
            (vtt_time(start), vtt_time(end), f["stable_text"])
            for (start, end), f in zip(spans, finals, strict=True)
        ]
        subtitles = list(srt.parse(srt_text))
        assert [(s.index, s.start, s.end, s.content) for s in subtitles] == [
            (i, timedelta(milliseconds=start), timedelta(milliseconds=end), f["stable_text"])
            for i, ((start, end), f) in enumerate(zip(spans, finals, strict=True), start=1)
        ]

        async with page.expect_download() as info:
            await page.click("#download-vtt")
        download = await info.value
        assert download.suggested_filename == "talk.vtt"
        assert Path(await download.path()).read_text("utf-8") == vtt_text
        async with page.expect_download() as info:
            await page.click("#download-srt")
        download = await info.value
        assert download.suggested_filename == "talk.srt"
        assert Path(await download.path()).read_text("utf-8") == srt_text
        await browser.close()


def seconds(timestamp: str) -> float:
    """A WebVTT timestamp (HH:MM:SS.mmm) in seconds."""
    hours, minutes, rest = timestamp.split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(rest)


def vtt_time(ms: float) -> str:
    seconds, millis = divmod(round(ms), 1000)
    return f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}.{millis:03d}"


@pytest.mark.anyio
async def test_transcript_resumes_after_its_last_cursor_when_reconnecting(
    translator: Translator,
) -> None:
    """The server restarts: the page says it is reconnecting, subscribes again after the
    last cursor it had (not from the start), and the list goes on with nothing repeated;
    without audio times each final shows when the server translated it."""
    import webvtt

    async_api = needs_browser()
    frames: list[tuple[str, dict[str, Any]]] = []

    def watch(ws: Any) -> None:
        ws.on("framesent", lambda payload: frames.append(("sent", json.loads(payload))))
        ws.on("framereceived", lambda payload: frames.append(("got", json.loads(payload))))

    async with async_api.async_playwright() as playwright:
        browser = await launch(playwright)
        page = await browser.new_page()
        page.on("websocket", watch)
        async with serving(translator) as first:
            port = first.port
            await page.goto(f"{first.url}transcript?stream=s1")
            await page.wait_for_selector("body[data-state=open]")
            await viewers(first, 1)
            async with connect(f"ws://127.0.0.1:{port}/ws") as writer:
                finals = await say(writer, "s1", SENTENCES[:2])
            await page.wait_for_function(
                "() => document.querySelectorAll('#finals li').length === 2"
            )
        await page.wait_for_function(
            "() => document.getElementById('status').textContent.includes('reconnecting')"
        )
        async with serving(translator, port=port) as second:
            await page.wait_for_selector("body[data-state=open]", timeout=15000)
            await viewers(second, 1)
            async with connect(f"ws://127.0.0.1:{port}/ws") as writer:
                finals += await say(writer, "s1", SENTENCES[2:3])
            await page.wait_for_function(
                "() => document.querySelectorAll('#finals li').length === 3"
            )

        subscribes = [i for i, (way, frame) in enumerate(frames) if way == "sent"]
        assert [frames[i][1]["type"] for i in subscribes] == ["subscribe", "subscribe"]
        first_sub, again = (frames[i][1] for i in subscribes)
        assert first_sub == {"type": "subscribe", "stream_id": "s1", "after": "0-0"}
        had = [f["cursor"] for way, f in frames[: subscribes[1]] if way == "got"]
        assert again == {"type": "subscribe", "stream_id": "s1", "after": had[-1]}

        listed = await page.evaluate(READ_FINALS)
        assert [row[1:] for row in listed] == [
            [sentence, f["stable_text"]] for sentence, f in zip(SENTENCES, finals, strict=False)
        ]
        assert all(re.fullmatch(r"\d\d:\d\d:\d\d", when) for when, _, _ in listed), listed
        # Cues timed by the server's clock: in order, each at least a second long.
        vtt_text = await page.evaluate("() => nmtTranscript.buildVtt(nmtTranscript.finals())")
        captions = webvtt.from_string(vtt_text).captions
        assert [c.text for c in captions] == [f["stable_text"] for f in finals]
        starts = [seconds(c.start) for c in captions]
        assert starts == sorted(starts) and starts[0] == 0
        assert all(round(seconds(c.end) - seconds(c.start), 3) >= 1 for c in captions)
        await browser.close()


@pytest.mark.anyio
async def test_subtitle_files_from_awkward_finals(translator: Translator) -> None:
    """The page's builders on finals made up here: past an hour, without an end time,
    markup-like text over two lines (VTT escapes it, SRT keeps it, both one line), an
    empty translation (no cue), and finals without audio times (the server's clock)."""
    import srt
    import webvtt

    async_api = needs_browser()
    hour = 3_600_000
    timed = [
        {"text": "a <b> & c --> d", "startMs": hour + 62_003.4, "endMs": hour + 63_500},
        {"text": "two\nlines", "startMs": hour + 64_000, "endMs": None},
        {"text": "", "startMs": hour + 65_000, "endMs": hour + 66_000},
        {"text": "last", "startMs": hour + 66_000, "endMs": None},
    ]
    untimed = [
        {"text": "one", "startMs": None, "endMs": None, "firstSeen": 5000, "arrived": 5200},
        {"text": "two", "startMs": None, "endMs": None, "firstSeen": 7000, "arrived": 9500},
    ]
    async with serving(translator) as server, async_api.async_playwright() as playwright:
        browser = await launch(playwright)
        page = await browser.new_page()
        await page.goto(f"{server.url}transcript?stream=s1")
        await page.wait_for_selector("body[data-state=open]")
        build = (
            "([finals, f]) => nmtTranscript[f](finals.map(x => ({firstSeen: 0, arrived: 0, ...x})))"
        )
        vtt_text = await page.evaluate(build, [timed, "buildVtt"])
        srt_text = await page.evaluate(build, [timed, "buildSrt"])
        arrival = await page.evaluate(build, [untimed, "buildVtt"])
        await browser.close()
    assert "a &lt;b&gt; &amp; c --&gt; d" in vtt_text and "c --> d" not in vtt_text
    captions = webvtt.from_string(vtt_text).captions
    assert [(c.start, c.end) for c in captions] == [
        ("01:01:02.003", "01:01:03.500"),
        ("01:01:04.000", "01:01:06.000"),  # no end: until the next cue starts, 2 s here
        ("01:01:06.000", "01:01:09.000"),  # no end and nothing after: 3 s
    ]
    assert [c.text for c in captions][1:] == ["two lines", "last"]
    subtitles = list(srt.parse(srt_text))
    assert [s.content for s in subtitles] == ["a <b> & c --> d", "two lines", "last"]
    assert subtitles[0].start == timedelta(hours=1, minutes=1, seconds=2, milliseconds=3)
    assert "01:01:02,003 --> 01:01:03,500" in srt_text
    # Server times, from the first final's first update: a cue is at least a second long.
    assert [(c.start, c.end, c.text) for c in webvtt.from_string(arrival).captions] == [
        ("00:00:00.000", "00:00:01.000", "one"),
        ("00:00:02.000", "00:00:04.500", "two"),
    ]
