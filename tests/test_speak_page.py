"""The speaker page (/speak) in headless Chromium with a fake microphone: Chromium plays a
WAV of espeak-ng speech (looped) as the microphone, the page's AudioWorklet downsamples it
to 16 kHz PCM, the server recognizes it with pocketsphinx and translates it, and a viewer
page in another tab shows the Chinese subtitles.

Uses Debian's /usr/bin/chromium through Playwright (`.ci/install-browser`); skipped without
it, pocketsphinx, espeak-ng or the fixture model. Screenshots go to /tmp/speak/.
"""

from __future__ import annotations

import contextlib
import json
import re
import wave
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from engine.decoding.translator import Translator
from engine.server.app import SubtitleServer
from engine.server.audio import AudioInput
from engine.server.connection import AUDIO_OFF
from tests.conftest import ROOT, wait_for
from tests.live_server import STREAMING, http_get, serving
from tests.test_audio_ws import RATE, SENTENCE, needs_speech, silence, spoken

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = Path("/tmp/speak")
SPEECH = ROOT / "examples" / "speech"
HAN = re.compile(r"[\u4e00-\u9fff]")

# The page's lines and the viewer's, as [translation, source] / [stable + tentative].
READ_SPEAK_LINES = """() => [...document.querySelectorAll('#lines .line')].map(line => [
    line.querySelector('.translation').textContent,
    line.querySelector('.source').textContent,
    line.classList.contains('final'),
])"""
READ_VIEWER_LINES = """() => [...document.querySelectorAll('#subtitles .line')].map(line => [
    line.querySelector('.text').textContent, line.classList.contains('final'),
])"""


def needs_browser() -> Any:
    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} missing (run .ci/install-browser)")
    return pytest.importorskip("playwright.async_api")


@pytest.fixture(scope="module")
def microphone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the fake microphone says, again and again: the sentence, then a second of
    silence (the recognizer's end of utterance), at 48 kHz like a real device."""
    needs_speech()
    from engine.asr.audio import resample

    pcm = resample(spoken(SENTENCE) + silence(1.0), RATE, 48000)
    path = tmp_path_factory.mktemp("mic") / "speech.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(48000)
        w.writeframes(pcm)
    return path


@pytest.fixture(scope="module")
def sphinx() -> AudioInput:
    needs_speech()
    from engine.asr.sphinx import SphinxOptions
    from engine.server.audio import pocketsphinx_input

    return pocketsphinx_input(
        SphinxOptions(language_model=SPEECH / "fixture.lm.gz", dictionary=SPEECH / "fixture.dict")
    )


@contextlib.asynccontextmanager
async def chromium(microphone: Path) -> AsyncIterator[Any]:
    """A browser whose microphone plays `microphone` (and asks nobody's permission)."""
    async_api = needs_browser()
    args = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--use-fake-ui-for-media-stream",  # grant the microphone without a prompt
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={microphone}",
        "--autoplay-policy=no-user-gesture-required",
    ]
    async with async_api.async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=args, headless=True
        )
        try:
            yield browser
        finally:
            await browser.close()


async def wait_until(page: Any, script: str, arg: Any = None, timeout: float = 30.0) -> None:
    await page.wait_for_function(script, arg=arg, timeout=timeout * 1000)


async def screenshot(page: Any, name: str, tmp_path: Path) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=str(tmp_path / name))
    (SCREENSHOTS / name).write_bytes((tmp_path / name).read_bytes())


def writers(server: SubtitleServer) -> list[Any]:
    """The server's connections streaming audio (to drop one, as a network would)."""
    return [client for client in server._clients if client.feed is not None]


