"""The writer's ledger of final transcripts (protocol/writer.py): which replies answer a
final, in which languages, what is a duplicate, when to reconnect, what to resend."""

from __future__ import annotations

import pytest

from protocol import (
    Backoff,
    ErrorCode,
    ErrorMessage,
    FinalLedger,
    Outcome,
    Pacer,
    PartialTranscript,
    Received,
    TranslationUpdate,
)


def final(
    seq: int, stream: str = "s", segment: int | None = None, text: str = "hi"
) -> PartialTranscript:
    return PartialTranscript(stream, seq if segment is None else segment, seq, text, True)


def partial(seq: int, stream: str = "s") -> PartialTranscript:
    return PartialTranscript(stream, seq, seq, "h", False)


def update(
    seq: int, lang: str | None = None, stream: str = "s", is_final: bool = True
) -> TranslationUpdate:
    return TranslationUpdate(
        stream, seq, seq, "x", "" if is_final else "y", is_final, 1.0, 1.0, lang=lang
    )


def error(
    seq: int | None,
    code: ErrorCode = ErrorCode.OUT_OF_ORDER,
    lang: str | None = None,
    stream: str | None = "s",
) -> ErrorMessage:
    return ErrorMessage(code, "refused", stream_id=stream, seq=seq, lang=lang)


def keys(events: list[PartialTranscript]) -> list[tuple[str, int]]:
    return [(e.stream_id, e.seq) for e in events]


def test_a_final_is_owed_until_its_final_update_and_partials_are_never_kept() -> None:
    ledger = FinalLedger()
    ledger.sent(partial(0))
    ledger.sent(final(1))
    assert keys(ledger.owed()) == [("s", 1)] and ledger.pending == 1
    # A partial's update, or another final's, answers nothing.
    assert ledger.received(update(0, is_final=False)) == Received(Outcome.UNRELATED)
    assert ledger.received(update(7)) == Received(Outcome.UNRELATED)
    assert ledger.pending == 1
    got = ledger.received(update(1))
    assert got == Received(Outcome.ANSWERED, final(1), None, complete=True)
    assert ledger.owed() == [] and ledger.answered == 1
    assert ledger.languages == (None,)  # a server that does not name languages


def test_owed_is_in_the_order_sent_across_streams_and_per_stream() -> None:
    ledger = FinalLedger()
    for event in [final(3, "b"), final(1, "a"), final(5, "b"), final(2, "a")]:
        ledger.sent(event)
    assert keys(ledger.owed()) == [("b", 3), ("a", 1), ("b", 5), ("a", 2)]
    assert keys(ledger.owed("a")) == [("a", 1), ("a", 2)]
    ledger.received(update(1, stream="a"))
    assert keys(ledger.owed()) == [("b", 3), ("b", 5), ("a", 2)]
    # Resending keeps each final in its place (it is the same final, sent again).
    for event in ledger.owed():
        ledger.sent(event)
    assert keys(ledger.owed()) == [("b", 3), ("b", 5), ("a", 2)] and ledger.resent == 3


def test_fan_out_a_final_is_answered_once_every_known_language_has() -> None:
    ledger = FinalLedger()
    ledger.sent(partial(0))
    # Partials' updates teach the languages before the final is sent.
    ledger.received(update(0, "zh", is_final=False))
    ledger.received(update(0, "de", is_final=False))
    assert ledger.languages == ("zh", "de")
    ledger.sent(final(1))
    got = ledger.received(update(1, "zh"))
    assert (got.outcome, got.lang, got.complete) == (Outcome.ANSWERED, "zh", False)
    assert ledger.missing(final(1)) == {"de"} and keys(ledger.owed()) == [("s", 1)]
    got = ledger.received(update(1, "de"))
    assert (got.outcome, got.lang, got.complete) == (Outcome.ANSWERED, "de", True)
    assert ledger.owed() == [] and ledger.missing(final(1)) == frozenset()
    assert ledger.answered == 1


