"""A translation that never ends: misheard noise ("on we you you do") makes the fixture
loop ("你不不不...") as real OPUS-MT models do. The source's length cap and the repeat
guard end it, alike in `translate`, in finals and in partials, and change no translation
that the model ended by itself."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace

import pytest

from engine import Translator
from engine.decoding.search import DecodeOptions, loop_start
from engine.streaming.session import StreamingOptions, StreamSession
from protocol import PartialTranscript
from tests.conftest import FIXTURE_DIRS, FIXTURE_MODEL, FIXTURE_MODELS, ROOT, needs_fixture

NOISE = "on we you you do"  # what the recognizer heard of espeak-ng speech (issue 53)
OFF = DecodeOptions(max_length_factor=None, repeat_limit=None)


def source_tokens(translator: Translator, text: str) -> int:
    return len(translator.source_ids(text))


def test_loop_start_finds_the_first_occurrence_of_a_repeated_ngram() -> None:
    assert loop_start([5, 7, 7, 7, 7], 4, 0) == 2
    assert loop_start([5, 7, 7, 7], 4, 0) is None
    assert loop_start([1, 2, 3, 2, 3, 2, 3, 2, 3], 4, 0) == 3
    assert loop_start([1, 2, 3, 2, 3, 2, 3, 9], 4, 0) is None
    assert loop_start([7, 7, 7, 7], 4, 3) == 3  # never inside the forced prefix


def test_noise_that_loops_to_the_model_limit_ends_early(translator: Translator) -> None:
    unguarded = translator.translate([NOISE], OFF)[0]
    limit = min(translator.config.max_length, translator.config.max_position_embeddings) - 1
    assert len(unguarded.token_ids) == limit and not unguarded.finished  # the bug's output
    guarded = translator.translate([NOISE])[0]
    assert not guarded.finished
    assert len(guarded.token_ids) < 8
    assert guarded.token_ids == unguarded.token_ids[: len(guarded.token_ids)]
    # The length cap alone ends it at F x source tokens + extra.
    capped = translator.translate([NOISE], replace(OFF, max_length_factor=2.0))[0]
    assert len(capped.token_ids) == math.ceil(2.0 * source_tokens(translator, NOISE)) + 10
    # A beam ends its looping rows too.
    beam = translator.translate([NOISE], DecodeOptions(beam_size=3))[0]
    assert len(beam.token_ids) < 8


def test_the_cap_counts_source_tokens_and_never_undercuts_a_forced_length(
    translator: Translator,
) -> None:
    text = "Lucy wants to meet Jack on the train"
    n = source_tokens(translator, text)
    short = translator.translate([text], DecodeOptions(max_length_factor=0.25, max_length_extra=1))
    assert len(short[0].token_ids) == math.ceil(0.25 * n) + 1 and not short[0].finished
    forced = DecodeOptions(max_length_factor=0.25, max_length_extra=1, min_new_tokens=20)
    assert len(translator.translate([text], replace(forced, max_new_tokens=20))[0].token_ids) == 20
    # Nor does the repeat limit cut a forced length.
    looped = translator.translate([NOISE], DecodeOptions(min_new_tokens=30, max_new_tokens=30))
    assert len(looped[0].token_ids) == 30
    # Batched sources each get their own cap.
    both = translator.translate([text, NOISE], DecodeOptions(max_length_factor=0.5))
    assert len(both[0].token_ids) <= math.ceil(0.5 * n) + 10


@pytest.mark.parametrize("kind", sorted(FIXTURE_MODELS))
def test_no_final_the_model_ended_by_itself_changes(kind: str) -> None:
    needs_fixture(kind)
    translator = Translator.from_dir(FIXTURE_MODELS[kind])
    try:
        rows = (FIXTURE_DIRS[kind] / "heldout.tsv").read_text(encoding="utf-8").splitlines()
        sources = [row.split("\t")[0] for row in rows if row.strip()]
        unguarded = translator.translate(sources, OFF)
        guarded = translator.translate(sources)
        ended = [i for i, r in enumerate(unguarded) if r.finished]
        assert len(ended) == len(sources)
        assert [guarded[i] for i in ended] == [unguarded[i] for i in ended]
    finally:
        translator.close()


def test_finals_and_partials_follow_the_same_rule(translator: Translator) -> None:
    session = StreamSession("s", translator)
    offline = translator.translate([NOISE])[0]
    partial = session.answer(PartialTranscript("s", 0, 0, NOISE, False))
    assert partial is not None and len(partial.text) < 10
    final = session.answer(PartialTranscript("s", 0, 1, NOISE, True))
    assert final is not None and final.stable_text == offline.text
    # Turned off, the final loops to the model's limit, still equal to `translate`.
    loose = StreamSession("t", translator, StreamingOptions(decode=OFF))
    final = loose.answer(PartialTranscript("t", 0, 0, NOISE, True))
    assert final is not None and final.stable_text == translator.translate([NOISE], OFF)[0].text
    assert len(final.stable_text) > 100


def test_the_cli_options_set_the_guards() -> None:
    needs_fixture()

    def translate(*options: str) -> str:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "engine.cli",
                "translate",
                "--model",
                str(FIXTURE_MODEL),
                *options,
                NOISE,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            check=True,
        )
        return done.stdout.strip()

    assert len(translate()) < 8
    assert 8 <= len(translate("--repeat-limit", "0")) < 100  # the length cap alone
    assert len(translate("--max-length-factor", "0", "--repeat-limit", "0")) > 100
    bad = subprocess.run(
        [sys.executable, "-m", "engine.cli", "translate", "--repeat-limit", "1", NOISE],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert bad.returncode == 2 and "--repeat-limit" in bad.stderr
