"""What a glossary costs a stream in decoder steps, counted rather than timed: capacity.py's
streams (FLORES zh sentences as the synthetic recogniser says them, its forced lengths)
each through a sans-I/O streaming session, one event at a time, without a glossary and
with capacity.py's 1,000-entry glossaries (`none`: no term in the sentences; `one`: each
sentence's first two characters a term).

Steps are what the shared machines can measure exactly: with no real-time clock every
variant decodes every partial (none is superseded), so the counts are the same on every
run and every machine, and the per-segment excess shows where a ratio comes from. The
terms' renderings (the model's translation of each term's source alone, decoded once per
term per translator: docs/glossaries.md) are counted apart: the glossary variants run
twice on one translator, the second run's renderings cached. The first run's count (with
the renderings) moves by a few steps between runs: a rendering started ahead decodes
beside the next partials, and how many steps they share depends on the lanes' timing.

    python examples/benchmarks/glossary_steps.py                   # 16 streams, 3 sentences
    python examples/benchmarks/glossary_steps.py --streams 1       # capacity.py's N=1 log

The benchmark model has random weights: how it reacts to a term (it copies the term's
token on, and its first token changes with every partial) is no trained model's, and a
few segments carry most of the excess; `glossary_terms.py` counts the same on the trained
fixtures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "benchmarks"))

import capacity  # noqa: E402  (examples/benchmarks/, on the path above)

from engine.decoding.translator import Translator  # noqa: E402
from engine.glossary import Glossary  # noqa: E402
from engine.logs.format import event_of  # noqa: E402
from engine.streaming.calls import Started  # noqa: E402
from engine.streaming.session import StreamingOptions, StreamSession  # noqa: E402


def stream_steps(
    translator: Translator,
    lines: list[dict[str, Any]],
    glossary: Glossary | None,
    ratio: float,
    turns: list[int] | None = None,
) -> Counter[str]:
    """Decoder steps per segment (`stream/segment`), every event answered in log order,
    one session per stream. `turns`, if given, gains each update's decodes in a row: the
    calls it waited for one after the other plus their steps (a latency in scheduler
    turns: a rendering decoded before a partial's own decode adds its own)."""
    options = StreamingOptions(forced_length_ratio=ratio)
    sessions: dict[str, StreamSession] = {}
    steps: Counter[str] = Counter()
    scheduler = translator.scheduler
    for line in lines:
        event = event_of(line)
        session = sessions.get(event.stream_id)
        if session is None:
            session = StreamSession(event.stream_id, translator, options, glossary=glossary)
            sessions[event.stream_id] = session
        before = scheduler.stats["decoder_steps"]
        answer, waited = session.steps(event), 0
        try:
            call = next(answer)
            while True:
                if isinstance(call, Started):  # decoded beside earlier partials
                    call = answer.send(call.run(translator))
                    continue
                at = scheduler.stats["decoder_steps"]
                hyps = call.run(translator)
                waited += 1 + scheduler.stats["decoder_steps"] - at
                call = answer.send(hyps)
        except StopIteration as done:
            if done.value is not None and turns is not None:
                turns.append(waited)
        # A rendering started ahead may run meanwhile: counted here.
        steps[f"{event.stream_id}/{event.segment_id}"] += scheduler.stats["decoder_steps"] - before
    return steps


def _p95(turns: list[int]) -> str:
    """capacity.py's p95 (the same rank) of updates' decodes in a row."""
    return f"{capacity.percentile([float(t) for t in turns], 95):.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=capacity.DEFAULT_MODEL)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--sentences", type=int, default=3, help="sentences per stream")
    parser.add_argument("--ratio", type=float, default=1.02, help="forced length ratio")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fp32", action="store_true", help="fp32 (default: int8)")
    args = parser.parse_args()
    lines = capacity.make_lines(args.streams, args.sentences, args.seed)
    translator = Translator.from_dir(args.model, quantized=not args.fp32)
    print(
        f"{args.streams} streams x {args.sentences} sentences (capacity.py's log, seed "
        f"{args.seed}), forced length ratio {args.ratio}, {args.model}"
    )
    plain_turns: list[int] = []
    plain = stream_steps(translator, lines, None, args.ratio, plain_turns)
    total = sum(plain.values())
    print(
        f"  no glossary: {total} decoder steps; an update's decodes in a row p95 "
        f"{_p95(plain_turns)}, in all {sum(plain_turns)}"
    )
    for kind in ("none", "one"):
        glossary = capacity.synthetic_glossary(lines, kind)
        before = translator.scheduler.stats["decoder_steps"]
        first_turns: list[int] = []
        stream_steps(translator, lines, glossary, args.ratio, first_turns)
        for _, started in translator.rendering_started(glossary.terms):
            started.result()  # renderings run beside the partials: counted once done
        first = translator.scheduler.stats["decoder_steps"] - before
        turns: list[int] = []
        steps = stream_steps(translator, lines, glossary, args.ratio, turns)
        cached = sum(steps.values())
        excess = sorted(
            ((steps[k] - plain[k], k) for k in plain.keys() | steps.keys()), reverse=True
        )
        worst = ", ".join(f"{k} +{d}" for d, k in excess[:3] if d > 0) or "none"
        print(
            f"  {len(glossary)} entries, {kind}: {cached} steps ({cached / total:.2f}x), "
            f"{first} with the terms' renderings ({first / total:.2f}x); per segment the "
            f"excess's median {statistics.median(d for d, _ in excess):+g}, the most: {worst}"
        )
        print(
            f"    an update's decodes in a row p95 {_p95(turns)} ({_p95(first_turns)} with "
            f"the renderings), in all {sum(turns)} ({sum(first_turns)})"
        )
    translator.close()


if __name__ == "__main__":
    main()
