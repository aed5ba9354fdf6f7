"""examples/replay_client.py's helpers: the page URL it prints and `--stream-id`."""

from __future__ import annotations

import sys

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "examples"))
from replay_client import page_url, read_log, renamer

LOGS = ROOT / "examples" / "logs"


def test_page_url_follows_the_websocket_url() -> None:
    assert page_url("ws://127.0.0.1:8765/ws", "mic-1") == "http://127.0.0.1:8765/?stream=mic-1"
    assert page_url("wss://subs.example:8443/ws", "a b", "s3cret") == (
        "https://subs.example:8443/?stream=a+b&token=s3cret"
    )


def test_stream_id_renames_one_stream_or_prefixes_several() -> None:
    one = read_log(LOGS / "fixture_en_zh.jsonl")
    renamed = read_log(LOGS / "fixture_en_zh.jsonl", renamer(one, "mic-1"))
    assert {line.event.stream_id for line in renamed} == {"mic-1"}
    assert [line.event.text for line in renamed] == [line.event.text for line in one]
    two = read_log(LOGS / "fixture_two_streams.jsonl")
    renamed = read_log(LOGS / "fixture_two_streams.jsonl", renamer(two, "talk"))
    assert {line.event.stream_id for line in renamed} == {"talk-left", "talk-right"}
    assert renamer(one, None)("s1") == "s1"


def test_a_final_is_lost_in_each_language_that_did_not_answer_it() -> None:
    """With fan-out a writer hears every language: a final counts as answered in a
    language by its final update there, or by an error about that language or about the
    message itself (no language)."""
    from replay_client import ReplayResult

    result = ReplayResult(finals_expected={("s", 3), ("s", 7), ("s", 9)})
    assert result.lost_finals == {("s", 3, None), ("s", 7, None), ("s", 9, None)}
    result.languages |= {"zh", "de"}
    result.finals_received |= {("s", 3, "zh"), ("s", 3, "de"), ("s", 7, "zh")}
    result.finals_refused |= {("s", 9, None)}  # refused as a message: every language
    assert result.lost_finals == {("s", 7, "de")}
    result.finals_refused.add(("s", 7, "de"))  # the German model failed on it
    assert result.lost_finals == set()
