"""Glossary constraints in the search (engine/decoding/constraints.py): every matched term's
target is placed, greedy and beam, on both fixture languages; a source with no matched
term decodes bit for bit as without a glossary, also beside constrained rows in one
batch; a forced prefix (stable text) that holds a term meets it; do-not-translate keeps
the source term."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from engine.decoding.constraints import ConstrainedGreedy, Constraint, Progress
from engine.decoding.scheduler import SchedulerOptions
from engine.decoding.search import DecodeOptions
from engine.decoding.translator import Translator
from engine.glossary import Glossary, GlossaryError
from tests.conftest import FIXTURE_MODEL, needs_fixture

ZH = Glossary.parse("en\tzh\nTom\t杰克\nMary\t莉莉\nbook\t报纸\n")
SOURCES = [
    "Tom reads a book in the library",
    "Does Mary drink water",
    "I will meet Tom at three",
]
PLAIN = ["She reads", "Lucy wants to meet Jack on the train", "do we meet anna at the office"]


@pytest.fixture(scope="module")
def zh() -> Iterator[Translator]:
    needs_fixture()
    tr = Translator.from_dir(FIXTURE_MODEL)
    yield tr
    tr.close()


@pytest.fixture(scope="module")
def de(german: Path) -> Iterator[Translator]:
    tr = Translator.from_dir(german)
    yield tr
    tr.close()


def test_progress_tracks_forms_and_breaks() -> None:
    terms = (Constraint((5, 6)), Constraint((7,), initial=(8,)))
    state = Progress.start(terms)
    assert sorted(state.wanted(at_start=True)) == [5, 7, 8]
    assert sorted(state.wanted()) == [5, 7]  # a sentence-start form only first
    state = state.advance(5)
    assert (state.active, state.wanted(), state.count) == (0, [6], 1)
    state = state.advance(9)  # broke off: the term is pending again
    assert (state.active, state.met, state.count) == (-1, (False, False), 0)
    state = Progress.start(terms, [8, 5, 6])
    assert state.done and state.count == 3
    assert not Progress.start(terms, [1, 8]).met[1]  # 8 is a start form, not at the start


@pytest.mark.parametrize("beam", [1, 4])
def test_terms_are_placed(zh: Translator, beam: int) -> None:
    options = DecodeOptions(beam_size=beam)
    plain = zh.translate(SOURCES, options)
    placed = zh.translate(SOURCES, options, glossary=ZH)
    for source, before, after in zip(SOURCES, plain, placed, strict=True):
        for target in ZH.targets(source):
            assert target not in before.text  # the model would not write it by itself
            assert target in after.text, (source, after.text)
    # The model's own rendering of the terms' sources gives way to the terms.
    assert placed[2].text == "我三点见杰克"
    assert placed[0].text == "杰克在图书馆看报纸"


@pytest.mark.parametrize("beam", [1, 4])
def test_no_term_is_bit_identical_also_beside_constrained_rows(zh: Translator, beam: int) -> None:
    options = DecodeOptions(beam_size=beam)
    alone = zh.translate(PLAIN, options)
    mixed = zh.translate([*PLAIN, *SOURCES], options, glossary=ZH)[: len(PLAIN)]
    matching_nothing = zh.translate(PLAIN, options, glossary=ZH)
    for a, b, c in zip(alone, mixed, matching_nothing, strict=True):
        assert a == b == c  # text, ids and score, bit for bit


def test_a_term_in_the_forced_prefix_is_met(zh: Translator) -> None:
    prefix = list(zh.terms.initial("杰克"))
    forced = zh.translate(["I will meet Tom at three"], prefixes=[prefix], glossary=ZH)[0]
    assert forced.token_ids[: len(prefix)] == tuple(prefix)  # stable text kept
    assert forced.text.count("杰克") == 1  # not placed a second time


def test_do_not_translate_and_german_terms(de: Translator) -> None:
    glossary = Glossary.parse("en\tde\nTom\tPaul\ncoffee\n")
    for beam in (1, 4):
        options = DecodeOptions(beam_size=beam)
        plain = de.translate(["Tom drinks coffee"], options)[0].text
        kept = de.translate(["Tom drinks coffee"], options, glossary=glossary)[0].text
        assert "coffee" not in plain and "Paul" not in plain
        assert "coffee" in kept and "Paul" in kept, kept


def test_glossary_checked_against_the_model(zh: Translator) -> None:
    with pytest.raises(GlossaryError, match="the glossary is en->de, the model translates en->zh"):
        zh.translate(["Tom"], glossary=Glossary.parse("en\tde\nTom\tThomas\n"))
    with pytest.raises(GlossaryError, match="target '书籍': the model cannot write '籍'"):
        zh.glossary = Glossary.parse("en\tzh\nbook\t书籍\n")


def test_a_started_term_is_verified_ahead_with_the_same_output(german: Path) -> None:
    """A term's later tokens go into one step as lookahead: the same output as one step a
    token, in fewer decoder steps."""
    glossary = Glossary.parse("en\tde\nTom\tThomas\nwater\tMineralwasser\n")
    texts = ["Tom drinks water with Anna", "I will meet Tom at three"]
    ahead = Translator.from_dir(german)
    one_by_one = Translator.from_dir(german, scheduler=SchedulerOptions(lookahead_positions=0))
    try:
        outputs, steps = [], []
        for tr in (ahead, one_by_one):
            before = tr.scheduler.stats["decoder_steps"]
            outputs.append([tr.translate([t], glossary=glossary)[0] for t in texts])
            steps.append(tr.scheduler.stats["decoder_steps"] - before)
        # The same tokens; scores within fp32 rounding (several tokens in one call).
        assert [r.token_ids for r in outputs[0]] == [r.token_ids for r in outputs[1]]
        for a, b in zip(outputs[0], outputs[1], strict=True):
            assert a.score == pytest.approx(b.score, abs=1e-3)
        assert all("Thomas" in r.text for r in outputs[0])
        assert steps[0] < steps[1]
        assert ahead.scheduler.stats["lookahead_accepted"] > 0
    finally:
        ahead.close()
        one_by_one.close()


def test_a_term_put_in_by_the_room_rule_leaves_a_draft_the_next_partial_confirms() -> None:
    """The room rule puts a term the model never reached in the output's last positions,
    which move on as the next partial's forced length grows: the hypothesis's draft is
    the model's own token there, then the term, so the next, longer decode confirms its
    whole draft (the previous output was rejected at the term), with the same output."""
    import numpy as np

    from engine.decoding.constraints import ConstrainedGreedy
    from engine.model.config import ModelConfig

    config = ModelConfig(0, 1, 2, 16, 8, 1, 1, 64, 64)
    own, term = 5, 9  # the model writes `own` over and over, never the term
    logits = np.zeros((1, 16), dtype=np.float32)
    logits[0, own] = 3.0
    constraints = (Constraint((term,)),)

    def decode(length: int) -> ConstrainedGreedy:
        search = ConstrainedGreedy(
            config, [], DecodeOptions(max_new_tokens=length), constraints=constraints
        )
        search.start(0)
        while search.observe(logits) is not None:
            pass
        return search

    def confirmed(tokens: tuple[int, ...], draft: tuple[int, ...]) -> int:
        """Draft tokens a prefill confirms: those the search itself writes, up to the first
        other one (`engine.decoding.continuous.confirm`)."""
        same = 0
        while same < min(len(tokens), len(draft)) and tokens[same] == draft[same]:
            same += 1
        return same

    hyp = decode(3).result()
    assert hyp.token_ids == (own, own, term)
    assert hyp.draft == (own, own, own, term)
    # The next partial, one token longer, writes exactly that draft; the previous output
    # as the draft is rejected at the term.
    longer = decode(4).result().token_ids
    assert longer == hyp.draft
    assert confirmed(longer, hyp.draft) == 4
    assert confirmed(longer, hyp.token_ids) == 2


def _model(writes: list[int], vocab: int = 16, positions: int = 12) -> np.ndarray:
    """Logits of a model that writes `writes`, then eos, at each position whatever came
    before: [positions, vocab]."""
    logits = np.zeros((positions, vocab), dtype=np.float32)
    for at in range(positions):
        logits[at, writes[at] if at < len(writes) else 1] = 3.0
    return logits


def _searched(
    logits: np.ndarray,
    options: DecodeOptions,
    constraints: tuple[Constraint, ...],
    draft: Sequence[int] = (),
) -> tuple[ConstrainedGreedy, int, int]:
    """A constrained greedy search run over `logits` as a prefill of its draft, then one
    position a step: the search, draft tokens confirmed, positions read after the
    prefill's first (decoder steps)."""
    from engine.decoding.continuous import confirm
    from engine.model.config import ModelConfig
    from engine.model.kv.base import LogitsPositions

    config = ModelConfig(0, 1, 2, logits.shape[1], 8, 1, 1, 64, 64)
    search = ConstrainedGreedy(config, [], options, draft=draft, constraints=constraints)
    search.start(0)
    step, accepted = confirm(search, LogitsPositions(logits), search.draft)
    steps = 0
    while step is not None:
        steps += 1
        step = search.observe(logits[len(search.tokens)][None])
    return search, accepted, steps


