"""Fan-out: one source stream translated into several target languages at once.

The second language is the committed English -> German fixture (`models/fixture_de`,
trained by the same pipeline on the same English grammar), so each language translates for
real: each language's final must equal its own model's offline translation, and each
viewer must get only its language.
"""

from __future__ import annotations

import itertools
import json
import re
import signal
import threading
import urllib.request
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import anyio
import pytest
from websockets.asyncio.client import ClientConnection, connect

from engine.cli.main import main
from engine.decoding.targets import Targets, model_share
from engine.decoding.translator import Translator
from engine.errors import ModelLoadError
from engine.logs.make import generate_log
from engine.model.layouts import EncoderOutput
from engine.replies import Reply
from engine.server.app import ServerOptions, SubtitleServer
from engine.server.limits import Limits
from engine.server.recorder import record
from engine.streaming.controller import IncrementalTranslator
from engine.streaming.session import StreamingOptions
from protocol import ErrorMessage, InvalidEvent, PartialTranscript, TranslationUpdate
from tests.conftest import FIXTURE_DIR, FIXTURE_MODEL, needs_fixture, relabel, serving, wait_for
from tests.live_server import SENTENCE, recv, send_sentence, ws_url
from tests.test_streaming import check_segments, events_of


@pytest.fixture(scope="module")
def targets(german: Path) -> Targets:
    """English -> zh (the fixture) and -> de (the German fixture), zh first: the default."""
    return Targets.load([FIXTURE_MODEL, german])


@pytest.fixture(scope="module")
def sentences() -> list[str]:
    rows = (FIXTURE_DIR / "heldout.tsv").read_text(encoding="utf-8").splitlines()
    return [row.split("\t")[0] for row in rows if row.strip()][:8]


async def collect(sub: Any) -> list[Reply]:
    return [reply async for reply in sub]


def updates_in(replies: Sequence[Reply], lang: str) -> list[TranslationUpdate]:
    return [r for r in replies if isinstance(r, TranslationUpdate) and r.lang == lang]


# --- the set of models -------------------------------------------------------------------


def test_models_are_keyed_by_target_language_and_checked_at_start(
    targets: Targets, tmp_path: Path
) -> None:
    assert targets.languages == ["zh", "de"] and targets.default == "zh"
    assert targets.source_lang == "en"
    assert targets.find("zh-Hans") == "zh" and targets.find("de") == "de"
    assert targets.find("fr") is None
    zh = targets["zh"]
    with pytest.raises(ModelLoadError, match="both translate into 'zh'"):
        Targets([zh, zh])
    from_fr = Translator.from_dir(relabel(tmp_path / "fr-de", source_lang="fr", target_lang="de"))
    with pytest.raises(ModelLoadError, match=r"translates from 'en' but .* from 'fr'"):
        Targets([zh, from_fr])
    unknown = relabel(tmp_path / "unknown", target_lang="")
    tokenizer_config = json.loads((unknown / "tokenizer_config.json").read_text("utf-8"))
    tokenizer_config.pop("target_lang", None)  # the other place a model says it
    (unknown / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), "utf-8")
    unlabelled = Translator.from_dir(unknown)
    with pytest.raises(ModelLoadError, match="cannot tell which language"):
        Targets([zh, unlabelled])
    assert Targets([unlabelled]).languages == ["und"]  # alone, it needs no label


def test_the_models_split_the_cores_instead_of_oversubscribing(targets: Targets) -> None:
    """Each model has its own scheduler; together they run at most one call per core."""
    import os

    cores = os.cpu_count() or 1
    calls = sum(t.scheduler.lanes * t.scheduler.threads_per_lane for t in targets.values())
    assert calls <= max(cores, len(targets))
    assert all(t.scheduler.options.cores == model_share(None, 2) for t in targets.values())


def test_a_model_that_fails_to_load_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match=f"cannot load model '{re.escape(str(missing))}'"):
        Targets.load([FIXTURE_MODEL, missing])


