"""How a transcript log's partials change, seen from the source side (what the recogniser
did): the input half of a replay's numbers, printed beside the translation's."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.evaluation.units import unit_spans
from engine.languages import Lang, normalize_lang


@dataclass(frozen=True)
class SourceRevisions:
    """How a log's partials change, seen from the source side (what the recogniser did).

    A change is two consecutive messages of a segment (the final included) with different
    text. It *revises* shown words when the earlier text is not a prefix of the later one
    unit by unit, allowing its last unit to be completed ("dr" -> "draw" is still being
    heard, not revised); ``revised_units`` counts the units of the earlier text that the
    later one alters or drops (on a unit alignment).
    """

    segments: int
    changes: int
    revising_changes: int
    revised_units: int
    finals_differing: int  # segments whose final is not the text of their last partial

    @property
    def revising_share(self) -> float | None:
        return self.revising_changes / self.changes if self.changes else None

    def format(self) -> str:
        share = self.revising_share
        mean = self.revised_units / self.revising_changes if self.revising_changes else 0.0
        return (
            f"{self.changes} source changes, {self.revising_changes} revising shown units "
            f"({'-' if share is None else f'{share:.0%}'}, {mean:.1f} units each); "
            f"{self.finals_differing}/{self.segments} finals differ from their last partial"
        )


def _revised_units(old: str, new: str, lang: Lang | None) -> int:
    """Units of ``old`` that ``new`` alters or drops (0 when it only extends it), counted
    on a unit alignment (difflib), so one misheard word early on counts once."""
    before = [old[a:b] for a, b in unit_spans(old, lang)]
    after = [new[a:b] for a, b in unit_spans(new, lang)]
    same = 0
    while same < min(len(before), len(after)) and before[same] == after[same]:
        same += 1
    if same == len(before):
        return 0
    if same == len(before) - 1 and len(after) > same and after[same].startswith(before[same]):
        return 0  # the last unit was only heard in part
    matcher = difflib.SequenceMatcher(a=before, b=after, autojunk=False)
    kept = sum(block.size for block in matcher.get_matching_blocks())
    return max(1, len(before) - kept)


def source_revisions(
    lines: Sequence[Mapping[str, Any]], lang: str | None = None
) -> SourceRevisions:
    """``SourceRevisions`` of a transcript log (any number of streams); ``lang`` None
    guesses each text's language."""
    target = normalize_lang(lang) if lang else None
    last: dict[tuple[str, int], str] = {}
    last_partial: dict[tuple[str, int], str | None] = {}
    changes = revising = units = differing = 0
    for line in lines:
        key = (str(line["stream_id"]), int(line["segment_id"]))
        text = str(line["text"])
        previous = last.get(key)
        if previous is not None and previous != text:
            changes += 1
            revised = _revised_units(previous, text, target)
            revising += revised > 0
            units += revised
        last[key] = text
        if line["is_final"]:
            partial = last_partial.get(key)
            differing += partial is not None and partial != text
        else:
            last_partial[key] = text
    return SourceRevisions(len(last), changes, revising, units, differing)
