"""Per-update decoder compute with and without draft verification, on the realistic model.

Random weights cannot agree with themselves, so how much of a draft is confirmed is taken
from real behaviour: a fast replay of a fixture log (the tiny self-trained models) records,
for every decode of the stream (`draft_bound.decodes`: the replay's offline check of the
finals left out), its forced prefix P, draft D, its L tokens after the prefix and, for
each later step, how many lookahead tokens it fed besides its own (the re-aligned draft,
`GreedySearch.take_lookahead`). Each record is then replayed as decoder calls
on the OPUS-MT-sized benchmark model (int8, one row, as the scheduler runs a lone stream:
the layers on one thread, the output projection on all cores; a median-length FLORES
source):

- without drafts: one prefill of start + P tokens, then L steps (the last finds eos);
- with drafts: one prefill of start + P + D tokens, then the steps the fixture took, each
  fed 1 + its lookahead tokens.

It prints, per fixture and log, per-update compute p50 / p95 / max (ms) both ways and the
stepwise calls per update. These are measured costs per call with acceptance taken from
the fixture logs, not a realistic model's own acceptance.

    python examples/benchmarks/draft_cost.py [--only prefix|offline]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_bound import PAIRS, decodes

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's engine, not an installed one
MODEL = ROOT / ".cache" / "benchmark-model" / "onnx"
FLORES_ZH = ROOT.parent / "shared" / "flores200-devtest" / "zho_Hans.devtest"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("prefix", "offline"), help="one fixture's logs")
    parser.add_argument("--line", type=int, default=37, help="FLORES zh line used as source")
    args = parser.parse_args(argv)
    if not (MODEL / "encoder_model_quantized.onnx").is_file() or not FLORES_ZH.is_file():
        print("needs the benchmark model (models/build_benchmark_model.py) and ../shared")
        return 2
    from engine import Translator
    from engine.decoding.scheduler import SchedulerOptions

    pairs = [p for p in PAIRS if args.only in (None, p[0])]
    logs = {
        (kind, name): decodes(ROOT / "models" / d / "model", ROOT / "examples" / "logs" / name)
        for kind, d, name in pairs
    }
    tr = Translator.from_dir(MODEL, quantized=True, scheduler=SchedulerOptions(lanes=1))
    masked = tr.model.masked
    assert masked is not None, "the benchmark model's decoder was not rewritten"
    source = FLORES_ZH.read_text(encoding="utf-8").splitlines()[args.line].strip()
    ids = tr.source_ids(source)
    enc = tr.model.encode(np.array([ids]), np.ones((1, len(ids)), dtype=np.int64))
    start = tr.config.decoder_start_token_id

    def update_ms(fed: int, steps: list[int]) -> float:
        """A prefill of start + `fed` tokens, then one step per entry of `steps`, each fed
        one token and that many lookahead tokens."""
        began = time.perf_counter()
        tokens = np.full((1, fed + 1), 5, dtype=np.int64)
        tokens[0, 0] = start
        _, self_kv, cross_kv = masked.prefill(enc, tokens, np.ones_like(tokens))
        past = fed + 1
        for ahead in steps:
            new = 1 + ahead
            mask = np.ones((1, past + new), dtype=np.int64)
            ids = np.full((1, new), 5, dtype=np.int64)
            positions = np.arange(past, past + new, dtype=np.int64)[None]
            _, self_kv = masked.step(enc, ids, positions, mask, self_kv, cross_kv)
            past += new
        return (time.perf_counter() - began) * 1000

    update_ms(10, [0] * 5)  # warm up

    def show(name: str, ms: list[float], steps: list[int]) -> None:
        q = statistics.quantiles(ms, n=20)
        print(
            f"  {name:<15} p50 {statistics.median(ms):6.1f}  p95 {q[18]:6.1f}  "
            f"max {max(ms):6.1f} ms   steps per update {statistics.mean(steps):.2f}",
            flush=True,
        )

    for (kind, name), recs in logs.items():
        before, after, steps_b, steps_a = [], [], [], []
        for r in recs:
            steps_b.append(len(r.tokens))
            steps_a.append(len(r.widths))
            before.append(update_ms(len(r.prefix), [0] * len(r.tokens)))
            after.append(update_ms(len(r.prefix) + len(r.draft), r.widths))
        print(
            f"{kind} fixture, {name}: {len(recs)} decodes; draft tokens confirmed in the "
            f"prefill {sum(r.accepted for r in recs)} / offered {sum(len(r.draft) for r in recs)}; "
            f"lookahead tokens fed {sum(sum(r.widths) for r in recs)}"
        )
        show("without drafts", before, steps_b)
        show("with drafts", after, steps_a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
