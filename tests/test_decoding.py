"""Decoding on the fixture: every KV-cache layout gives the no-cache result, prefixes and
batches change nothing, and the encoder KV of step 0 is what every later step reads.

These tests look at each layout's own sessions, so they load models with
`batchable=False` (lockstep batching on the original graphs); the rewritten decoder of
continuous batching is checked against these in tests/test_scheduler.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine import DecodeOptions, Translator
from engine.model.layouts import DecoderLayout

SOURCES = [
    "I will meet Tom at three",
    "Tom reads a book in the library",
    "my sister will not call Lily tomorrow",
    "we eat noodles",
]


class Recorder:
    """Stands in for an onnxruntime session and records every call."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.calls: list[tuple[list[str], dict[str, Any], list[Any]]] = []

    def run(self, outputs: list[str], feed: dict[str, Any]) -> list[Any]:
        result = self.session.run(outputs, feed)
        self.calls.append((list(outputs), dict(feed), result))
        return list(result)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)


def record(tr: Translator) -> tuple[Recorder, list[tuple[list[str], dict[str, Any], list[Any]]]]:
    """Wrap the sessions; returns the encoder recorder and the shared decoder call list."""
    model = tr.model
    encoder = Recorder(model.encoder)
    model.encoder = encoder
    layout = model.decoder  # the layout object holds the sessions it calls
    no_past = Recorder(layout.no_past)
    calls = no_past.calls
    if layout.with_past is layout.no_past:
        layout.with_past = no_past
    elif layout.with_past is not None:
        with_past = Recorder(layout.with_past)
        with_past.calls = calls
        layout.with_past = with_past
    layout.no_past = no_past
    return encoder, calls


def last_logits(calls: list[tuple[list[str], dict[str, Any], list[Any]]]) -> list[np.ndarray]:
    return [result[0][:, -1, :] for _, _, result in calls]


@pytest.fixture(scope="module")
def offline(fixture_variants: dict[str, Path]) -> Translator:
    return Translator.from_dir(fixture_variants["merged"], use_cache=False)


@pytest.mark.parametrize("layout", ["merged", "split", "self_kv_only"])
def test_cached_equals_no_cache(layout: str, fixture_variants: dict[str, Path]) -> None:
    # prefer_split=False keeps the merged file's If (by default it is split at load).
    cached = Translator.from_dir(
        fixture_variants[layout], prefer_split=layout != "merged", batchable=False
    )
    assert cached.model.layout is DecoderLayout(layout)
    plain = Translator.from_dir(fixture_variants[layout], use_cache=False)
    assert plain.model.layout is DecoderLayout.NO_CACHE
    for text in SOURCES:
        _, cached_calls = record(cached)
        _, plain_calls = record(plain)
        a = cached.translate([text])[0]
        b = plain.translate([text])[0]
        assert a.token_ids == b.token_ids
        assert a.text
        la, lb = last_logits(cached_calls), last_logits(plain_calls)
        assert len(la) == len(lb)
        for x, y in zip(la, lb, strict=True):
            np.testing.assert_allclose(x, y, atol=1e-4, rtol=0)


def test_no_past_export_decodes_like_the_cache(fixture_variants: dict[str, Path]) -> None:
    no_past = Translator.from_dir(fixture_variants["no_cache"])
    assert no_past.model.layout is DecoderLayout.NO_CACHE
    merged = Translator.from_dir(fixture_variants["merged"], batchable=False)
    assert [r.token_ids for r in no_past.translate(SOURCES)] == [
        r.token_ids for r in merged.translate(SOURCES)
    ]


@pytest.mark.parametrize("layout", ["merged", "split", "self_kv_only"])
def test_encoder_once_and_step0_encoder_kv_reused(
    layout: str, fixture_variants: dict[str, Path]
) -> None:
    tr = Translator.from_dir(fixture_variants[layout], batchable=False)
    encoder, calls = record(tr)
    result = tr.translate([SOURCES[0]])[0]
    assert len(encoder.calls) == 1
    assert len(calls) == len(result.token_ids) + 1  # step 0, then one call per token but eos
    first_outputs, _, first_result = calls[0]
    cross_names = [n for n in first_outputs if ".encoder." in n]
    later = calls[1:]
    assert later
    for outputs, feed, _ in later:
        # Later steps never even ask for the (empty) encoder presents.
        assert not [n for n in outputs if n.startswith("present.") and ".encoder." in n]
        if "use_cache_branch" in feed:
            assert bool(feed["use_cache_branch"][0])
    if layout == "self_kv_only":
        assert not cross_names
        for _, feed, _ in later:
            assert not [n for n in feed if ".encoder." in n]
        return
    step0 = dict(zip(first_outputs, first_result, strict=True))
    assert len(cross_names) == 2 * tr.config.decoder_layers
    for name in cross_names:
        assert step0[name].shape[2] == len(tr.source_ids(SOURCES[0]))  # real, not empty
        fed = name.replace("present.", "past_key_values.")
        for _, feed, _ in later:
            assert feed[fed] is step0[name]  # the very arrays of step 0, every step