# --- the embedding API -------------------------------------------------------------------


@pytest.mark.anyio
async def test_one_stream_two_languages_each_with_its_guarantees(
    targets: Targets, sentences: list[str]
) -> None:
    events = events_of(generate_log(sentences, "en", stream_id="s1", seed=5))
    finals = [e.seq for e in events if e.is_final]
    async with IncrementalTranslator(targets) as nmt:
        every = nmt.updates("s1")
        only_zh = nmt.updates("s1", lang="zh-Hans")  # a page's tag names the zh model
        only_de = nmt.updates("s1", lang="de")
        with pytest.raises(InvalidEvent) as refused:
            nmt.updates("s1", lang="fr")
        assert refused.value.error.field == "lang" and "zh, de" in refused.value.error.message
        for event in events:  # the source is pushed once, for both languages
            await nmt.push(event)
        await nmt.close_stream("s1")
        replies = {"every": await collect(every)}
        replies |= {"zh": await collect(only_zh), "de": await collect(only_de)}
    assert not [r for r in replies["every"] if isinstance(r, ErrorMessage)]
    assert {r.lang for r in replies["every"] if isinstance(r, TranslationUpdate)} == {"zh", "de"}
    for lang in ("zh", "de"):
        # A viewer of one language gets that language only.
        assert replies[lang] and all(r.lang == lang for r in replies[lang])
        mine = updates_in(replies["every"], lang)
        # Stable text only grows, the final is this language's model's offline
        # translation, and every final transcript gets exactly one final update.
        check_segments(mine, targets[lang])
        assert [u.seq for u in mine if u.is_final] == finals
        assert [u for u in replies[lang] if u.is_final] == [u for u in mine if u.is_final]


