"""Subtitle files (WebVTT, SRT) from final translations, laid out by a stated rule.

A final translation can be longer than a viewer can read in one subtitle, so each final is
cut into cues:

- lines of at most ``max_line_chars`` characters (42 for Latin script, 16 for Chinese,
  the common broadcast and streaming limits), broken at spaces, or for Chinese after
  punctuation where one is near the limit; at most ``max_lines`` lines per cue;
- cue times split the segment's audio span in proportion to the characters of each cue,
  then each cue is held long enough to read at ``max_cps`` characters per second (17 for
  Latin script, 9 for Chinese) and for at least ``min_duration_ms``, into the silence
  after the segment but never past ``gap_ms`` before the next segment's first cue, and
  never longer than ``max_duration_ms``.

The text of each cue is converted by pysubs2 (a maintained subtitle library); the cue
blocks around it are written here, so that a file can grow a final at a time (`render`
numbers cues from any point: `serve --record` appends) and so that times of 100 hours or
more keep their value: hours take as many digits as they need (WebVTT allows two or more;
SRT readers such as the `srt` library read them), where pysubs2 would clamp every such
time to 99:59:59.999 and make zero-length cues.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.languages import CJK_TEXT_SHARE, cjk_share

if TYPE_CHECKING:
    import pysubs2

# Punctuation after which a Chinese line may break early (keeps phrases together).
_CJK_BREAKS = "，。！？；：、,.!?;:"


@dataclass(frozen=True)
class CueRules:
    """How finals become cues; ``None`` picks the value for the text's script."""

    max_line_chars: int | None = None
    max_lines: int = 2
    max_cps: float | None = None
    min_duration_ms: float = 833.0  # 5/6 s, the usual minimum
    max_duration_ms: float = 7000.0
    gap_ms: float = 83.0  # two frames at 24 fps between consecutive cues

    def __post_init__(self) -> None:
        if self.max_line_chars is not None and self.max_line_chars < 4:
            raise ValueError("max_line_chars must be at least 4")
        if self.max_lines < 1:
            raise ValueError("max_lines must be at least 1")
        if self.max_cps is not None and self.max_cps <= 0:
            raise ValueError("max_cps must be positive")
        if not 0 < self.min_duration_ms <= self.max_duration_ms:
            raise ValueError("need 0 < min_duration_ms <= max_duration_ms")

    def for_text(self, text: str) -> tuple[int, float]:
        """(max line characters, max characters per second) for this text's script."""
        cjk = _is_cjk_text(text)
        chars = self.max_line_chars or (16 if cjk else 42)
        cps = self.max_cps or (9.0 if cjk else 17.0)
        return chars, cps


@dataclass(frozen=True)
class Final:
    """One final translation and the audio span (ms) of the speech it translates."""

    start_ms: float
    end_ms: float
    text: str


@dataclass(frozen=True)
class Cue:
    start_ms: float
    end_ms: float
    lines: tuple[str, ...]

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@functools.lru_cache(maxsize=1024)
def _is_cjk_text(text: str) -> bool:
    """Whether `text` is laid out as CJK script (kana and hangul count, not only ideographs).
    Cached: a final is laid out again when the next one comes (`final_cues`), and the
    test reads every character."""
    share = cjk_share(text)
    return share is not None and share >= CJK_TEXT_SHARE


def wrap(text: str, max_chars: int) -> list[str]:
    """Lines of at most ``max_chars`` characters (a longer word gets a line of its own)."""
    text = " ".join(text.split())
    if not text:
        return []
    if _is_cjk_text(text):
        return _wrap_cjk(text, max_chars)
    lines: list[str] = []
    line = ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > max_chars:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    lines.append(line)
    return lines


