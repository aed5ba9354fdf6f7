"""How often fp16 greedy output equals fp32's: the same model's fp32 files and their fp16
copies (`nmt-incremental models fp16`), the same sources, greedy.

Prints the share of sentences whose tokens are identical, the share of tokens before the
first difference (over all fp32 tokens), and chrF of the fp16 output against the fp32
output (sacrebleu). By default the committed fixture (a model trained here, so its
output means something) on its 200 held-out sentences; the fp16 files are written to a
temporary copy of the model.

    python examples/benchmarks/fp16_agreement.py [--model DIR] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine import Translator
from engine.conversion.fp16 import convert_fp16

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "models" / "fixture"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=FIXTURE / "model")
    parser.add_argument("--sources", type=Path, default=FIXTURE / "heldout.tsv")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--limit", type=int, default=200)
    args = parser.parse_args(argv)
    lines = args.sources.read_text(encoding="utf-8").splitlines()[: args.limit]
    sources = [line.split("\t")[0] for line in lines if line.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "model"
        shutil.copytree(args.model, copy)
        convert_fp16(copy)
        full = Translator.from_dir(copy, device=args.device)
        half = Translator.from_dir(copy, device=args.device, fp16=True)
        a = [full.translate([s])[0] for s in sources]
        b = [half.translate([s])[0] for s in sources]
    same = sum(x.token_ids == y.token_ids for x, y in zip(a, b, strict=True))
    agreed = total = 0
    for x, y in zip(a, b, strict=True):
        total += len(x.token_ids)
        for p, q in zip(x.token_ids, y.token_ids, strict=False):
            if p != q:
                break
            agreed += 1
    print(f"model {args.model} on {args.device}, {len(sources)} sentences")
    print(f"identical outputs: {same}/{len(sources)} ({100 * same / len(sources):.1f}%)")
    print(f"tokens before the first difference: {agreed}/{total} ({100 * agreed / total:.1f}%)")
    try:
        import sacrebleu

        chrf = sacrebleu.corpus_chrf([y.text for y in b], [[x.text for x in a]]).score
        print(f"chrF of fp16 against fp32: {chrf:.1f}")
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
