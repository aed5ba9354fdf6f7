"""`replay --html`: a self-contained report that opens in a browser and shows the replay.

Rendered in Debian's headless Chromium through Playwright (never a downloaded browser);
skipped without them. The screenshot is left in the test's tmp dir to look at.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.cli.main import main
from tests.conftest import FIXTURE_MODEL, ROOT, needs_fixture

CHROMIUM = Path("/usr/bin/chromium")
LOG = ROOT / "examples" / "logs" / "fixture_en_zh_asr.jsonl"


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    needs_fixture()
    out = tmp_path_factory.mktemp("html") / "report.html"
    refs = LOG.with_suffix(".ref.txt")
    argv = ["replay", "--model", str(FIXTURE_MODEL), str(LOG), "--references", str(refs)]
    assert main([*argv, "--out", str(out.with_suffix(".jsonl")), "--html", str(out)]) == 0
    return out


def test_report_is_self_contained(report: Path) -> None:
    page = report.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"<script|<link|src=|url\(", page)  # nothing to fetch or run
    assert page.count('class="timeline"') == 40 and page.count('class="latency"') == 1


@pytest.mark.anyio
async def test_report_renders_in_chromium(report: Path, tmp_path: Path) -> None:
    async_api = pytest.importorskip("playwright.async_api")
    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} missing (run .ci/install-browser)")
    async with async_api.async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=["--headless", "--no-sandbox", "--disable-gpu"]
        )
        page = await browser.new_page(viewport={"width": 1000, "height": 1400})
        await page.goto(report.as_uri())
        rows = await page.eval_on_selector_all(
            "table.numbers tr", "rows => rows.map(r => r.innerText.split('\\t'))"
        )
        names = {row[0] for row in rows}
        assert {"LAAL (stable, units)", "normalized erasure", "BLEU"} <= names
        box = await page.locator("svg.latency").bounding_box()
        assert box is not None and box["width"] > 500 and box["height"] > 100
        dots = await page.locator("svg.latency circle").count()
        updates = report.with_suffix(".jsonl").read_text(encoding="utf-8").splitlines()
        assert dots == len(updates) > 0  # one dot per update
        await page.locator("details summary").first.click()
        cells = await page.locator("table.updates").first.inner_text()
        assert "final" in cells
        await page.screenshot(path=str(tmp_path / "report.png"), full_page=False)
        await browser.close()
    assert (tmp_path / "report.png").stat().st_size > 10_000
