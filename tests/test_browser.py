"""The subtitle page in headless Chromium: what a viewer sees equals what the engine sent.

Uses Debian's /usr/bin/chromium through Playwright (`.ci/install-browser` installs it);
never downloads a browser. Skipped when either is missing, or without the fixture model.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

import anyio
import pytest

from engine.decoding.translator import Translator
from engine.streaming.controller import IncrementalTranslator
from tests.conftest import FIXTURE_MODEL
from tests.live_server import STREAMING, serving

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu"]
SCREENSHOT_COPY = Path("/tmp/subtitles.png")

async_api = pytest.importorskip("playwright.async_api")
if not CHROMIUM.is_file():
    pytest.skip(f"{CHROMIUM} missing (run .ci/install-browser)", allow_module_level=True)

SEGMENTS = [
    ["I", "I will", "I will meet", "I will meet Tom", "I will meet Tom at three"],
    ["Tom", "Tom reads", "Tom reads a", "Tom reads a book"],
]

READ_LINES = """() => [...document.querySelectorAll('#subtitles .line')].map(line => [
    line.querySelector('.stable').textContent,
    line.querySelector('.tentative').textContent,
])"""


def message(segment: int, seq: int, text: str, final: bool) -> str:
    return json.dumps(
        {
            "type": "partial_transcript",
            "stream_id": "s1",
            "segment_id": segment,
            "seq": seq,
            "text": text,
            "is_final": final,
        }
    )


async def launch(playwright: Any) -> Any:
    return await playwright.chromium.launch(
        executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
    )


async def wait_for_lines(page: Any, expected: list[list[str]]) -> list[list[str]]:
    """Wait (briefly) until the page shows `expected`; return what it shows."""
    with contextlib.suppress(async_api.TimeoutError):  # the caller's assert shows the diff
        await page.wait_for_function(
            f"(want) => JSON.stringify(({READ_LINES})()) === JSON.stringify(want)",
            arg=expected,
            timeout=10000,
        )
    shown: list[list[str]] = await page.evaluate(READ_LINES)
    return shown


@pytest.mark.anyio
async def test_page_shows_stable_and_tentative_text(translator: Translator, tmp_path: Path) -> None:
    from websockets.asyncio.client import connect

    async with (
        serving(translator, token="wr1te", viewer_token="t0k") as server,
        async_api.async_playwright() as playwright,
    ):
        browser = await launch(playwright)
        page = await browser.new_page(viewport={"width": 1280, "height": 300})
        # The page passes the viewer token from its own URL on to /ws (browsers cannot set
        # headers); the writer's token is never in a page.
        await page.goto(f"{server.url}?stream=s1&lines=2&size=56&lang=zh-Hans&token=t0k")
        await page.wait_for_selector("body[data-state=open]")
        with anyio.fail_after(5):
            while server.role_counts()["viewer"] != 1:
                await anyio.sleep(0.01)
        assert server.engine is not None
        engine: IncrementalTranslator = server.engine

        lines: dict[int, list[str]] = {}
        tentative_seen = False
        headers = {"Authorization": "Bearer wr1te"}
        async with connect(
            f"ws://127.0.0.1:{server.port}/ws", additional_headers=headers
        ) as writer:
            seq = 0
            for segment, texts in enumerate(SEGMENTS):
                for i, text in enumerate(texts):
                    final = segment == 0 and i == len(texts) - 1  # segment 1 stays open
                    await writer.send(message(segment, seq, text, final))
                    seq += 1
                    with anyio.fail_after(10):  # accepted by the engine, then translated
                        while engine.stats["events"] < seq:
                            await anyio.sleep(0.01)
                        await engine.wait_idle("s1")
                    # Every update the writer got for this partial, in order.
                    while True:
                        with anyio.move_on_after(0.3):
                            update = json.loads(await writer.recv())
                            assert update["type"] == "translation_update", update
                            lines[update["segment_id"]] = [
                                update["stable_text"],
                                update["unstable_text"],
                            ]
                            continue
                        break
                    expected = [lines[k] for k in sorted(lines)][-2:]
                    assert await wait_for_lines(page, expected) == expected
                    tentative_seen |= any(tail for _, tail in expected)

        # The last line's tail is dimmer and lighter than the stable part, and never in
        # italics: browsers fake them for Chinese by slanting the glyphs.
        styles = await page.evaluate(
            """() => ['.stable', '.tentative'].map(sel => {
                const s = getComputedStyle(document.querySelector('.line:last-child ' + sel));
                return [s.fontStyle, s.opacity, s.fontWeight];
            })"""
        )
        assert styles == [["normal", "1", "600"], ["normal", "0.6", "400"]]
        shot = tmp_path / "subtitles.png"
        await page.screenshot(path=str(shot))
        shutil.copy(shot, SCREENSHOT_COPY)
        assert shot.stat().st_size > 0
        assert (
            lines[0][1] == ""
            and lines[0][0] == translator.translate([SEGMENTS[0][-1]], STREAMING.decode)[0].text
        )
        assert tentative_seen, "no update had a tentative tail: its style was not checked"
        await browser.close()


@pytest.mark.anyio
async def test_page_options_and_reconnect(translator: Translator) -> None:
    """OBS options apply; after a server restart on the same port the page comes back."""
    from websockets.asyncio.client import connect

    async with async_api.async_playwright() as playwright:
        browser = await launch(playwright)
        page = await browser.new_page()
        async with serving(translator) as first:
            port = first.port
            await page.goto(f"{first.url}?stream=s1&bg=transparent&color=ffcc00&size=30&lines=1")
            await page.wait_for_selector("body[data-state=open]")
            style = await page.evaluate(
                """() => {
                    const s = getComputedStyle(document.getElementById('subtitles'));
                    return [getComputedStyle(document.body).backgroundColor, s.color, s.fontSize];
                }"""
            )
            assert style == ["rgba(0, 0, 0, 0)", "rgb(255, 204, 0)", "30px"]
        await page.wait_for_selector("body[data-state=closed]")  # 1001 at shutdown

        async with serving(translator, port=port) as second:
            await page.wait_for_selector("body[data-state=open]", timeout=15000)
            with anyio.fail_after(5):
                while second.role_counts()["viewer"] != 1:
                    await anyio.sleep(0.01)
            async with connect(f"ws://127.0.0.1:{port}/ws") as writer:
                await writer.send(message(0, 0, "Tom reads a book", True))
                while not (update := json.loads(await writer.recv()))["is_final"]:
                    pass
            assert await wait_for_lines(page, [[update["stable_text"], ""]]) == [
                [update["stable_text"], ""]
            ]
        await browser.close()


@pytest.mark.anyio
async def test_page_shows_the_language_it_asks_for(relabelled_de: Path) -> None:
    """Fan-out: `?lang=de` subscribes to German (the fixture relabelled: same weights, see
    `conftest.relabel`), and a language the server lacks is said on the page."""
    from websockets.asyncio.client import connect

    from engine.decoding.targets import Targets
    from engine.server.app import ServerOptions, SubtitleServer
    from engine.server.limits import Limits

    targets = Targets.load([FIXTURE_MODEL, relabelled_de])
    options = ServerOptions(port=0, limits=Limits(rate_limit=None))
    async with (
        IncrementalTranslator(targets, STREAMING) as nmt,
        SubtitleServer(nmt, options) as server,
        async_api.async_playwright() as playwright,
    ):
        browser = await launch(playwright)
        german, french = await browser.new_page(), await browser.new_page()
        await german.goto(f"{server.url}?stream=s1&lang=de")
        await french.goto(f"{server.url}?stream=s1&lang=fr")
        await german.wait_for_selector("body[data-state=open]")
        await french.wait_for_function(
            "() => document.getElementById('status').textContent.includes('fr')", timeout=10000
        )
        assert "languages: zh, de" in (await french.text_content("#status") or "")
        with anyio.fail_after(5):  # the German page subscribed; the French one could not
            while server.role_counts()["viewer"] != 1:
                await anyio.sleep(0.01)
        async with connect(f"ws://127.0.0.1:{server.port}/ws") as writer:
            await writer.send(message(0, 0, "Tom reads a book", True))
            finals: dict[str, str] = {}
            while len(finals) < 2:
                update = json.loads(await writer.recv())
                if update["is_final"]:
                    finals[update["lang"]] = update["stable_text"]
        want = [[finals["de"], ""]]
        assert await wait_for_lines(german, want) == want
        assert await french.evaluate(READ_LINES) == []
        assert await german.evaluate("() => document.documentElement.lang") == "de"
        await browser.close()


# -- the page shows ids the server folds, and names ids it refuses ----------------------
# The server takes a stream id in NFC (an NFD spelling names the same stream) and refuses
# ids over 128 characters or with control characters; the page applies the same rules, so
# it never stays blank, with no status line, for an id the server would fold or refuse.


@pytest.mark.anyio
async def test_page_shows_the_stream_whatever_its_unicode_spelling(translator: Translator) -> None:
    import unicodedata

    from websockets.asyncio.client import connect

    nfc = "café-Zürich"
    nfd = unicodedata.normalize("NFD", nfc)
    assert nfd != nfc
    async with serving(translator) as server, async_api.async_playwright() as playwright:
        browser = await launch(playwright)
        page = await browser.new_page()
        await page.goto(f"{server.url}?stream={nfd}")  # as a user might type or paste it
        await page.wait_for_selector("body[data-state=open]")
        with anyio.fail_after(5):
            while server.role_counts()["viewer"] != 1:
                await anyio.sleep(0.01)
        async with connect(f"ws://127.0.0.1:{server.port}/ws") as writer:
            await writer.send(message(0, 0, "Tom reads a book", True).replace('"s1"', f'"{nfd}"'))
            while not (update := json.loads(await writer.recv()))["is_final"]:
                pass
        assert update["stream_id"] == nfc  # the server's one spelling
        want = [[update["stable_text"], ""]]
        assert await wait_for_lines(page, want) == want
        await browser.close()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("stream", "why"),
    [
        ("x" * 129, "129 characters long; the limit is 128"),
        ("a%00b", "unprintable character U+0000"),
        ("a%E2%80%8Bb", "unprintable character U+200B"),  # a zero-width space
    ],
)
async def test_page_names_a_stream_id_the_server_would_refuse(
    translator: Translator, stream: str, why: str
) -> None:
    async with serving(translator) as server, async_api.async_playwright() as playwright:
        browser = await launch(playwright)
        page = await browser.new_page()
        await page.goto(f"{server.url}?stream={stream}")
        await page.wait_for_selector("body[data-state=refused]", timeout=10000)
        assert await page.is_visible("#status")
        note = await page.text_content("#status") or ""
        assert "cannot show this stream" in note.lower() and why in note, note
        await anyio.sleep(0.3)
        assert server.role_counts()["viewer"] == 0  # it never subscribed
        await browser.close()


@pytest.mark.anyio
async def test_page_shows_a_refused_subscribe_and_stops_retrying(
    translator: Translator,
) -> None:
    """A subscribe the server refuses (here: anyone may write but watching needs the
    viewer token) is said on the page, visibly, instead of a blank screen."""
    async with (
        serving(translator, viewer_token="v") as server,
        async_api.async_playwright() as playwright,
    ):
        browser = await launch(playwright)
        page = await browser.new_page()
        await page.goto(f"{server.url}?stream=s1")
        await page.wait_for_selector("body[data-state=refused]", timeout=10000)
        assert await page.is_visible("#status")
        assert "viewer token" in (await page.text_content("#status") or "")
        await browser.close()