@pytest.mark.anyio
async def test_the_speaker_page_speaks_into_a_stream_that_viewers_see_translated(
    translator: Translator, microphone: Path, sphinx: AudioInput, tmp_path: Path
) -> None:
    expected = translator.translate([SENTENCE], STREAMING.decode)[0].text
    assert HAN.search(expected)
    async with (
        serving(translator, audio=sphinx, token="wr1te", viewer_token="v1ew") as server,
        chromium(microphone) as browser,
    ):
        context = await browser.new_context(viewport={"width": 1100, "height": 620})
        viewer = await context.new_page()
        await viewer.goto(f"{server.url}?stream=demo&token=v1ew&lines=2")
        await viewer.wait_for_selector("body[data-state=open]")
        speaker = await context.new_page()
        errors: list[str] = []
        speaker.on("pageerror", lambda error: errors.append(str(error)))
        await speaker.goto(f"{server.url}speak?stream=demo&token=wr1te")
        await speaker.wait_for_selector("#start:not([disabled])")  # /info: it takes audio
        assert "Press Start and speak" in (await speaker.text_content("#status") or "")
        assert await speaker.is_disabled("#stop")
        await speaker.click("#start")
        await speaker.wait_for_selector("body[data-state=listening]")
        assert await speaker.is_disabled("#start") and not await speaker.is_disabled("#stop")
        # The level meter moves with the speech.
        level = "() => parseFloat(document.getElementById('level').style.width) > 20"
        await wait_until(speaker, level)
        # What was heard, with its translation; the viewer shows the same translation.
        await wait_until(
            speaker,
            f"(want) => ({READ_SPEAK_LINES})()"
            ".some(l => l[0] === want[0] && l[1] === want[1] && l[2])",
            [expected, SENTENCE.lower()],
        )
        await wait_until(
            viewer,
            f"(want) => ({READ_VIEWER_LINES})().some(l => l[0] === want && l[1])",
            expected,
        )
        await screenshot(speaker, "speak.png", tmp_path)
        await screenshot(viewer, "viewer.png", tmp_path)
        shown = await viewer.evaluate(READ_VIEWER_LINES)
        assert all(HAN.search(text) for text, _ in shown), shown  # Chinese subtitles only

        # A dropped connection: the page reconnects and starts its audio stream again.
        (client,) = writers(server)
        client.ws.transport.abort()
        await speaker.wait_for_selector("body[data-state=closed]", timeout=10_000)
        assert "reconnecting" in (await speaker.text_content("#status") or "")
        await speaker.wait_for_selector("body[data-state=listening]", timeout=15_000)
        await wait_for(lambda: len(writers(server)) == 1 and writers(server)[0] is not client)
        lines_before = len(await speaker.evaluate(READ_SPEAK_LINES))
        await wait_until(
            speaker,
            f"(n) => ({READ_SPEAK_LINES})().filter(l => l[2]).length > 0 && "
            f"({READ_SPEAK_LINES})().length > n",
            lines_before,
        )

        # Stop: the audio stream ends (the server's slot is free), the microphone closes.
        await speaker.click("#stop")
        assert await speaker.get_attribute("body", "data-state") == "stopped"
        assert "press Start to speak again" in (await speaker.text_content("#status") or "")
        await wait_for(lambda: server.state.audio.held == 0)
        with anyio.fail_after(5):
            while writers(server):
                await anyio.sleep(0.05)
        assert errors == []


@pytest.mark.anyio
async def test_info_says_whether_the_server_takes_audio(translator: Translator) -> None:
    from tests.test_audio_ws import meeting_tom, scripted_input

    async with serving(translator) as server:
        answer = await http_get(server, "/info")
    assert answer.status == 200 and answer.headers["Content-Type"] == "application/json"
    info = json.loads(answer.body)
    assert info["audio"] is False and info["languages"] == ["zh"] and info["source"] == "en"
    assert info["no_audio"] == AUDIO_OFF  # what start_audio would be answered
    async with serving(translator, audio=scripted_input(meeting_tom())) as server:
        info = json.loads((await http_get(server, "/info")).body)
    assert info == {"languages": ["zh"], "source": "en", "audio": True}


