"""Commit policies and word/character boundaries, on hand-made token sequences."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.streaming.boundaries import BoundaryFinder
from engine.streaming.policies import (
    BiasedDecoding,
    FirstWord,
    LocalAgreement,
    MaskK,
    bias_toward,
    common_prefix_length,
    default_policy,
    parse_policy,
)
from engine.streaming.session import normalize_source

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
    13: "\u2581",
    14: "要在",
}
bounds = BoundaryFinder(lambda i: PIECES[i])


def test_common_prefix_length() -> None:
    assert common_prefix_length([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert common_prefix_length([[1, 2, 3]]) == 3
    assert common_prefix_length([[5], [6]]) == 0
    assert common_prefix_length([]) == 0
    # A later sequence that parts earlier than the second one does sets the length.
    assert common_prefix_length([[1, 2, 3, 4], [1, 2, 3, 9], [1, 7, 3, 4]]) == 1
    assert common_prefix_length([["a", "b"], ("a", "b", "c")]) == 2  # any sequences


def test_common_prefix_length_is_the_longest_prefix_all_share() -> None:
    rng = random.Random(3)
    for _ in range(2000):
        seqs = [
            [rng.randrange(3) for _ in range(rng.randrange(6))] for _ in range(rng.randrange(1, 5))
        ]
        shared = 0
        while all(len(s) > shared for s in seqs) and len({s[shared] for s in seqs}) == 1:
            shared += 1
        assert common_prefix_length(seqs) == shared, seqs


def test_local_agreement_commits_the_agreed_prefix() -> None:
    la = LocalAgreement(2)
    assert la.propose([[1, 2, 3]], committed=0).commit == 0  # one hypothesis: nothing yet
    p = la.propose([[1, 2, 3], [1, 2, 4, 5]], committed=0)
    assert (p.commit, p.display) == (2, 4)
    assert LocalAgreement(3).propose([[1, 9], [1, 2, 3], [1, 2, 4]], 0).commit == 1


def test_first_word_agrees_once_and_then_waits_for_the_final() -> None:
    fw = FirstWord(2)
    assert fw.propose([[1, 2, 3]], committed=0).commit == 0  # one hypothesis: nothing yet
    p = fw.propose([[1, 2, 3], [1, 2, 4, 5]], committed=0)
    # what agrees, limited to the first word by the session (which knows the words)
    assert (p.commit, p.display, p.first_word) == (2, 4, True)
    p = fw.propose([[1, 2, 3, 4], [1, 2, 3, 4, 5]], committed=1)
    assert (p.commit, p.display, p.first_word) == (1, 5, False)  # committed: no more
    assert default_policy(prefix_trained=True) == LocalAgreement(2)
    assert default_policy(prefix_trained=False) == FirstWord(2)


def test_first_word_end() -> None:
    assert bounds.first_word_end([1, 2, 3, 4], 0, False) == 1  # "I"
    assert bounds.first_word_end([2, 3, 4], 0, False) == 2  # "will": two pieces
    assert bounds.first_word_end([13, 14, 6], 0, False) == 2  # "\u2581" + "要在"
    assert bounds.first_word_end([2, 3], 0, False) == 0  # the only word may still grow
    assert bounds.first_word_end([2, 3], 0, True) == 2  # ... unless eos followed it


def test_an_ordinary_model_commits_only_its_first_word_before_the_final() -> None:
    """The offline-trained fixture gets `FirstWord` by default: however long the partials
    agree, only the first word becomes stable; the final is still the offline translation."""
    from engine import Translator
    from engine.streaming.session import StreamingOptions, StreamSession
    from protocol import PartialTranscript
    from tests.conftest import FIXTURE_MODEL, FIXTURE_OFFLINE_MODEL, needs_fixture

    needs_fixture()
    tr = Translator.from_dir(FIXTURE_OFFLINE_MODEL)
    session = StreamSession("s", tr, StreamingOptions())
    assert session.policy == FirstWord(2)
    words = "kate helps jack every evening".split()
    updates = []
    for seq in range(len(words)):
        update = session.answer(PartialTranscript("s", 1, seq, " ".join(words[: seq + 1]), False))
        assert update is not None
        updates.append(update)
    assert {u.stable_text for u in updates} <= {"", "凯特"}
    assert updates[-1].stable_text == "凯特"
    final = session.answer(PartialTranscript("s", 1, 9, " ".join(words), True))
    assert final is not None and not final.revised
    assert final.stable_text == tr.translate([" ".join(words)])[0].text
    prefix = StreamSession("s", Translator.from_dir(FIXTURE_MODEL), StreamingOptions())
    assert prefix.policy == LocalAgreement(2)


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
        ("first-word", FirstWord(2)),
        ("first-word:3", FirstWord(3)),
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


def test_a_lone_word_start_marker_is_never_the_last_committed_piece() -> None:
    """Committing a bare "\u2581" shows nothing but forces the next word to come without its
    marker (the usual "\u2581你" is then impossible): it is not a boundary."""
    tokens = [13, 14, 6]  # "\u2581" + "要在" + "我"
    assert not bounds.ok(tokens, 1, False)
    assert bounds.ok(tokens, 2, False)
    assert bounds.snap(tokens, 1, 0, False) == 0
    assert not bounds.ok([6, 13, 14], 2, False)  # after a character, a lone marker too
    assert bounds.ok([6, 13, 14], 1, False)


def test_a_partial_never_commits_an_invisible_prefix_that_changes_later_hypotheses() -> None:
    """On the offline fixture "park will" and "park will not" translate to "\u2581" + "要在"
    ... and "\u2581" + "不会" ...: LocalAgreement-2 must not commit the bare marker they
    share, as it would be forced on the next partial and "you will not cook a cake" would
    lose its subject (你): what a recogniser's corrected first word looks like."""
    from engine import Translator
    from engine.streaming.session import StreamingOptions, StreamSession
    from protocol import PartialTranscript
    from tests.conftest import FIXTURE_OFFLINE_MODEL, needs_fixture

    needs_fixture()
    tr = Translator.from_dir(FIXTURE_OFFLINE_MODEL)
    session = StreamSession("s", tr, StreamingOptions())
    texts = ["park will", "park will not", "you will not cook a cake"]
    updates = [
        session.answer(PartialTranscript("s", 1, seq, text, False))
        for seq, text in enumerate(texts)
    ]
    last = updates[-1]
    assert last is not None
    assert last.stable_text == ""
    assert last.unstable_text == tr.translate([texts[-1]])[0].text
    assert last.unstable_text.startswith("你")


def test_normalize_source() -> None:
    assert normalize_source("  I  will\tmeet \n") == "I will meet"
    assert normalize_source("e\u0301") == "\u00e9"
