"""`replay --html`: a self-contained report that opens in a browser and shows the replay.

Rendered in Debian's headless Chromium through Playwright (never a downloaded browser);
skipped without them. The screenshot is left in the test's tmp dir to look at.

It is read by people who have not read the metrics papers: every number says
what it means where it is shown, nothing reads "None", segments are named by what was
said, and a long log stays short: a summary first, each segment's timeline on demand.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest

from engine.cli.main import main
from engine.evaluation.html_report import EXPLAIN, SUMMARY, render, segment_timeline
from engine.evaluation.metrics import SegmentTrace, UpdatePoint
from engine.evaluation.report import build_report
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


def visible_text(page: str) -> str:
    """The page's text as a browser shows it (no style sheet, no tags)."""
    body = re.sub(r"<style>.*?</style>", "", page, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", body))


def test_every_number_says_what_it_means(report: Path) -> None:
    page = report.read_text(encoding="utf-8")
    table = re.search(r"<table class='numbers'>(.*?)</table>", page, re.S)
    assert table is not None
    rows = re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td><td class='why'>(.*?)</td></tr>", table[1])
    assert len(rows) == len(EXPLAIN) == 28
    for name, value, why in rows:
        assert why and why == html.escape(EXPLAIN[html.unescape(name)]), name
        assert value and value != "-", name  # undefined ones read "n/a"
    for name in SUMMARY:  # the summary's cards: value and meaning
        assert f"<small>{html.escape(name)}</small><b>" in page


def test_no_none_and_settings_in_words(report: Path) -> None:
    text = visible_text(report.read_text(encoding="utf-8"))
    assert "None" not in text
    assert "max new tokens: the model's length limit" in " ".join(text.split())
    assert "speed:" not in text  # fast mode: no speed-up to speak of


def test_segments_are_named_by_what_was_said(report: Path) -> None:
    page = report.read_text(encoding="utf-8")
    summaries = re.findall(r"<details class='segment'><summary>(.*?)</summary>", page, re.S)
    updates = [json.loads(line) for line in report.with_suffix(".jsonl").open(encoding="utf-8")]
    finals = [u for u in updates if u["is_final"]]
    assert len(summaries) == len(finals) == 40
    for summary, final in zip(summaries, finals, strict=True):
        text = html.unescape(re.sub(r"<[^>]+>", "", summary))
        assert text.startswith(f"{final['source_text']} → {final['stable_text']}"), text
        assert "segment" not in text.split("→")[0]
    # what went wrong shows without opening anything
    assert "units taken back" in page and "final revised the stable text" in page


def trace(audio_end_ms: float, final_ms: float) -> SegmentTrace:
    updates = [
        UpdatePoint("Tom", "汤姆", "", False, 400.0, 420.0),
        UpdatePoint("Tom reads", "汤姆看", "汤姆", False, 800.0, 820.0),
        UpdatePoint("Tom reads a book", "汤姆看书", "汤姆看书", True, final_ms - 10, final_ms),
    ]
    return SegmentTrace(updates, 0.0, audio_end_ms, "en", "zh", stream_id="s1")


def test_speech_ends_label_stays_inside_the_chart() -> None:
    """Right of its line when there is room, left of it (anchored at its end) when speech
    ends near the chart's right edge, as it does when the final follows at once."""
    early = segment_timeline(trace(1000.0, 3000.0), "en", "zh")
    late = segment_timeline(trace(9900.0, 10000.0), "en", "zh")
    label = r'<text class="speech-ends" x="([\d.]+)"( text-anchor="end")? '
    ((x, anchor),) = re.findall(label, early)
    assert anchor == "" and float(x) + 70 <= 850
    ((x, anchor),) = re.findall(label, late)
    assert anchor == ' text-anchor="end"' and float(x) <= 850


def test_settings_that_apply_are_shown() -> None:
    traces = [trace(1000.0, 3000.0)]
    page = render(
        build_report(traces),
        traces,
        {"mode": "realtime", "speed": 2.0, "max_new_tokens": 40, "beam_size": 1},
    )
    text = " ".join(visible_text(page).split())
    assert "speed: 2.0" in text and "max new tokens: 40" in text and "beam: 1" in text
    assert "BLEU</small>" not in page  # no references: no card, and n/a in the table
    assert "<td>BLEU</td><td>n/a</td>" in page


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
        # 40 segments closed: about two screens, not the 12,900 px of one chart each
        height = await page.evaluate("document.documentElement.scrollHeight")
        assert height < 4000, height
        await page.evaluate("document.querySelectorAll('details').forEach(d => d.open = true)")
        assert await page.evaluate("document.documentElement.scrollHeight") > 3 * height
        clipped = await page.evaluate(
            """() => [...document.querySelectorAll('svg.timeline')].filter(svg => {
                const box = svg.querySelector('text.speech-ends').getBBox();
                return box.x < 0 || box.x + box.width > svg.width.baseVal.value;
            }).length"""
        )
        assert clipped == 0
        await browser.close()
    assert (tmp_path / "report.png").stat().st_size > 10_000