def test_a_term_put_in_where_the_model_ends_costs_a_partial_no_step() -> None:
    """Where the model would end with a term pending, the term goes in and the output ends
    after it: a partial's decode (no score) reads no more logits for that, however many
    tokens the term has; a scored decode (a final, `translate`) still reads eos's
    log-probability there. Same tokens either way."""
    own = [5, 6]  # the model writes two tokens and ends; the term (9, 10) is never reached
    logits = _model(own)
    term = (Constraint((9, 10)),)
    partial, _, partial_steps = _searched(logits, DecodeOptions(scores=False), term)
    final, _, final_steps = _searched(logits, DecodeOptions(), term)
    assert partial.result().token_ids == final.result().token_ids == (5, 6, 9, 10)
    assert partial.result().appended == 2 and partial.result().finished
    # No score carried (the search compared the masked logits, in their order), as the
    # plain search's partials; a scored decode's is the sum of log-probabilities.
    assert math.isnan(partial.result().score)
    assert math.isfinite(final.result().score)
    # The prefill reads the first position, a step each the next two (the model's second
    # token, then its eos where the term goes in); the term's second token and the eos
    # after it cost a scored decode two more steps (one with lookahead), a partial none.
    assert partial_steps == 2
    assert final_steps == 4


def test_a_draft_holding_the_models_rendering_is_confirmed_through_the_term() -> None:
    """The previous output (a partial decoded before the term's source was complete, or
    the last partial before a final) holds the model's own rendering where the term now
    goes: the draft carries the term there, so the prefill confirms the whole of it (it
    was rejected at the term, and every token after it cost a step)."""
    from engine.decoding.constraints import drafted

    rendering, term = 7, 9
    writes = [5, rendering, 6, 8, 4]  # the model's own output; the term replaces 7
    constraint = Constraint((term,), frozenset({rendering}), rendering=(rendering,))
    search, accepted, steps = _searched(
        _model(writes), DecodeOptions(scores=False), (constraint,), draft=writes
    )
    assert search.result().token_ids == (5, term, 6, 8, 4)
    assert accepted == len(writes)
    assert steps == 0
    # Nothing to rewrite where the draft holds the term already, or the prefix does.
    assert drafted([], [5, term, 7], (constraint,)) == [5, term, 7]
    assert drafted([term], [5, 7], (constraint,)) == [5, 7]
    # At the sentence's start, the forms the tokenizer writes there.
    start = Constraint((term,), rendering=(rendering,), initial=(11,), initial_rendering=(12, 13))
    assert drafted([], [12, 13, 5, 7], (start,)) == [11, 5, 7]
    assert drafted([3], [7, 5], (start,)) == [term, 5]


def test_matching_the_same_text_again_answers_by_glossary_and_completeness(
    zh: Translator,
) -> None:
    """A decode matches its text twice (renderings, then constraints): the second answer
    comes from the first, but only for the same glossary object and the same question."""
    other = Glossary.parse("en\tzh\nTom\t莉莉\n")
    text = "I will meet Tom"
    assert [t.target for t in zh.terms.matched(ZH, text)] == ["杰克"]
    assert [t.target for t in zh.terms.matched(ZH, text)] == ["杰克"]
    assert [t.target for t in zh.terms.matched(other, text)] == ["莉莉"]
    assert zh.terms.matched(other, text, partial=True) == []  # "Tom" may still grow
    assert [t.target for t in zh.terms.matched(other, text)] == ["莉莉"]
