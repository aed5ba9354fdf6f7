"""How far drafts taken from the previous hypothesis can cut stepwise decoding, at best.

Draft verification confirms, in the prefill call, the tokens of the previous
hypothesis that the new one repeats from its start. Tokens the previous hypothesis never
had (the translation of new source words) still cost one decoder step each, whatever is
done with the draft. This replays every committed fixture and log (fast, default options,
drafts on) and records, for every decode, its forced prefix, its draft and its tokens, then
prints stepwise decoder calls (one per generated token: each is fed to get the next)

- without drafts: every generated token;
- with the prefill's draft run alone: generated tokens less the draft's confirmed run
  from the start;
- as built (prefill run, then the draft re-aligned and verified ahead in later steps,
  `GreedySearch.take_lookahead`): generated tokens less every draft token confirmed, counted
  by the searches themselves;
- at best with any re-alignment of that draft: generated tokens less their longest common
  subsequence with the draft, i.e. every token the previous hypothesis had, wherever it
  moved, confirmed for free (no extra call counted): a bound no drafting from the previous
  hypothesis can beat.

    python examples/benchmarks/draft_bound.py
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's engine, not an installed one
LOGS = ROOT / "examples" / "logs"
PAIRS = [
    ("prefix", "fixture", "fixture_en_zh.jsonl"),
    ("prefix", "fixture", "fixture_en_zh_asr.jsonl"),
    ("offline", "fixture_offline", "fixture_en_zh.jsonl"),
    ("offline", "fixture_offline", "fixture_offline_en_zh_asr.jsonl"),
]


@dataclass(frozen=True)
class Decode:
    """One greedy decode of a replay: its forced prefix, draft and tokens after the prefix;
    draft tokens confirmed in the prefill (`accepted`) and in later steps (`looked_ahead`);
    and how many lookahead tokens each later step fed besides the row's own (`widths`, one
    entry per step)."""

    prefix: list[int]
    draft: list[int]
    tokens: list[int]
    accepted: int
    looked_ahead: int
    widths: list[int]


def decodes(model: Path, log: Path) -> list[Decode]:
    """Every greedy decode of a fast replay of `log` on `model`, drafts on, the replay's
    offline check of the finals left out (not part of the stream). Also what
    draft_cost.py replays on the realistic model."""
    from engine import Translator
    from engine.decoding.scheduler import SchedulerOptions
    from engine.decoding.search import GreedySearch, Hypothesis
    from engine.logs.format import read_log
    from engine.replay import ReplayOptions, replay

    seen: list[Decode] = []
    widths: dict[int, list[int]] = {}
    result, lookahead = GreedySearch.result, GreedySearch.take_lookahead

    def recorded_lookahead(self: GreedySearch, most: int) -> list[int]:
        tokens = lookahead(self, most)
        widths.setdefault(id(self), []).append(len(tokens))
        return tokens

    def recorded_result(self: GreedySearch) -> Hypothesis:
        hyp = result(self)
        tokens = list(hyp.token_ids[len(self.prefix) :])
        steps = widths.pop(id(self), [])
        seen.append(
            Decode(
                list(self.prefix), list(self.draft), tokens, self.accepted, self.looked_ahead, steps
            )
        )
        return hyp

    GreedySearch.result = recorded_result  # type: ignore[method-assign]
    GreedySearch.take_lookahead = recorded_lookahead  # type: ignore[method-assign]
    try:
        tr = Translator.from_dir(model, scheduler=SchedulerOptions(lanes=1))
        run = replay(tr, read_log(log), ReplayOptions(progress=False))
    finally:
        GreedySearch.result = result  # type: ignore[method-assign]
        GreedySearch.take_lookahead = lookahead  # type: ignore[method-assign]
    # The replay ends by checking each final against an offline translation: one decode
    # per final, not part of the stream, left out.
    return seen[: len(seen) - run.finals_checked]


def confirmed_run(draft: list[int], tokens: list[int]) -> int:
    n = 0
    while n < min(len(draft), len(tokens)) and draft[n] == tokens[n]:
        n += 1
    return n


def lcs(a: list[int], b: list[int]) -> int:
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0
        for j, y in enumerate(b):
            above = row[j + 1]
            row[j + 1] = diagonal + 1 if x == y else max(row[j + 1], row[j])
            diagonal = above
    return row[-1]


def main() -> int:
    print(
        "| fixture | log | decodes | steps without drafts | prefill draft run only "
        "| as built (+ lookahead) | at best (LCS) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for kind, directory, name in PAIRS:
        records = decodes(ROOT / "models" / directory / "model", LOGS / name)
        base = sum(len(r.tokens) for r in records)
        run = sum(len(r.tokens) - confirmed_run(r.draft, r.tokens) for r in records)
        built = sum(len(r.tokens) - r.accepted - r.looked_ahead for r in records)
        best = sum(len(r.tokens) - lcs(r.tokens, r.draft) for r in records)
        print(
            f"| {kind} | {name} | {len(records)} | {base} | {run} ({run / base:.0%}) "
            f"| {built} ({built / base:.0%}) | {best} ({best / base:.0%}) |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