def test_batch_encodes_once(fixture_variants: dict[str, Path]) -> None:
    tr = Translator.from_dir(fixture_variants["merged"], batchable=False)
    encoder, _ = record(tr)
    tr.translate(SOURCES)
    assert len(encoder.calls) == 1
    assert encoder.calls[0][1]["input_ids"].shape[0] == len(SOURCES)


@pytest.mark.parametrize("layout", ["merged", "split", "self_kv_only", "no_cache"])
def test_forced_prefix_in_one_call_equals_step_by_step(
    layout: str, fixture_variants: dict[str, Path]
) -> None:
    tr = Translator.from_dir(fixture_variants[layout], batchable=False)
    for text in SOURCES:
        full = tr.translate([text])[0].token_ids
        for cut in (1, len(full) // 2, len(full)):
            prefix = list(full[:cut])
            enc = tr.encode([tr.source_ids(text)])
            _, calls = record(tr)
            one_call = tr.decode(enc, prefixes=[prefix])[0]
            assert calls[0][1]["input_ids"].shape[1] == cut + 1  # start token + whole prefix
            # Step by step: force the same tokens one decoder call at a time.
            enc2 = tr.encode([tr.source_ids(text)])
            forced: list[int] = []

            def force(
                rows: Any,
                scores: np.ndarray,
                prefix: list[int] = prefix,
                forced: list[int] = forced,
            ) -> np.ndarray:
                if len(rows[0]) < len(prefix):
                    out = np.full_like(scores, -np.inf)
                    out[0, prefix[len(rows[0])]] = 0.0
                    forced.append(prefix[len(rows[0])])
                    return out
                return scores

            stepwise = tr.decode(enc2, prefixes=[[]], hook=force)[0]
            assert forced == prefix
            assert one_call.token_ids == stepwise.token_ids == full


def test_forced_prefix_steers_the_continuation(offline: Translator) -> None:
    tr = offline
    text = SOURCES[0]
    other = tr.translate([SOURCES[1]])[0].token_ids
    prefix = list(other[:2])
    res = tr.translate([text], prefixes=[prefix])[0]
    assert list(res.token_ids[:2]) == prefix


@pytest.mark.parametrize("beam", [1, 3])
def test_batched_equals_one_by_one(beam: int, fixture_variants: dict[str, Path]) -> None:
    tr = Translator.from_dir(fixture_variants["merged"], batchable=False)
    options = DecodeOptions(beam_size=beam)
    batched = tr.translate(SOURCES, options)
    for text, result in zip(SOURCES, batched, strict=True):
        alone = tr.translate([text], options)[0]
        assert alone.token_ids == result.token_ids
        assert alone.score == pytest.approx(result.score, abs=1e-3)


def test_batched_prefixes_of_different_lengths(fixture_variants: dict[str, Path]) -> None:
    tr = Translator.from_dir(fixture_variants["merged"], batchable=False)
    full = [r.token_ids for r in tr.translate(SOURCES)]
    prefixes = [list(ids[:k]) for ids, k in zip(full, (0, 1, 3, 2), strict=True)]
    batched = tr.translate(SOURCES, prefixes=prefixes)
    assert [r.token_ids for r in batched] == full


def test_beam_one_is_greedy_and_beam_scores_at_least_greedy(
    fixture_variants: dict[str, Path],
) -> None:
    tr = Translator.from_dir(fixture_variants["merged"], batchable=False)
    greedy = tr.translate(SOURCES)
    assert [r.token_ids for r in tr.translate(SOURCES, DecodeOptions(beam_size=1))] == [
        r.token_ids for r in greedy
    ]
    beam = tr.translate(SOURCES, DecodeOptions(beam_size=4, length_penalty=0.0))
    for g, b in zip(greedy, beam, strict=True):
        assert b.score >= g.score - 1e-4


def test_length_limits(fixture_variants: dict[str, Path]) -> None:
    tr = Translator.from_dir(fixture_variants["merged"], batchable=False)
    short = tr.translate([SOURCES[1]], DecodeOptions(max_new_tokens=2))[0]
    assert len(short.token_ids) == 2 and not short.finished
    forced = tr.translate([SOURCES[3]], DecodeOptions(max_new_tokens=12, min_new_tokens=12))[0]
    assert len(forced.token_ids) == 12
    beam = tr.translate([SOURCES[1]], DecodeOptions(beam_size=3, max_new_tokens=3))[0]
    assert len(beam.token_ids) <= 3
    cap = tr.config.max_position_embeddings - 1
    longest = tr.translate([SOURCES[3]], DecodeOptions(min_new_tokens=10_000))[0]
    assert len(longest.token_ids) == min(cap, tr.config.max_length - 1)


def test_pad_never_generated(fixture_variants: dict[str, Path]) -> None:
    tr = Translator.from_dir(fixture_variants["merged"], batchable=False)
    out = tr.translate(SOURCES, DecodeOptions(min_new_tokens=30, max_new_tokens=30))
    for r in out:
        assert tr.config.pad_token_id not in r.token_ids