@pytest.mark.anyio
async def test_the_speaker_page_says_before_start_when_a_server_takes_no_audio(
    translator: Translator, microphone: Path, tmp_path: Path
) -> None:
    async with serving(translator) as server, chromium(microphone) as browser:
        page = await browser.new_page(viewport={"width": 1100, "height": 300})
        sockets: list[str] = []
        page.on("websocket", lambda ws: sockets.append(ws.url))
        await page.goto(f"{server.url}speak?stream=demo")
        await page.wait_for_selector("body[data-state=refused]", timeout=15_000)
        status = await page.text_content("#status") or ""
        assert status.count("takes no audio") == 1 and "--asr pocketsphinx" in status
        assert await page.is_disabled("#start") and await page.is_disabled("#stop")
        assert sockets == []  # nothing asked of the microphone nor of the WebSocket
        await screenshot(page, "speak-refused.png", tmp_path)
        # A server that does not answer /info (a proxy in between): start_audio's refusal
        # says the same, once.
        await page.route("**/info", lambda route: route.fulfill(status=404, body="no"))
        await page.reload()
        await page.click("#start")
        await page.wait_for_selector("body[data-state=refused]", timeout=15_000)
        status = await page.text_content("#status") or ""
        assert status.count("takes no audio") == 1 and "--asr pocketsphinx" in status
        assert not await page.is_disabled("#start") and await page.is_disabled("#stop")
        await page.unroute("**/info")
        # A stream id the server would refuse is named before anything is sent.
        await page.goto(f"{server.url}speak?stream=" + "x" * 129)
        status = await page.text_content("#status") or ""
        assert "stream_id is 129 characters long" in status
        assert await page.is_disabled("#start")


@pytest.mark.anyio
async def test_the_speaker_page_starts_again_after_the_recognizer_fails(
    translator: Translator, microphone: Path
) -> None:
    """A recognizer that raises ends the audio stream with an `internal` error: the page
    says so and starts a new one (a recognizer failing again at once is given up on)."""
    from tests.test_audio_ws import Scripted, said, scripted_input

    expected = translator.translate([SENTENCE], STREAMING.decode)[0].text
    failing = Scripted([], fail_after=1)
    fresh = Scripted([(8000, said(SENTENCE.lower(), True))])
    async with (
        serving(translator, audio=scripted_input(failing, fresh)) as server,
        chromium(microphone) as browser,
    ):
        page = await browser.new_page(viewport={"width": 1100, "height": 400})
        await page.goto(f"{server.url}speak?stream=demo")
        await page.click("#start")
        await page.wait_for_function(
            "() => document.getElementById('status').textContent.includes('recognizer failed')",
            timeout=15_000,
        )
        await wait_until(
            page, f"(want) => ({READ_SPEAK_LINES})().some(l => l[0] === want && l[2])", expected
        )
        assert await page.get_attribute("body", "data-state") == "listening"
        assert server.state.audio.held == 1
        # What was heard above its translation, as the subtitle page's ?source=1 has it.
        above = await page.evaluate(
            """() => [...document.querySelectorAll('#lines .line')].map(line =>
                line.querySelector('.source').getBoundingClientRect().bottom
                <= line.querySelector('.translation').getBoundingClientRect().top + 1)"""
        )
        assert above and all(above), above


READ_GLOSSARY_STATUS = "() => document.getElementById('glossary-status').textContent"


