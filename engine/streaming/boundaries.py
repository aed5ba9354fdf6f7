"""Where a stream may commit: cuts in the target tokens, and which source words are settled.

Pure rules over token pieces and texts, with no session state, apart from the session that
applies them (`engine.streaming.session`) so that each can be read and tested alone:
`BoundaryFinder` says where a target token sequence may be cut without splitting a word or
a character; `settled_source` and `shared_words` say which words of a partial's source are
settled (by the recogniser's hint, or by the last partials agreeing); `extends_words` says
whether the recogniser only added to what it showed (`StreamingOptions.source_agreement`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.languages import is_cjk
from engine.streaming.policies import common_prefix_length


def word_char(ch: str) -> bool:
    """A character that belongs to a space-delimited word (CJK characters stand alone)."""
    return ch.isalnum() and not is_cjk(ch)


def _is_byte_piece(piece: str) -> bool:
    return len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")


class BoundaryFinder:
    """Where a target token sequence may be cut without splitting a word or character."""

    def __init__(self, pieces: Callable[[int], str]) -> None:
        self._piece = pieces

    def ok(self, tokens: Sequence[int], k: int, finished: bool) -> bool:
        """May the first `k` tokens be committed? `finished`: eos followed the tokens."""
        if k <= 0:
            return True
        if k >= len(tokens):
            return finished and k == len(tokens)
        prev, nxt = self._piece(tokens[k - 1]), self._piece(tokens[k])
        if not prev.strip("\u2581 "):
            # A lone word-start marker shows nothing, yet committing it forces every later
            # hypothesis of the segment to start its next word without the marker: the
            # usual piece ("\u2581你") can no longer come, and the model drops or garbles the
            # word (the offline fixture lost its subjects this way).
            return False
        if _is_byte_piece(nxt):
            # Byte-fallback pieces spell one character over several tokens: cut only where
            # a new character starts (a UTF-8 lead byte, not a 10xxxxxx continuation byte).
            return not 0x80 <= int(nxt[3:5], 16) <= 0xBF
        if nxt.startswith("\u2581"):
            return True
        return not (prev and nxt and word_char(prev[-1]) and word_char(nxt[0]))

    def first_word_end(self, tokens: Sequence[int], floor: int, finished: bool) -> int:
        """The shortest cut past `floor`: where the first word after it ends (a Chinese
        character, or a piece such as "\u2581凯特"); `floor` when there is none yet."""
        for k in range(floor + 1, len(tokens) + 1):
            if self.ok(tokens, k, finished):
                return k
        return floor

    def snap(self, tokens: Sequence[int], k: int, floor: int, finished: bool) -> int:
        """Largest allowed cut in [floor, k]; `floor` (already committed) always is."""
        k = min(k, len(tokens))
        while k > floor and not self.ok(tokens, k, finished):
            k -= 1
        return max(k, floor)


def shared_words(sources: Sequence[str]) -> str:
    """The words every one of `sources` starts with (local agreement on the source)."""
    split = [source.split() for source in sources]
    return " ".join(split[0][: common_prefix_length(split)]) if split else ""


def settled_source(text: str, stable_chars: int) -> str:
    """The part of `text` a recogniser's `stable_chars` settles, cut back to the last word
    boundary when the count ends inside a word (a half-confirmed word is not confirmed);
    texts without spaces (Chinese, Japanese) are cut at the character."""
    cut = text[:stable_chars]
    if stable_chars < len(text) and not text[stable_chars].isspace() and not cut.endswith(" "):
        space = max(cut.rfind(" "), cut.rfind("\t"))
        if space >= 0:
            cut = cut[:space]
        elif " " in text:
            cut = ""  # the first word itself is not settled
    return cut


def extends_words(before: str, after: str) -> bool:
    """Whether `after` keeps every word of `before`, its last one possibly completed
    ("dr" -> "draw"): the recogniser added to what it showed without rewriting it."""
    old, new = before.split(), after.split()
    if not old:
        return False  # nothing was shown yet, so nothing was confirmed
    if len(new) < len(old):
        return False
    if old[:-1] != new[: len(old) - 1]:
        return False
    return new[len(old) - 1].startswith(old[-1])