def test_with_no_language_known_the_first_answer_is_enough_later_ones_are_new() -> None:
    """A final answered before a language was seen stays answered; that language's answer,
    when it comes, is an answer (to show), not a duplicate."""
    ledger = FinalLedger()
    ledger.sent(final(1))
    assert ledger.missing(final(1)) == {None}
    assert ledger.received(update(1, "zh")).complete
    assert ledger.owed() == []
    got = ledger.received(update(1, "de"))
    assert (got.outcome, got.lang, got.complete) == (Outcome.ANSWERED, "de", True)
    assert ledger.duplicates == 0 and ledger.answered == 1
    # The next final needs both.
    ledger.sent(final(2))
    assert not ledger.received(update(2, "de")).complete
    assert ledger.received(update(2, "zh")).complete


def test_languages_given_up_front() -> None:
    ledger = FinalLedger(languages=["zh", "de"])
    ledger.sent(final(1))
    assert not ledger.received(update(1, "de")).complete
    assert ledger.missing(final(1)) == {"zh"}


def test_a_language_learned_later_is_owed_by_finals_still_owed() -> None:
    ledger = FinalLedger()
    ledger.sent(final(1))
    ledger.sent(final(2))
    assert ledger.received(update(1, "zh")).complete
    assert ledger.received(update(1, "de")).outcome is Outcome.ANSWERED  # learned: de
    assert not ledger.received(update(2, "zh")).complete  # 2 owes de now
    assert ledger.missing(final(2)) == {"de"}


def test_errors_answer_their_language_or_every_language() -> None:
    ledger = FinalLedger(languages=["zh", "de"])
    for seq in (1, 2, 3):
        ledger.sent(final(seq))
    # Without lang: the message itself was refused, for every language.
    got = ledger.received(error(1, ErrorCode.TOO_LARGE))
    assert (got.outcome, got.lang, got.complete) == (Outcome.ANSWERED, None, True)
    # With lang: translating into that language failed; the other still owes it.
    got = ledger.received(error(2, ErrorCode.INTERNAL, lang="de"))
    assert (got.outcome, got.lang, got.complete) == (Outcome.ANSWERED, "de", False)
    assert ledger.missing(final(2)) == {"zh"}
    assert ledger.received(update(2, "zh")).complete
    # An update, then an error without lang for the rest.
    ledger.received(update(3, "zh"))
    assert ledger.received(error(3, ErrorCode.INTERNAL)).complete
    assert ledger.owed() == [] and ledger.answered == 3 and ledger.refused == 3
    # An error that names no final is nobody's answer.
    assert ledger.received(error(None, ErrorCode.UNKNOWN_STREAM)).outcome is Outcome.UNRELATED
    assert ledger.received(error(9, stream=None)).outcome is Outcome.UNRELATED
    # An error about a partial's seq: not about a final.
    ledger.sent(partial(4))
    assert ledger.received(error(4, ErrorCode.RATE_LIMITED)).outcome is Outcome.UNRELATED


def test_an_error_teaches_its_language() -> None:
    ledger = FinalLedger()
    ledger.sent(final(1))
    ledger.sent(final(2))
    assert ledger.received(error(1, ErrorCode.INTERNAL, lang="de")).complete
    assert ledger.languages == ("de",)
    assert not ledger.received(update(2, "zh")).complete  # de and zh known now


def test_unavailable_about_an_owed_final_means_reconnect_and_answers_nothing() -> None:
    ledger = FinalLedger(languages=["zh", "de"])
    ledger.sent(final(1))
    ledger.sent(partial(2))
    got = ledger.received(error(1, ErrorCode.UNAVAILABLE))
    assert got == Received(Outcome.MUST_RECONNECT, final(1), None, False)
    ledger.received(update(1, "zh"))
    got = ledger.received(error(1, ErrorCode.UNAVAILABLE, lang="de"))  # cut off in de
    assert (got.outcome, got.lang) == (Outcome.MUST_RECONNECT, "de")
    assert keys(ledger.owed()) == [("s", 1)] and ledger.missing(final(1)) == {"de"}
    # About a partial, or about no seq (a close_stream): nothing to resend.
    assert ledger.received(error(2, ErrorCode.UNAVAILABLE)).outcome is Outcome.UNRELATED
    assert ledger.received(error(None, ErrorCode.UNAVAILABLE)).outcome is Outcome.UNRELATED
    assert ledger.refused == 0 and ledger.answered == 0


