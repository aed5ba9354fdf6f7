"""Commit policies and word/character boundaries, on hand-made token sequences."""

from __future__ import annotations

import numpy as np
import pytest

from engine.streaming.policies import (
    BiasedDecoding,
    LocalAgreement,
    MaskK,
    bias_toward,
    common_prefix_length,
    parse_policy,
)
from engine.streaming.session import BoundaryFinder, normalize_source

PIECES = {
    1: "\u2581I",
    2: "\u2581wi",
    3: "ll",
    4: "\u2581go",
    5: ",",
    6: "我",
    7: "三点",
    8: "<0xE4>",
    9: "<0xBD>",
    10: "<0xA0>",
    11: "Tom",
    12: "s",
}
bounds = BoundaryFinder(lambda i: PIECES[i])


def test_common_prefix_length() -> None:
    assert common_prefix_length([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert common_prefix_length([[1, 2, 3]]) == 3
    assert common_prefix_length([[5], [6]]) == 0
    assert common_prefix_length([]) == 0


def test_local_agreement_commits_the_agreed_prefix() -> None:
    la = LocalAgreement(2)
    assert la.propose([[1, 2, 3]], committed=0).commit == 0  # one hypothesis: nothing yet
    p = la.propose([[1, 2, 3], [1, 2, 4, 5]], committed=0)
    assert (p.commit, p.display) == (2, 4)
    assert LocalAgreement(3).propose([[1, 9], [1, 2, 3], [1, 2, 4]], 0).commit == 1


def test_mask_k_hides_the_tail() -> None:
    p = MaskK(2).propose([[1, 2, 3, 4, 5]], committed=0)
    assert (p.commit, p.display) == (3, 3)
    assert MaskK(9).propose([[1, 2]], 0).commit == 0


def test_bias_formula() -> None:
    scores = np.log(np.array([[0.5, 0.3, 0.2]], dtype=np.float32))
    hook = bias_toward([1, 2], beta=0.4)
    out = np.exp(hook([[]], scores))[0]
    # p' = 0.6 * p + 0.4 * [token == previous[0] == 1]
    np.testing.assert_allclose(out, [0.3, 0.18 + 0.4, 0.12], rtol=1e-5)
    # A row that already left the previous output is not biased.
    np.testing.assert_allclose(hook([[0]], scores), scores)
    # Nor is a row past its end.
    np.testing.assert_allclose(hook([[1, 2]], scores), scores)
    assert BiasedDecoding(0.3).hook(None) is None


@pytest.mark.parametrize(
    ("spec", "policy"),
    [
        ("la2", LocalAgreement(2)),
        ("local-agreement:3", LocalAgreement(3)),
        ("mask:4", MaskK(4)),
        ("mask-k", MaskK(3)),
        ("biased:0.5", BiasedDecoding(0.5)),
        ("biased", BiasedDecoding()),
    ],
)
def test_parse_policy(spec: str, policy: object) -> None:
    assert parse_policy(spec) == policy


@pytest.mark.parametrize("spec", ["wait", "mask:x", "biased:2", "la0"])
def test_parse_policy_rejects(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_policy(spec)


def test_word_boundaries() -> None:
    tokens = [1, 2, 3, 4]  # "I will go"
    assert bounds.ok(tokens, 1, False)
    assert not bounds.ok(tokens, 2, False)  # "I wi|ll": inside a word
    assert bounds.ok(tokens, 3, False)
    assert not bounds.ok(tokens, 4, False)  # the last word may still grow
    assert bounds.ok(tokens, 4, True)  # ... unless eos followed it
    assert bounds.snap(tokens, 2, 0, False) == 1
    assert bounds.snap(tokens, 2, 2, False) == 2  # never below what is committed
    assert bounds.ok([4, 5, 1], 1, False)  # "go|," punctuation may follow a word
    assert not bounds.ok([6, 11, 12], 2, False)  # "我Tom|s": Latin word inside Chinese
    assert bounds.ok([6, 7, 6], 1, False) and bounds.ok([6, 7, 6], 2, False)  # characters


def test_byte_pieces_never_split_a_character() -> None:
    tokens = [6, 8, 9, 10, 6]  # 我 + the three UTF-8 bytes of one character + 我
    assert bounds.ok(tokens, 1, False)
    assert not bounds.ok(tokens, 2, False)
    assert not bounds.ok(tokens, 3, False)
    assert bounds.ok(tokens, 4, False)


def test_normalize_source() -> None:
    assert normalize_source("  I  will\tmeet \n") == "I will meet"
    assert normalize_source("e\u0301") == "\u00e9"
