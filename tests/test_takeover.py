"""A stream id taken over after its writer left is visibly a new stream: its updates carry
another `epoch`, and the subtitle page clears the old writer's lines instead of running the
new writer's text on beneath them."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from engine.decoding.translator import Translator
from tests.conftest import partial_message, wait_for
from tests.live_server import serving, ws_url

CHROMIUM = Path("/usr/bin/chromium")


async def write_final(server: object, text: str) -> list[dict[str, object]]:
    """Open `t` on a new connection, send one final, read until its update, leave."""
    from websockets.asyncio.client import connect

    async with connect(ws_url(server)) as ws:  # type: ignore[arg-type]
        await ws.send(partial_message("t", 0, text, final=True))
        got = []
        with anyio.fail_after(20):
            while not (reply := json.loads(await ws.recv())).get("is_final"):
                got.append(reply)
        return [*got, reply]


async def stream_gone(server: object) -> None:
    engine = server.engine  # type: ignore[attr-defined]
    await wait_for(lambda: "t" not in engine.streams)


@pytest.mark.anyio
async def test_a_taken_over_stream_has_a_new_epoch(translator: Translator) -> None:
    from websockets.asyncio.client import connect

    async with serving(translator) as server, connect(ws_url(server)) as viewer:
        await viewer.send(json.dumps({"type": "subscribe", "stream_id": "t"}))
        await wait_for(lambda: server.role_counts()["viewer"] == 1)
        first = await write_final(server, "Tom reads a book")
        await stream_gone(server)
        second = await write_final(server, "I will meet Tom at three")
        seen = []
        with anyio.fail_after(20):
            while len([m for m in seen if m.get("is_final")]) < 2:
                seen.append(json.loads(await viewer.recv()))
    epochs_first = {m["epoch"] for m in first}
    epochs_second = {m["epoch"] for m in second}
    assert len(epochs_first) == len(epochs_second) == 1 and epochs_first != epochs_second
    assert [m["epoch"] for m in seen if m.get("is_final")] == [*epochs_first, *epochs_second]


@pytest.mark.anyio
async def test_the_page_clears_the_old_writers_lines_on_a_takeover(
    translator: Translator,
) -> None:
    async_api = pytest.importorskip("playwright.async_api")
    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} missing (run .ci/install-browser)")
    read = "() => [...document.querySelectorAll('#subtitles .line')].map(l => l.textContent)"
    async with serving(translator) as server, async_api.async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=["--headless", "--no-sandbox", "--disable-gpu"]
        )
        page = await browser.new_page()
        await page.goto(f"{server.url}?stream=t&lines=3")
        await page.wait_for_selector("body[data-state=open]")
        await wait_for(lambda: server.role_counts()["viewer"] == 1)
        first = (await write_final(server, "Tom reads a book"))[-1]["stable_text"]
        await page.wait_for_function(f"() => ({read})().length === 1")
        assert await page.evaluate(read) == [first]
        await stream_gone(server)
        second = (await write_final(server, "I will meet Tom at three"))[-1]["stable_text"]
        await page.wait_for_function(f"(t) => ({read})().join('|') === t", arg=second)
        assert await page.evaluate(read) == [second]  # the old writer's line is gone
        assert await page.text_content("#status") == "new stream"
        await browser.close()