def test_unavailable_in_a_language_learned_after_the_answer_reopens_the_final() -> None:
    ledger = FinalLedger()
    for seq in (1, 2, 3):
        ledger.sent(final(seq))
    assert ledger.received(update(1, "zh")).complete
    assert ledger.received(update(2, "zh")).complete
    got = ledger.received(error(1, ErrorCode.UNAVAILABLE, lang="de"))
    assert (got.outcome, got.final, got.lang) == (Outcome.MUST_RECONNECT, final(1), "de")
    # Owed again, in its first place, ahead of 3. Final 2 stays answered: it was
    # answered when only zh was known, and nothing says de failed on it.
    assert keys(ledger.owed()) == [("s", 1), ("s", 3)] and ledger.answered == 1
    assert ledger.missing(final(1)) == {"de"}
    # Unavailable about a final answered in every language: stale, nothing to do.
    ledger.received(update(1, "de"))
    assert ledger.received(error(1, ErrorCode.UNAVAILABLE, lang="de")).outcome is (
        Outcome.UNRELATED
    )


def test_duplicates_after_a_resend_are_counted_not_answers() -> None:
    ledger = FinalLedger(languages=["zh", "de"])
    ledger.sent(final(1))
    ledger.sent(final(2))
    ledger.received(update(1, "zh"))  # then the connection dropped
    for event in ledger.owed():
        ledger.sent(event)
    assert ledger.resent == 2
    # The new node answers zh from its history (seen already) and translates de.
    got = ledger.received(update(1, "zh"))
    assert (got.outcome, got.final, got.lang) == (Outcome.DUPLICATE, final(1), "zh")
    assert ledger.received(update(1, "de")).complete
    # Both nodes answered final 2 (a race): the second answer, in each language, is a
    # duplicate, also after the final left the owed list.
    assert not ledger.received(update(2, "zh")).complete
    assert ledger.received(update(2, "zh")).outcome is Outcome.DUPLICATE
    assert ledger.received(update(2, "de")).complete
    assert ledger.received(update(2, "de")) == Received(
        Outcome.DUPLICATE, final(2), "de", complete=True
    )
    assert ledger.received(error(2, ErrorCode.INTERNAL)).outcome is Outcome.DUPLICATE
    assert ledger.duplicates == 4 and ledger.answered == 2 and ledger.owed() == []


def test_after_an_error_for_every_language_any_answer_is_a_duplicate() -> None:
    ledger = FinalLedger(languages=["zh"])
    ledger.sent(final(1))
    ledger.received(error(1, ErrorCode.OUT_OF_ORDER))
    assert ledger.received(update(1, "zh")).outcome is Outcome.DUPLICATE
    ledger.sent(final(2))
    ledger.received(error(2, ErrorCode.INTERNAL))
    assert ledger.received(update(2, "de")).outcome is Outcome.DUPLICATE


def test_resend_counts_and_held_finals() -> None:
    """A final held while there is no connection is owed; sending it the first time is
    not a resend."""
    ledger = FinalLedger()
    ledger.sent(final(1))
    ledger.hold(final(2))
    ledger.hold(partial(3))
    assert keys(ledger.owed()) == [("s", 1), ("s", 2)]
    for event in ledger.owed():
        ledger.sent(event)
    assert ledger.resent == 1