@pytest.mark.anyio
async def test_a_language_that_fails_answers_each_final_with_an_error_naming_it(
    targets: Targets, monkeypatch: pytest.MonkeyPatch
) -> None:
    de = targets["de"]
    submit = de.submit  # the engine submits its decodes and awaits their futures

    def fail_finals(enc: EncoderOutput, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("prefixes") is None:  # finals decode without a committed prefix
            raise RuntimeError("the German decoder broke")
        return submit(enc, *args, **kwargs)

    monkeypatch.setattr(de, "submit", fail_finals)
    async with IncrementalTranslator(targets) as nmt:
        writer = nmt.updates("s1")
        viewer_zh = nmt.updates("s1", lang="zh")
        await nmt.push(PartialTranscript("s1", 0, 0, "I will meet Tom", False))
        await nmt.push(PartialTranscript("s1", 0, 1, SENTENCE, True))
        await nmt.push(PartialTranscript("s1", 1, 2, "Tom reads a book", True))
        await nmt.close_stream("s1")  # would raise if a final were owed twice or never
        replies = await collect(writer)
        zh_replies = await collect(viewer_zh)
        assert nmt.streams == [] and nmt.stats["errors"] == 2
    errors = [r for r in replies if isinstance(r, ErrorMessage)]
    assert [(e.code, e.seq, e.lang) for e in errors] == [("internal", n, "de") for n in (1, 2)]
    zh_finals = [u for u in updates_in(replies, "zh") if u.is_final]
    assert [u.seq for u in zh_finals] == [1, 2]  # the other language is unaffected
    assert zh_finals[0].stable_text == targets["zh"].translate([SENTENCE])[0].text
    assert not [u for u in updates_in(replies, "de") if u.is_final]
    # A zh viewer is not told about the German failure.
    assert all(isinstance(r, TranslationUpdate) and r.lang == "zh" for r in zh_replies)


@pytest.mark.anyio
async def test_one_model_keeps_the_single_language_api(targets: Targets) -> None:
    """One translator: the single-language updates (saying their language) and API."""
    async with IncrementalTranslator(targets["zh"]) as nmt:
        assert nmt.languages == ["zh"] and nmt.translator is targets["zh"]
        sub = nmt.updates("s1")
        await nmt.push(PartialTranscript("s1", 0, 0, SENTENCE, True))
        await nmt.close_stream("s1")
        (final,) = await collect(sub)
    assert isinstance(final, TranslationUpdate) and final.lang == "zh"
    assert final.stable_text == targets["zh"].translate([SENTENCE])[0].text


@pytest.mark.anyio
async def test_recorder_writes_one_file_per_language(targets: Targets, tmp_path: Path) -> None:
    async with IncrementalTranslator(targets) as nmt, anyio.create_task_group() as tg:
        tg.start_soon(record, nmt, tmp_path, "srt", "RUN")
        await anyio.sleep(0.05)
        await nmt.push(PartialTranscript("talk", 0, 0, SENTENCE, True, 0.0, 1500.0))
        await nmt.close_stream("talk")
        await nmt.aclose()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["talk.RUN.1.de.srt", "talk.RUN.1.zh.srt"]
    expected = targets["zh"].translate([SENTENCE])[0].text
    assert expected in (tmp_path / "talk.RUN.1.zh.srt").read_text(encoding="utf-8")


# --- the server --------------------------------------------------------------------------


async def until_finals(ws: ClientConnection, langs: set[str]) -> list[dict[str, Any]]:
    """Messages received until a final update in each of `langs`."""
    seen: list[dict[str, Any]] = []
    missing = set(langs)
    while missing:
        message = await recv(ws)
        seen.append(message)
        if message["type"] == "translation_update" and message["is_final"]:
            missing.discard(message["lang"])
    return seen


@pytest.mark.anyio
async def test_server_viewers_get_their_language_and_the_writer_every_one(
    targets: Targets,
) -> None:
    options = ServerOptions(port=0, limits=Limits(rate_limit=None))
    async with (
        IncrementalTranslator(targets, StreamingOptions()) as nmt,
        SubtitleServer(nmt, options) as server,
        connect(ws_url(server)) as writer,
        connect(ws_url(server)) as viewer_zh,
        connect(ws_url(server)) as viewer_de,
        connect(ws_url(server)) as viewer_old,
        connect(ws_url(server)) as viewer_fr,
    ):
        subscribe = {"type": "subscribe", "stream_id": "s1"}
        await viewer_zh.send(json.dumps({**subscribe, "lang": "zh-Hans"}))
        await viewer_de.send(json.dumps({**subscribe, "lang": "de"}))
        await viewer_old.send(json.dumps(subscribe))  # a viewer that names no language
        await viewer_fr.send(json.dumps({**subscribe, "lang": "fr"}))
        error = await recv(viewer_fr)
        assert (error["code"], error["field"]) == ("invalid_message", "lang")
        assert "languages: zh, de" in error["message"]
        await wait_for(lambda: server.role_counts()["viewer"] == 3)
        await send_sentence(writer)
        written = await until_finals(writer, {"zh", "de"})
        seen = {
            "zh": await until_finals(viewer_zh, {"zh"}),
            "de": await until_finals(viewer_de, {"de"}),
            "old": await until_finals(viewer_old, {"zh"}),
        }
    assert all(m["type"] == "translation_update" for m in written)
    finals = {m["lang"]: m for m in written if m["is_final"]}
    assert finals["zh"]["stable_text"] == targets["zh"].translate([SENTENCE])[0].text
    assert finals["de"]["stable_text"] == targets["de"].translate([SENTENCE])[0].text
    for name, lang in (("zh", "zh"), ("de", "de"), ("old", "zh")):
        assert {m["lang"] for m in seen[name]} == {lang}, name
        assert seen[name][-1] == finals[lang]
        assert all(m in written for m in seen[name])  # the writer's updates, none added
    for lang in ("zh", "de"):
        stable = [m["stable_text"] for m in written if m["lang"] == lang]
        assert all(b.startswith(a) for a, b in itertools.pairwise(stable)), lang


@pytest.mark.anyio
async def test_metrics_name_every_model_and_language(targets: Targets) -> None:
    from tests.live_server import http_get

    options = ServerOptions(port=0, limits=Limits(rate_limit=None))
    async with (
        IncrementalTranslator(targets) as nmt,
        SubtitleServer(nmt, options) as server,
        connect(ws_url(server)) as writer,
    ):
        await send_sentence(writer)
        await until_finals(writer, {"zh", "de"})
        body = (await http_get(server, "/metrics")).body
    info = [line for line in body.splitlines() if line.startswith("nmt_model_info{")]
    assert len(info) == 2
    assert 'lang="zh"' in info[0] + info[1] and 'lang="de"' in info[0] + info[1]
    for lang in ("zh", "de"):
        assert f'nmt_scheduler_work_total{{kind="decoder_steps",lang="{lang}"}}' in body
        assert f'nmt_update_latency_seconds_count{{lang="{lang}"}}' in body


# --- the command line --------------------------------------------------------------------


def test_serve_refuses_to_start_when_a_model_fails_to_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    needs_fixture()
    missing = tmp_path / "missing-model"
    args = ["serve", "--model", str(FIXTURE_MODEL), "--model", str(missing), "--port", "0"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"error: cannot load model '{missing}'" in err and " ready" not in err
    same = ["serve", "--model", str(FIXTURE_MODEL), "--model", str(FIXTURE_MODEL), "--port", "0"]
    assert main(same) == 2
    assert "both translate into 'zh'" in capsys.readouterr().err


def test_serve_with_two_models_says_each_model_and_language(german: Path) -> None:
    models = ["--model", str(FIXTURE_MODEL), "--model", str(german)]
    with serving(models, ready_within=90) as served:
        text = served.text
        assert re.search(r"model: .*fixture/model \(en->zh, ", text), text
        assert re.search(r"model: .*fixture_de/model \(en->de, ", text), text
        page = re.search(r"languages: zh \(default\), de; subtitle pages: (http://\S+)", text)
        assert page, text
        assert page.group(1).endswith("?stream=demo&lang=zh,")
        with urllib.request.urlopen(page.group(1).rstrip(","), timeout=10) as response:
            assert response.status == 200
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(timeout=30) == 0


@pytest.mark.anyio
async def test_shutdown_past_its_deadline_answers_only_the_languages_still_owed(
    targets: Targets, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A final answered in zh while de still decodes, then an abort: de gets its
    `unavailable` error naming it, zh gets nothing more (one reply per language)."""
    de = targets["de"]
    submit = de.submit  # the engine submits its decodes and awaits their futures
    started, release = threading.Event(), threading.Event()

    def slow_finals(enc: EncoderOutput, *args: Any, **kwargs: Any) -> Any:
        futures = submit(enc, *args, **kwargs)
        if kwargs.get("prefixes") is not None:
            return futures
        started.set()
        held: list[Future[Any]] = [Future() for _ in futures]

        def hold() -> None:  # the final's answer comes only once released
            release.wait(10)
            for mine, theirs in zip(held, futures, strict=True):
                mine.set_result(theirs.result())

        threading.Thread(target=hold, daemon=True).start()
        return held

    monkeypatch.setattr(de, "submit", slow_finals)
    try:
        async with IncrementalTranslator(targets) as nmt:
            writer = nmt.updates("s1")
            await nmt.push(PartialTranscript("s1", 0, 0, SENTENCE, True))
            assert await anyio.to_thread.run_sync(started.wait, 10)
            with anyio.fail_after(10):
                while nmt.stats["finals"] < 1:  # zh answered
                    await anyio.sleep(0.01)
            assert nmt.abort("shutting down") == 1
            release.set()
            replies = await collect(writer)
    finally:
        release.set()
    assert [(type(r).__name__, r.lang) for r in replies] == [
        ("TranslationUpdate", "zh"),
        ("ErrorMessage", "de"),
    ]
    error = replies[1]
    assert isinstance(error, ErrorMessage) and (error.code, error.seq) == ("unavailable", 0)
