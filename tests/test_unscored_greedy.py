"""Greedy decoding without scores (`DecodeOptions.scores` False): each token by the argmax
of the logits alone, the same tokens as the scored choice, for the partials of a stream."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from engine import DecodeOptions, Translator
from engine.decoding.search import _greedy_choice, _greedy_token
from engine.model.config import ModelConfig
from engine.streaming.session import StreamingOptions

SOURCES = [
    "I will meet Tom at three",
    "Tom reads a book in the library",
    "my sister will not call Lily tomorrow",
]

CONFIG = ModelConfig(
    decoder_start_token_id=9,
    eos_token_id=0,
    pad_token_id=9,
    vocab_size=10,
    d_model=4,
    decoder_layers=1,
    decoder_attention_heads=1,
    max_position_embeddings=32,
    max_length=32,
    bad_token_ids=(9,),
)


def _row(values: dict[int, float], fill: float = -1.0) -> np.ndarray:
    row = np.full(CONFIG.vocab_size, fill, dtype=np.float32)
    for token, value in values.items():
        row[token] = value
    return row


@pytest.mark.parametrize(
    ("case", "row", "generated", "min_new"),
    [
        ("plain", _row({3: 2.0}), 0, 0),
        ("banned largest", _row({9: 5.0, 4: 2.0}), 0, 0),
        ("banned largest, tie after it", _row({9: 5.0, 2: 5.0, 6: 5.0}), 0, 0),
        ("tie, first allowed", _row({2: 5.0, 6: 5.0}), 0, 0),
        ("eos too early", _row({0: 5.0, 7: 1.0}), 1, 3),
        ("eos in time", _row({0: 5.0, 7: 1.0}), 3, 3),
        ("nan", _row({5: math.nan, 1: 3.0}), 0, 0),
    ],
)
def test_the_argmax_alone_is_the_scored_choice(
    case: str, row: np.ndarray, generated: int, min_new: int
) -> None:
    options = DecodeOptions(min_new_tokens=min_new, scores=False)
    expected = _greedy_choice(row, CONFIG, generated, options)[0]
    assert _greedy_token(row, CONFIG, generated, options) == expected, case
    assert expected != 9


def test_random_rows_choose_as_the_scored_choice() -> None:
    rng = np.random.default_rng(7)
    options = DecodeOptions(min_new_tokens=2)
    for _ in range(500):
        # few distinct values: ties and a banned or early largest are common
        row = rng.integers(0, 4, CONFIG.vocab_size).astype(np.float32)
        generated = int(rng.integers(0, 4))
        expected = _greedy_choice(row, CONFIG, generated, options)[0]
        assert _greedy_token(row, CONFIG, generated, options) == expected


@pytest.mark.parametrize("draft", ["none", "accepted", "rejected"])
def test_unscored_rows_decode_the_tokens_scored_rows_do(translator: Translator, draft: str) -> None:
    """Several rows at once, with and without a forced prefix and a draft (verified in the
    prefill), and with eos banned for a while: the tokens and the end are the scored
    search's; the score is nan."""
    ids = [translator.source_ids(text) for text in SOURCES]
    for options in (DecodeOptions(), DecodeOptions(min_new_tokens=12)):
        enc = translator.encode(ids)
        plain = translator.decode(enc, options)
        prefixes = [[], list(plain[1].token_ids[:2]), []]
        scored = translator.decode(enc, options, prefixes=prefixes)
        tails = [list(h.token_ids[len(p) :]) for h, p in zip(scored, prefixes, strict=True)]
        assert all(tails)
        vocab = translator.config.vocab_size
        drafts = {
            "none": [[] for _ in tails],
            "accepted": tails,
            "rejected": [[(tail[0] + 1) % vocab, *tail] for tail in tails],
        }[draft]
        unscored = translator.decode(
            enc, replace(options, scores=False), prefixes=prefixes, drafts=drafts
        )
        for a, b in zip(scored, unscored, strict=True):
            assert b.token_ids == a.token_ids
            assert b.finished == a.finished
            assert math.isfinite(a.score)
            assert math.isnan(b.score)


def test_a_partials_options_go_without_scores_and_a_finals_keep_them() -> None:
    for streaming in (StreamingOptions(), StreamingOptions(forced_length_ratio=1.5)):
        partial = streaming.decode_for(10, 2, partial=True)
        final = streaming.decode_for(10)
        assert not partial.scores
        assert final.scores
        assert replace(partial, scores=True, max_new_tokens=final.max_new_tokens) == final
    assert StreamingOptions().decode_for(10) == DecodeOptions()


def test_a_partials_options_are_capped_by_its_source_and_made_once_per_cap() -> None:
    streaming = StreamingOptions(partial_length=(1.5, 8), decode=DecodeOptions(max_new_tokens=40))
    for tokens, committed, cap in ((10, 0, 23), (10, 30, 31), (4, 0, 14), (30, 0, None)):
        options = streaming.decode_for(tokens, committed, partial=True)
        assert options == replace(streaming.decode, max_new_tokens=cap or 40, scores=False)
        assert streaming.decode_for(tokens, committed, partial=True) is options
    uncapped = StreamingOptions(partial_length=None).decode_for(10, partial=True)
    assert uncapped == DecodeOptions(scores=False)
    # The memo is no part of the options: equal and hashed alike once used.
    fresh = StreamingOptions(partial_length=(1.5, 8), decode=DecodeOptions(max_new_tokens=40))
    assert streaming == fresh and hash(streaming) == hash(fresh)
