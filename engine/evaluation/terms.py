"""Term accuracy: how a glossary's terms fared in a run's updates (replay's report, the
glossary benchmark).

- **Finals**: of the terms matched in final sources, how many their translations hold.
- **Partials**: of the terms whose source completed in a partial, how many the first
  update after it showed (stable or tentative text).
- **Stable revisions**: finals whose text does not begin with the stable text shown
  before them (a term must never be the cause of one; the report counts them all).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from engine.glossary import Glossary, holds
from protocol import TranslationUpdate


@dataclass(frozen=True)
class TermAccuracy:
    """Counts over a run's updates (module docstring)."""

    final_matched: int
    final_placed: int
    partial_matched: int
    partial_shown_first: int
    stable_revisions: int

    @property
    def final_share(self) -> float | None:
        return self.final_placed / self.final_matched if self.final_matched else None

    @property
    def partial_share(self) -> float | None:
        return self.partial_shown_first / self.partial_matched if self.partial_matched else None

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "final_share": self.final_share,
            "partial_share": self.partial_share,
        }

    def format(self) -> str:
        def share(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}"

        return (
            f"finals {share(self.final_share)} ({self.final_placed}/{self.final_matched}), "
            f"first partial after the source {share(self.partial_share)} "
            f"({self.partial_shown_first}/{self.partial_matched}), "
            f"stable revisions {self.stable_revisions}"
        )


def term_accuracy(
    updates: Iterable[TranslationUpdate], glossary: Glossary, lang: str | None
) -> TermAccuracy:
    """`TermAccuracy` of `updates` (in the order they were published; one language) for
    the glossary `glossary` of target language `lang`."""
    final_matched = final_placed = partial_matched = shown = revisions = 0
    seen: dict[tuple[str, int], set[str]] = {}  # per segment: terms already counted
    stable: dict[tuple[str, int], str] = {}
    for update in updates:
        key = (update.stream_id, update.segment_id)
        source = update.source_text or ""
        if update.is_final:
            targets = glossary.targets(source)
            final_matched += len(targets)
            final_placed += sum(holds(update.stable_text, t, lang) for t in targets)
            if not update.stable_text.startswith(stable.pop(key, "")):
                revisions += 1
            seen.pop(key, None)
            continue
        stable[key] = update.stable_text
        counted = seen.setdefault(key, set())
        text = update.stable_text + update.unstable_text
        for target in glossary.targets(source, partial=True):
            if target in counted:
                continue
            counted.add(target)
            partial_matched += 1
            shown += holds(text, target, lang)
    return TermAccuracy(final_matched, final_placed, partial_matched, shown, revisions)