def test_a_reused_key_is_a_new_final() -> None:
    """A stream closed and opened again numbers its seqs from 0: an answer remembered under
    (stream, seq) says nothing about the new final."""
    ledger = FinalLedger()
    ledger.sent(final(0, text="first life"))
    assert ledger.received(update(0)).complete
    second = final(0, text="second life")
    ledger.sent(second)
    assert ledger.owed() == [second] and ledger.resent == 0
    got = ledger.received(update(0))
    assert (got.outcome, got.final) == (Outcome.ANSWERED, second)


def test_remember_bounds_the_answered_finals_kept() -> None:
    ledger = FinalLedger(remember=2)
    for seq in range(4):
        ledger.sent(final(seq))
        ledger.received(update(seq))
    assert ledger.received(update(3)).outcome is Outcome.DUPLICATE
    assert ledger.received(update(0)).outcome is Outcome.UNRELATED  # forgotten
    with pytest.raises(ValueError):
        FinalLedger(remember=-1)
    forgetful = FinalLedger(remember=0)
    forgetful.sent(final(1))
    assert forgetful.received(update(1)).complete
    assert forgetful.received(update(1)).outcome is Outcome.UNRELATED


def test_stream_ids_are_compared_normalised() -> None:
    """Messages normalise stream ids to NFC, so the two spellings of "é" are one stream."""
    ledger = FinalLedger()
    ledger.sent(final(1, stream="caf\u00e9"))
    assert ledger.received(update(1, stream="cafe\u0301")).complete


def test_backoff_doubles_to_its_most_and_gives_up_past_its_total() -> None:
    backoff = Backoff(first=0.1, most=2.0, total=30.0)
    assert [backoff.delay(n) for n in range(7)] == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert backoff.delay(10_000) == 2.0  # no overflow
    assert not backoff.gives_up(27.9, 10) and backoff.gives_up(28.1, 10)
    assert Backoff(total=0).gives_up(0.0, 0)  # 0: never retry
    for bad in ({"first": 0.0}, {"first": 3.0}, {"total": -1.0}):
        with pytest.raises(ValueError):
            Backoff(**bad)


def test_a_final_the_server_did_not_take_for_its_rate_is_still_owed() -> None:
    """`rate_limited` about a final is no answer: the server dropped it, so it is sent
    again (on a new connection, where its stream takes its seq)."""
    ledger = FinalLedger()
    ledger.sent(final(1))
    got = ledger.received(error(1, ErrorCode.RATE_LIMITED))
    assert got == Received(Outcome.MUST_RECONNECT, final(1), None, False)
    assert keys(ledger.owed()) == [("s", 1)] and ledger.refused == 0
    ledger.sent(final(1))
    assert ledger.received(update(1)).complete and ledger.resent == 1


def test_the_pacer_keeps_a_rate_coalescing_partials() -> None:
    pacer = Pacer(10.0, now=0.0)
    assert [pacer.take(0.0) for _ in range(11)] == [True] * 10 + [False]  # a burst of 10
    assert pacer.delay(0.0) == pytest.approx(0.1) and pacer.take(0.1)
    pacer.park(partial(1))
    pacer.park(partial(2))  # latest wins
    pacer.park(partial(3, stream="t"))
    pacer.park(partial(4))  # keeps its stream's place in the line
    assert (pacer.parked, pacer.coalesced) == (2, 2)
    pacer.unpark("t")  # a newer event of "t" went out first
    assert pacer.next_parked() == partial(4) and pacer.next_parked() is None
    assert pacer.coalesced == 3
    # `rate_limited`: half the rate, at most once a second, the burst spent.
    pacer.slow_down(1.0)
    assert (pacer.rate, pacer.burst, pacer.tokens) == (5.0, 5.0, 0.0)
    pacer.slow_down(1.5)  # the same burst's other errors
    assert pacer.rate == 5.0 and pacer.delay(1.5) == pytest.approx(0.2)
    for now in (3.0, 4.0, 5.0, 6.0):
        pacer.slow_down(now)
    assert pacer.rate == 1.0 and pacer.slowed == 4  # 2.5, 1.25, then its floor
