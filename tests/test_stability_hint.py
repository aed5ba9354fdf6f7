"""The recogniser's stability hint (`PartialTranscript.stable_chars`): optional on the
wire, and when present the engine commits translation only as far as the settled source
supports it."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine import Translator
from engine.streaming.boundaries import settled_source
from engine.streaming.session import StreamingOptions, StreamSession
from protocol import InvalidMessage, PartialTranscript, TranslationUpdate, parse, serialize
from protocol.codec import load_schema


def replay(
    tr: Translator, shown: list[tuple[str, int | None]], final: str
) -> list[TranslationUpdate]:
    session = StreamSession("s", tr, StreamingOptions())
    updates = []
    for seq, (text, stable) in enumerate(shown):
        update = session.answer(PartialTranscript("s", 0, seq, text, False, stable_chars=stable))
        assert update is not None
        updates.append(update)
    update = session.answer(PartialTranscript("s", 0, len(shown), final, True))
    assert update is not None
    return [*updates, update]


# -- wire ------------------------------------------------------------------------------


def test_the_hint_is_optional_on_the_wire() -> None:
    old = (
        '{"type":"partial_transcript","stream_id":"a","segment_id":0,"seq":1,'
        '"text":"hi there","is_final":false}'
    )
    event = parse(old)
    assert isinstance(event, PartialTranscript) and event.stable_chars is None
    assert serialize(event) == old  # absent stays absent
    hinted = PartialTranscript("a", 0, 1, "hi there", False, stable_chars=2)
    line = serialize(hinted)
    assert json.loads(line)["stable_chars"] == 2
    assert parse(line) == hinted
    schema = load_schema()
    for text in (old, line):
        jsonschema.validate(json.loads(text), schema)


# A count past the end of the text is taken, clamped (tests/test_stability_hint_bounds.py).
@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_a_bad_hint_is_refused_with_its_field(value: object) -> None:
    line = json.dumps(
        {
            "type": "partial_transcript",
            "stream_id": "a",
            "segment_id": 0,
            "seq": 1,
            "text": "hi there",
            "is_final": False,
            "stable_chars": value,
        }
    )
    error = parse(line)
    assert not isinstance(error, PartialTranscript)
    assert error.field == "stable_chars", error
    with pytest.raises(InvalidMessage):
        PartialTranscript("a", 0, 1, "hi there", False, stable_chars=value)  # type: ignore[arg-type]


def test_the_settled_source_ends_at_a_word_boundary() -> None:
    assert settled_source("I will meet Tom", 6) == "I will"
    assert settled_source("I will meet Tom", 7) == "I will "
    assert settled_source("I will meet Tom", 9) == "I will"  # "me|et": not confirmed
    assert settled_source("I will meet Tom", 1) == "I"
    assert settled_source("Tomorrow I", 3) == ""  # "Tom" of "Tomorrow"
    assert settled_source("我明天见汤姆", 3) == "我明天"  # no spaces: characters


# -- commits -----------------------------------------------------------------------------


def test_nothing_is_committed_while_the_recogniser_settles_nothing(translator: Translator) -> None:
    """A recogniser that showed "Mike" where the speaker said "My father": unhinted, local
    agreement commits 迈克 and the final revises it; told that nothing is settled yet, the
    engine shows the same text as tentative and the final revises nothing."""
    shown = ["Mike", "Mike every", "Mike every night", "Mike every night opens"]
    final = "My father every night opens the window"
    plain = replay(translator, [(t, None) for t in shown], final)
    assert plain[-2].stable_text.startswith("迈克") and plain[-1].revised
    hinted = replay(translator, [(t, 0) for t in shown], final)
    assert all(u.stable_text == "" for u in hinted[:-1])
    assert [u.stable_text + u.unstable_text for u in hinted[:-1]] == [
        u.stable_text + u.unstable_text for u in plain[:-1]
    ]  # the same text, shown as tentative
    assert not hinted[-1].revised
    assert hinted[-1].stable_text == plain[-1].stable_text == translator.translate([final])[0].text


def test_commits_stop_where_the_settled_source_stops_supporting_them(
    translator: Translator,
) -> None:
    """The recogniser settles all but the last two words. Whatever is committed must be a
    prefix of the settled words' own translation: target text that depends on a word still
    changing is never committed. Settling everything gives the unhinted commits."""
    words = "Tom will play tennis with Lucy at three tomorrow".split()
    texts = [" ".join(words[:i]) for i in range(1, len(words))]
    lagging = [(t, len(" ".join(t.split()[:-2]))) for t in texts]
    hinted = replay(translator, lagging, " ".join(words))
    session = StreamSession("x", translator, StreamingOptions())
    for (text, stable), update in zip(lagging, hinted, strict=False):
        settled = settled_source(text, stable)
        if not settled:
            assert update.stable_text == ""
            continue
        own = session.translator.decode(
            translator.encode([translator.source_ids(settled, partial=True)]),
            StreamingOptions().decode_for(len(settled.split()) * 2, 0, partial=True),
        )[0]
        assert translator.detokenize(own.token_ids).startswith(update.stable_text), text
    assert any(u.stable_text for u in hinted[:-1])  # it does commit once words settle
    assert hinted[1].stable_text == ""  # "Tom will": "Tom" could still be "Tomorrow"
    settled_all = replay(translator, [(t, len(t)) for t in texts], " ".join(words))
    unhinted = replay(translator, [(t, None) for t in texts], " ".join(words))
    assert [u.stable_text for u in settled_all] == [u.stable_text for u in unhinted]


def test_replay_passes_the_hint_from_the_log_lines() -> None:
    from engine.logs.format import event_of

    line = {"stream_id": "a", "segment_id": 0, "seq": 1, "text": "hi there", "is_final": False}
    assert event_of(line).stable_chars is None
    assert event_of({**line, "stable_chars": 3}).stable_chars == 3


def test_without_a_hint_the_words_partials_share_are_the_settled_source(
    translator: Translator,
) -> None:
    """`settled_source=2`: the recogniser keeps rewriting the verb, so only the words both
    of the last two partials show are settled, and no committed text may depend on the
    verb: each update's stable text is a prefix of those shared words' own translation."""
    from engine.streaming.boundaries import shared_words

    shown = [
        "Tom will",
        "Tom will meet",
        "Tom will call",
        "Tom will call Lucy",
        "Tom will meet Lucy",
        "Tom will meet Lucy at three",
        "Tom will meet Lucy at three tomorrow",
    ]
    options = StreamingOptions(settled_source=2)
    session = StreamSession("s", translator, options)
    previous = None
    committed_any = False
    for seq, text in enumerate(shown):
        update = session.answer(PartialTranscript("s", 0, seq, text, False))
        assert update is not None
        if previous is None:
            assert update.stable_text == ""  # one partial agrees on nothing yet
        else:
            shared = shared_words([previous, text])
            if update.stable_text:
                committed_any = True
                ids = translator.source_ids(shared, partial=True)
                partial_own = translator.decode(
                    translator.encode([ids]), options.decode_for(len(ids), 0, partial=True)
                )[0]
                own = translator.detokenize(partial_own.token_ids)
                assert own.startswith(update.stable_text), (text, update.stable_text, own)
        previous = text
    assert committed_any
    assert shared_words(["a b c", "a b d", "a x"]) == "a"
    assert shared_words(["a b", "a b"]) == "a b"


@pytest.mark.parametrize("lag", [0, 2])
def test_logs_get_truthful_hints(lag: int) -> None:
    """`logs hint`: each partial's settled characters are a whole-word prefix of every later
    message of its segment (so a recogniser sending them keeps its promise), and none
    could be added (lag 0: the next word is changed by some later message)."""
    from engine.logs.format import read_log
    from engine.logs.hints import with_stability_hints
    from tests.conftest import ROOT

    lines = read_log(ROOT / "examples" / "logs" / "fixture_en_zh_asr.jsonl")
    hinted = with_stability_hints(lines, lag=lag)
    assert [{k: v for k, v in h.items() if k != "stable_chars"} for h in hinted] == lines
    assert all(("stable_chars" in h) != h["is_final"] for h in hinted)
    assert any(h.get("stable_chars") for h in hinted)
    for i, line in enumerate(hinted):
        if line["is_final"]:
            continue
        settled = line["text"][: line["stable_chars"]]
        assert not settled or line["text"][len(settled) :][:1] in ("", " ")
        later = [
            h["text"]
            for h in hinted[i + 1 :]
            if (h["stream_id"], h["segment_id"]) == (line["stream_id"], line["segment_id"])
        ]
        assert all(text.startswith(settled) for text in later)
        if lag == 0 and len(settled) < len(line["text"]):
            words = line["text"].split()
            more = " ".join(words[: len(settled.split()) + 1])
            assert not all(text == more or text.startswith(more + " ") for text in later), (
                line["text"],
                settled,
            )
    with pytest.raises(ValueError):
        with_stability_hints(lines, lag=-1)


def test_hinted_replay_keeps_the_streaming_guarantees(translator: Translator) -> None:
    """Replaying a hinted log: finals are still the offline translation, and fewer finals
    revise stable text than without hints."""
    from engine.logs.format import read_log
    from engine.logs.hints import with_stability_hints
    from engine.replay import ReplayOptions, replay
    from tests.conftest import ROOT

    lines = read_log(ROOT / "examples" / "logs" / "fixture_en_zh_asr.jsonl")
    revised = {}
    for name, log in (("plain", lines), ("hinted", with_stability_hints(lines))):
        result = replay(translator, log, ReplayOptions(progress=False))
        assert result.final_exact_match == 1.0
        revised[name] = sum(1 for u in result.updates if u.update.is_final and u.update.revised)
    assert revised["hinted"] < revised["plain"]
