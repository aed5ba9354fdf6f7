"""Per-update decoder compute with and without draft verification, on the realistic model.

Random weights cannot agree with themselves, so how much of a draft is confirmed is taken
from real behaviour: a fast replay of a fixture log (the tiny self-trained model) records,
for every decode, its forced prefix P, draft D, tokens confirmed A and final length L.
Each record is then replayed as decoder calls on the OPUS-MT-sized benchmark model (int8,
one row, one ORT thread, a median-length FLORES source):

- without drafts: one prefill of start + P tokens, then L - P steps (the last finds eos);
- with drafts: one prefill of start + P + D tokens, then L - P - A steps.

It prints per-update compute p50 / p95 / max (ms) both ways and the stepwise calls per
update. These are measured costs per call with acceptance taken from the fixture logs,
not a realistic model's own acceptance.

    python examples/benchmarks/draft_cost.py [--log examples/logs/fixture_en_zh_asr.jsonl]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "models" / "fixture" / "model"
MODEL = ROOT / ".cache" / "benchmark-model" / "onnx"
FLORES_ZH = ROOT.parent / "shared" / "flores200-devtest" / "zho_Hans.devtest"
LOGS = [ROOT / "examples" / "logs" / n for n in ("fixture_en_zh.jsonl", "fixture_en_zh_asr.jsonl")]


def records(log: Path) -> list[tuple[int, int, int, int]]:
    """(P, D, A, L) of every decode of a fast replay with drafts."""
    from engine import Translator
    from engine.decoding import GreedySearch
    from engine.evaluation.translogs import read_log
    from engine.replay import ReplayOptions, replay
    from engine.scheduler import SchedulerOptions

    seen: list[tuple[int, int, int, int]] = []
    original = GreedySearch.result

    def result(self: GreedySearch) -> object:
        seen.append((len(self.prefix), len(self.draft), self.accepted, len(self.tokens)))
        return original(self)

    GreedySearch.result = result  # type: ignore[method-assign]
    try:
        tr = Translator.from_dir(FIXTURE, scheduler=SchedulerOptions(lanes=1))
        replay(tr, read_log(log), ReplayOptions(progress=False))
    finally:
        GreedySearch.result = original  # type: ignore[method-assign]
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", type=Path, action="append", help="fixture logs (default: both)")
    parser.add_argument("--line", type=int, default=37, help="FLORES zh line used as source")
    args = parser.parse_args(argv)
    if not (MODEL / "encoder_model_quantized.onnx").is_file() or not FLORES_ZH.is_file():
        print("needs the benchmark model (models/build_benchmark_model.py) and ../shared")
        return 2
    from engine import Translator
    from engine.scheduler import SchedulerOptions

    recs = [r for log in args.log or LOGS for r in records(log)]
    tr = Translator.from_dir(MODEL, quantized=True, scheduler=SchedulerOptions(lanes=1))
    masked = tr.model.masked
    assert masked is not None, "the benchmark model's decoder was not rewritten"
    source = FLORES_ZH.read_text(encoding="utf-8").splitlines()[args.line].strip()
    ids = tr.source_ids(source)
    enc = tr.model.encode(np.array([ids]), np.ones((1, len(ids)), dtype=np.int64))
    start = tr.config.decoder_start_token_id

    def update_ms(fed: int, steps: int) -> float:
        began = time.perf_counter()
        tokens = np.full((1, fed + 1), 5, dtype=np.int64)
        tokens[0, 0] = start
        _, self_kv, cross_kv = masked.prefill(enc, tokens, np.ones_like(tokens))
        past = fed + 1
        for _ in range(steps):
            mask = np.ones((1, past + 1), dtype=np.int64)
            _, self_kv = masked.step(
                enc, np.array([[5]]), np.array([[past]]), mask, self_kv, cross_kv
            )
            past += 1
        return (time.perf_counter() - began) * 1000

    update_ms(10, 5)  # warm up
    before, after, steps_b, steps_a = [], [], [], []
    for p, d, a, length in recs:
        steps_b.append(length - p)
        steps_a.append(length - p - a)
        before.append(update_ms(p, length - p))
        after.append(update_ms(p + d, length - p - a))

    def show(name: str, ms: list[float], steps: list[int]) -> None:
        q = statistics.quantiles(ms, n=20)
        print(
            f"{name:<16} p50 {statistics.median(ms):6.1f}  p95 {q[18]:6.1f}  max {max(ms):6.1f} ms"
            f"   steps per update {statistics.mean(steps):.2f}"
        )

    print(
        f"{len(recs)} decodes from {', '.join(p.name for p in args.log or LOGS)}; "
        f"draft tokens confirmed {sum(r[2] for r in recs)} / offered {sum(r[1] for r in recs)}"
    )
    show("without drafts", before, steps_b)
    show("with drafts", after, steps_a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
