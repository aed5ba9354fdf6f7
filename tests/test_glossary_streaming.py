"""Glossaries through the streaming session, the embedding API and the CLI: a term shows
in the first update after its source completes and stays; a term the model has not
reached is shown but not committed; finals equal `translate` with the same glossary; one
glossary per target language; `translate`/`replay --glossary` and their bad files."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect

from engine.cli.main import main
from engine.decoding.targets import Targets
from engine.decoding.translator import Translator
from engine.evaluation.terms import term_accuracy
from engine.glossary import Glossary, GlossaryError
from engine.server.app import ServerOptions, SubtitleServer
from engine.server.limits import Limits
from engine.streaming.controller import IncrementalTranslator
from engine.streaming.session import StreamSession
from protocol import PartialTranscript, TranslationUpdate
from tests.conftest import FIXTURE_MODEL, needs_fixture, partial_message
from tests.live_server import http_get, until_final, ws_url

ZH = Glossary.parse("en\tzh\nEmma\t爱丽丝\nwater\t果汁\n")
DE = Glossary.parse("en\tde\nEmma\tAlice\ntea\n")


@pytest.fixture(scope="module")
def zh() -> Iterator[Translator]:
    needs_fixture()
    tr = Translator.from_dir(FIXTURE_MODEL)
    yield tr
    tr.close()


def words(session: StreamSession, text: str, segment: int = 0) -> list[TranslationUpdate]:
    """`text` one word at a time (a space after each but the last), then its final."""
    out = []
    parts = text.split()
    for n in range(1, len(parts) + 1):
        partial = " ".join(parts[:n]) + (" " if n < len(parts) else "")
        update = session.answer(PartialTranscript("s", segment, n - 1, partial, is_final=False))
        if update is not None:
            out.append(update)
    final = session.answer(PartialTranscript("s", segment, len(parts), text, is_final=True))
    assert final is not None
    return [*out, final]


def test_a_term_not_reached_yet_is_shown_not_committed(zh: Translator) -> None:
    session = StreamSession("s", zh, glossary=ZH)
    updates = words(session, "We want to wait for Emma at the hotel on Thursday")
    after = [u for u in updates if (u.source_text or "").startswith("We want to wait for Emma")]
    first = after[0]  # the first update after "Emma " completed
    assert "爱丽丝" in first.stable_text + first.unstable_text
    assert "爱丽丝" not in first.stable_text  # the model has not reached the name yet
    for before, later in itertools.pairwise(updates):
        assert later.stable_text.startswith(before.stable_text)  # never retracted
    final = updates[-1]
    assert final.stable_text == zh.translate([final.source_text or ""], glossary=ZH)[0].text
    assert "艾玛" not in updates[-1].stable_text and not updates[-1].revised
    assert (session.terms_matched, session.terms_placed) == (1, 1)


def test_no_term_stream_is_unchanged(zh: Translator) -> None:
    text = "Lucy wants to meet Jack on the train"
    plain = words(StreamSession("s", zh), text)
    with_glossary = words(StreamSession("s", zh, glossary=ZH), text)
    strip = [(u.stable_text, u.unstable_text, u.is_final) for u in plain]
    assert strip == [(u.stable_text, u.unstable_text, u.is_final) for u in with_glossary]


def test_partials_with_a_term_cost_no_more_decoder_steps(zh: Translator) -> None:
    """The prefix-trained fixture ends a partial where its safe part ends, before a term's
    place: the term goes in there and the output ends after it, in no decoder step (a
    step for each later token of the term and one for eos cost these partials 1-2 steps
    each, about 14% of the streamed held-out set's steps; docs/glossaries.md, Cost). The
    terms' renderings are decoded (once per term) before the count."""
    glossary = Glossary.parse("en\tzh\nTom\t杰克\nbeer\t牛奶\nMary\t莉莉\n")
    texts = ["Tom reads a book in the library", "I drink beer on Monday", "Does Mary drink water"]

    def steps(g: Glossary | None) -> list[int]:
        counts = []
        for text in texts:
            session = StreamSession("s", zh, glossary=g)
            before = zh.scheduler.stats["decoder_steps"]
            parts = text.split()
            for n in range(1, len(parts)):  # partials only
                partial = " ".join(parts[:n]) + " "
                session.answer(PartialTranscript("s", 0, n - 1, partial, is_final=False))
            counts.append(zh.scheduler.stats["decoder_steps"] - before)
        return counts

    steps(glossary)  # the renderings
    plain, with_terms = steps(None), steps(glossary)
    assert all(g <= p for g, p in zip(with_terms, plain, strict=True)), (with_terms, plain)


def test_term_accuracy_counts() -> None:
    def up(seq: int, text: str, stable: str, unstable: str, final: bool) -> TranslationUpdate:
        return TranslationUpdate("s", 0, seq, stable, unstable, final, 0.0, 0.0, source_text=text)

    updates = [
        up(0, "Emma", "", "艾玛", False),  # not complete yet: not counted
        up(1, "Emma drinks ", "", "爱丽丝", False),  # shown at once
        up(2, "Emma drinks water", "爱丽丝", "喝水", False),  # water not complete
        up(3, "Emma drinks water", "爱丽丝喝水", "", True),  # final: water not placed
    ]
    acc = term_accuracy(updates, ZH, "zh")
    assert (acc.partial_matched, acc.partial_shown_first) == (1, 1)
    assert (acc.final_matched, acc.final_placed, acc.stable_revisions) == (2, 1, 0)


@pytest.mark.anyio
async def test_incremental_translator_one_glossary_per_language(german: Path) -> None:
    targets = Targets.load([FIXTURE_MODEL, german])
    try:
        with pytest.raises(GlossaryError, match="two glossaries into 'zh'"):
            IncrementalTranslator(targets, glossaries=[ZH, ZH])
        with pytest.raises(GlossaryError, match="into 'fr', but the models translate into zh, de"):
            IncrementalTranslator(targets, glossaries=[Glossary.parse("en\tfr\nTom\tThomas\n")])
        text = "Emma drinks tea with water"
        async with IncrementalTranslator(targets, glossaries=[ZH, DE]) as nmt:
            sub = nmt.updates("s")
            await nmt.push(PartialTranscript("s", 0, 0, text, is_final=True))
            await nmt.close_stream("s")
            replies: list[Any] = [r async for r in sub]
        finals = {r.lang: r.stable_text for r in replies if isinstance(r, TranslationUpdate)}
        assert finals["zh"] == targets["zh"].translate([text], glossary=ZH)[0].text
        assert finals["de"] == targets["de"].translate([text], glossary=DE)[0].text
        assert "爱丽丝" in finals["zh"] and "果汁" in finals["zh"]
        assert "Alice" in finals["de"] and "tea" in finals["de"]
    finally:
        targets.close()


def test_cli_translate_and_replay_with_a_glossary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    needs_fixture()
    good = tmp_path / "terms.tsv"
    good.write_text("en\tzh\nTom\t杰克\nbook\t报纸\n", encoding="utf-8")
    model = str(FIXTURE_MODEL)
    assert main(["translate", "--model", model, "--glossary", str(good), "Tom reads a book"]) == 0
    assert "杰克" in capsys.readouterr().out
    bad = tmp_path / "bad.tsv"
    bad.write_text("en\tzh\nTom\t杰克\nbook\n\tx\n", encoding="utf-8")
    assert main(["translate", "--model", model, "--glossary", str(bad), "Tom"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {bad}:4: empty source term"
    unwritable = tmp_path / "unwritable.tsv"
    unwritable.write_text("en\tzh\nbook\t书籍\n", encoding="utf-8")
    assert main(["translate", "--model", model, "--glossary", str(unwritable), "x"]) == 2
    assert "target '书籍': the model cannot write '籍'" in capsys.readouterr().err
    log = Path(__file__).resolve().parent.parent / "examples/logs/fixture_en_zh.jsonl"
    report = tmp_path / "report.json"
    args = ["replay", "--model", model, "--glossary", str(good), str(log)]
    assert main([*args, "--out", str(tmp_path / "u.jsonl"), "--report", str(report)]) == 0
    table = capsys.readouterr().err
    assert "glossary terms placed" in table
    terms = json.loads(report.read_text(encoding="utf-8"))["terms"]
    assert terms["final_matched"] > 0 and terms["final_share"] == 1.0
    assert terms["stable_revisions"] == 0


@pytest.mark.anyio
async def test_served_streams_place_the_glossary_and_metrics_count_the_terms(
    zh: Translator,
) -> None:
    glossary = Glossary.parse("en\tzh\nTom\t杰克\nbook\t报纸\n")
    text = "Tom reads a book in the library"
    parts = text.split()
    async with (
        IncrementalTranslator(zh, glossaries=glossary) as nmt,
        SubtitleServer(nmt, ServerOptions(port=0, limits=Limits(rate_limit=None))) as server,
    ):
        async with connect(ws_url(server)) as ws:
            for n in range(1, len(parts)):
                partial = " ".join(parts[:n]) + " "
                await ws.send(partial_message("s1", n - 1, partial, final=False))
            await ws.send(partial_message("s1", len(parts), text, final=True))
            replies = await until_final(ws)
        metrics = (await http_get(server, "/metrics")).body
    final = replies[-1]
    assert final["stable_text"] == zh.translate([text], glossary=glossary)[0].text
    assert "杰克" in final["stable_text"] and "报纸" in final["stable_text"]
    assert 'nmt_engine_events_total{kind="terms_matched"} 2.0' in metrics
    assert 'nmt_engine_events_total{kind="terms_placed"} 2.0' in metrics


def test_serve_refuses_a_bad_glossary_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.tsv"
    bad.write_text("Tom\t杰克\n", encoding="utf-8")
    assert main(["serve", "--model", str(FIXTURE_MODEL), "--glossary", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {bad}:1: the first line must name the languages")