@pytest.mark.anyio
async def test_the_speaker_page_gives_its_stream_a_glossary_and_again_after_a_drop(
    translator: Translator, microphone: Path, tmp_path: Path
) -> None:
    """The glossary typed on the page (its languages' line from /info, Tab between the
    columns) goes as set_glossary ahead of start_audio, on the first connection and on the
    one after a drop; its acknowledgement shows, the translation places the term; a file
    replaces it; a refused one is said under the box and the audio goes on."""
    from tests.test_audio_ws import Scripted, said, scripted_input

    assert "爱丽丝" not in translator.translate([SENTENCE], STREAMING.decode)[0].text
    heard = [Scripted([(8000, said(SENTENCE.lower(), True))]) for _ in range(3)]
    async with (
        serving(translator, audio=scripted_input(*heard)) as server,
        chromium(microphone) as browser,
    ):
        page = await browser.new_page(viewport={"width": 1100, "height": 700})
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        sent: list[list[dict[str, Any]]] = []  # per connection, the JSON frames sent

        def on_socket(ws: Any) -> None:
            frames: list[dict[str, Any]] = []
            sent.append(frames)
            ws.on(
                "framesent",
                lambda data: frames.append(json.loads(data)) if isinstance(data, str) else None,
            )

        page.on("websocket", on_socket)
        await page.goto(f"{server.url}speak?stream=demo")
        await page.wait_for_selector("#start:not([disabled])")
        assert await page.text_content("#glossary-note") == "(en \u2192 zh)"
        await page.click("#glossary-panel summary")
        await page.focus("#glossary")  # an empty box starts with the languages' line
        assert await page.input_value("#glossary") == "en\tzh\n"
        await page.keyboard.type("Tom")
        await page.keyboard.press("Tab")  # types the column separator
        await page.keyboard.type("爱丽丝")
        assert await page.input_value("#glossary") == "en\tzh\nTom\t爱丽丝"
        await page.click("#start")
        await wait_until(page, f"() => ({READ_GLOSSARY_STATUS})().includes('1 term into zh')")
        placed = f"() => ({READ_SPEAK_LINES})().some(l => l[0].includes('爱丽丝') && l[2])"
        await wait_until(page, placed)
        # How it did so far, from the server's /terms: Tom, matched and placed.
        await wait_until(page, f"() => ({READ_GLOSSARY_STATUS})().endsWith('1 matched, 1 placed.')")
        assert [m["type"] for m in sent[0][:2]] == ["set_glossary", "start_audio"]
        assert sent[0][0]["glossary"] == "en\tzh\nTom\t爱丽丝"
        assert sent[0][0]["stream_id"] == "demo"
        await screenshot(page, "speak-glossary.png", tmp_path)

        # A drop: the new connection sends the glossary again before its audio.
        (client,) = writers(server)
        client.ws.transport.abort()
        await page.wait_for_selector("body[data-state=listening]", timeout=15_000)
        await wait_for(lambda: len(sent) == 2 and len(sent[1]) >= 2)
        assert [m["type"] for m in sent[1][:2]] == ["set_glossary", "start_audio"]
        assert sent[1][0]["glossary"] == sent[0][0]["glossary"]
        await wait_until(page, f"() => ({READ_GLOSSARY_STATUS})().includes('1 term into zh')")

        # A file replaces it, sent at once.
        await page.set_input_files(
            "#glossary-file",
            files=[
                {
                    "name": "terms.tsv",
                    "mimeType": "text/tab-separated-values",
                    "buffer": "en\tzh\nTom\t爱丽丝\nbook\t报纸\n".encode(),
                }
            ],
        )
        await wait_until(page, f"() => ({READ_GLOSSARY_STATUS})().includes('2 terms into zh')")
        assert sent[1][-1]["type"] == "set_glossary" and "报纸" in sent[1][-1]["glossary"]

        # A bad line: the server's refusal, under the box; the page keeps listening.
        await page.fill("#glossary", "en\tzh\n\tx\n")
        await page.click("#glossary-send")
        await wait_until(page, f"() => ({READ_GLOSSARY_STATUS})().includes('glossary:2')")
        status = await page.evaluate(READ_GLOSSARY_STATUS)
        assert status.startswith("The server did not take the glossary")
        assert await page.get_attribute("#glossary-status", "class") == "problem"
        assert status.endswith("the one given before stays in use.")
        assert await page.get_attribute("body", "data-state") == "listening"
        # ... and a drop now sends the one in use, not the refused one.
        (client,) = writers(server)
        client.ws.transport.abort()
        await wait_for(lambda: len(sent) == 3 and len(sent[2]) >= 2)
        assert [m["type"] for m in sent[2][:2]] == ["set_glossary", "start_audio"]
        assert "报纸" in sent[2][0]["glossary"]
        assert errors == []