def _wrap_cjk(text: str, max_chars: int) -> list[str]:
    lines = []
    rest = text
    while len(rest) > max_chars:
        cut = max_chars
        # Break after punctuation in the last third of the line, if there is one.
        for i in range(max_chars, max(1, (2 * max_chars) // 3) - 1, -1):
            if rest[i - 1] in _CJK_BREAKS:
                cut = i
                break
        lines.append(rest[:cut].strip())
        rest = rest[cut:].strip()
    if rest:
        lines.append(rest)
    return lines


def layout(finals: Sequence[Final], rules: CueRules = CueRules()) -> list[Cue]:
    """Cues for ``finals`` (in time order) by ``rules``; empty finals give no cue."""
    order = sorted((f for f in finals if f.text.strip()), key=lambda f: f.start_ms)
    cues: list[Cue] = []
    for index, final in enumerate(order):
        next_start = order[index + 1].start_ms if index + 1 < len(order) else float("inf")
        cues += final_cues(final, next_start, rules)
    return cues


def final_cues(final: Final, next_start: float, rules: CueRules = CueRules()) -> list[Cue]:
    """The cues of one (non-empty) final when the next final starts at ``next_start``
    (``inf``: none yet). Only the last cue's end depends on ``next_start``: a file written
    a final at a time rewrites that one cue when the next final comes."""
    max_chars, cps = rules.for_text(final.text)
    lines = wrap(final.text, max_chars)
    groups = [tuple(lines[i : i + rules.max_lines]) for i in range(0, len(lines), rules.max_lines)]
    sizes = [sum(len(line) for line in group) for group in groups]
    span = max(0.0, final.end_ms - final.start_ms)
    start = final.start_ms
    cues: list[Cue] = []
    for n, (group, size) in enumerate(zip(groups, sizes, strict=True)):
        share = span * size / sum(sizes)
        last = n == len(groups) - 1
        # The next cue of this final starts where this one's share of the speech ends;
        # the last may run into the silence, up to the next final.
        limit = start + share if not last else next_start - rules.gap_ms
        wanted = max(share, size / cps * 1000.0, rules.min_duration_ms)
        end = min(start + min(wanted, rules.max_duration_ms), max(limit, start + share))
        end = max(end, start + 1.0)
        cues.append(Cue(round(start), round(end), group))
        start = start + share
    return cues


def timestamp(ms: float, format_: str) -> str:
    """``HH:MM:SS.mmm`` (vtt) or ``HH:MM:SS,mmm`` (srt); negative times are 0, and hours
    take more than two digits from 100 h on instead of being clamped."""
    total = max(0, int(ms))
    seconds, millis = divmod(total, 1000)
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    sep = "," if format_ == "srt" else "."
    return f"{hours:02d}:{minutes:02d}:{seconds:02d}{sep}{millis:03d}"


def header(format_: str) -> str:
    """What a file starts with before its first cue."""
    return "WEBVTT\n\n" if _kind(format_) == "vtt" else ""


def render(cues: Iterable[Cue], format_: str, first: int = 1) -> str:
    """The cue blocks of ``cues``, numbered from ``first``, as pysubs2 would write them
    (number, times, text, blank line), without the file's header."""
    sep = _kind(format_)
    blocks = []
    for number, cue in enumerate(cues, first):
        start, end = timestamp(cue.start_ms, sep), timestamp(cue.end_ms, sep)
        blocks.append(f"{number}\n{start} --> {end}\n{_text(cue)}\n\n")
    return "".join(blocks)


def _kind(format_: str) -> str:
    if format_ not in ("vtt", "srt"):
        raise ValueError(f"subtitle format must be vtt or srt, not {format_!r}")
    return format_


def _text(cue: Cue) -> str:
    """The cue's text as pysubs2 writes it in SRT and WebVTT (override tags in braces
    dropped, line breaks kept, blank lines removed)."""
    # One event timed 0-0, so that pysubs2's own (clamping) timestamps never matter: the
    # text is what follows its number and timing lines.
    block = _ssa([Cue(0, 0, cue.lines)]).to_string("srt")
    return block.split("\n", 2)[2][: -len("\n\n")]


def _ssa(cues: Iterable[Cue]) -> pysubs2.SSAFile:
    import pysubs2

    subs = pysubs2.SSAFile()
    for cue in cues:
        subs.append(
            pysubs2.SSAEvent(
                start=int(cue.start_ms), end=int(cue.end_ms), text="\\N".join(cue.lines)
            )
        )
    return subs


def write(path: str | Path, cues: Iterable[Cue], format_: str | None = None) -> Path:
    """Write ``cues`` as WebVTT or SRT (``format_`` 'vtt'/'srt', or from the suffix)."""
    out = Path(path)
    kind = format_ or out.suffix.lstrip(".").lower()
    if kind not in ("vtt", "srt"):
        raise ValueError(f"{out}: subtitle format must be vtt or srt, not {kind!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    if kind == "vtt":  # WebVTT wants cues in order of start (finals whose speech overlaps)
        cues = sorted(cues, key=lambda cue: cue.start_ms)
    out.write_text(header(kind) + render(cues, kind), encoding="utf-8", newline="\n")
    return out
