"""What a lone real-time stream pays for the machine's idle time between its partials:
the pieces of one partial's work, run back to back (hot) and each after an idle gap
(cold, `--gap` seconds, about a speaker's time between two partials).

A lone stream's partial is an encoder call, one decoder prefill over the forced prefix
and the draft (the body, then the output projection at the draft's positions, which
verify it) and a step per token past the draft. `step_anatomy.py` and `decode_speed.py`
time those calls back to back, with the weights in the caches; a real-time stream makes
them a third of a second apart, and what it reads (about 25 MB of decoder weights per
body, 33 MB of projection, 19 MB of encoder for the int8 OPUS-MT shape) comes from memory
again. This prints, per piece, the median ms hot and cold:

- `encode`: the encoder over `--source` tokens, through the scheduler as a partial's;
- `body`: the batchable prefill's body over `--positions` positions, one row, on the
  lane's threads;
- `head x1`, `head xK`: the output projection at 1 and at `--verify` positions, on the
  lane's threads and on every core (a lane that runs alone uses every core).

    python examples/benchmarks/idle_cost.py [--gap 0.3] [--positions 31] [--verify 21]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO_ROOT / ".cache" / "benchmark-model" / "onnx"
FLORES_ZH = REPO_ROOT.parent / "shared" / "flores200-devtest" / "zho_Hans.devtest"


def _median_ms(run: Callable[[], Any], gap: float, reps: int) -> float:
    """Median ms of `run` over `reps` calls, each after `gap` seconds idle."""
    times = []
    for _ in range(reps):
        if gap:
            time.sleep(gap)
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--gap", type=float, default=0.3, help="idle seconds before a cold call")
    parser.add_argument("--source", type=int, default=30, help="source tokens")
    parser.add_argument("--positions", type=int, default=31, help="prefill positions")
    parser.add_argument("--verify", type=int, default=21, help="projected positions")
    parser.add_argument("--reps", type=int, default=15, help="calls per piece and round")
    parser.add_argument("--rounds", type=int, default=2, help="hot and cold alternated")
    parser.add_argument("--fp32", action="store_true", help="fp32 (default: int8)")
    args = parser.parse_args(argv)
    if not (args.model / "config.json").exists():
        print(f"no model at {args.model}: run models/build_benchmark_model.py", file=sys.stderr)
        return 2
    if not 1 <= args.verify <= args.positions:
        parser.error("--verify must be between 1 and --positions")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(REPO_ROOT))
    from engine import Translator
    from engine.model.names import (
        ENCODER_ATTENTION_MASK,
        ENCODER_HIDDEN_STATES,
        INPUT_IDS,
        LOGITS,
        MASK_INPUT,
        POSITIONS_INPUT,
    )

    translator = Translator.from_dir(args.model, quantized=not args.fp32)
    masked = translator.scheduler.model.masked
    if masked is None or masked.prefills.head is None:
        print("this model has no batchable decoder with its projection cut apart", file=sys.stderr)
        return 2
    sentences = FLORES_ZH.read_text(encoding="utf-8").splitlines() if FLORES_ZH.exists() else []
    candidates = (translator.source_ids(s) for s in sentences)
    source = next((ids[: args.source] for ids in candidates if len(ids) >= args.source), None)
    if source is None:  # no FLORES here: any ids of the model's vocabulary
        source = list(range(100, 100 + args.source))
    enc = translator.encode([source])

    body, head, everyone = masked.prefills
    assert head is not None
    rng = np.random.default_rng(0)
    ids = rng.integers(1, translator.config.vocab_size - 1, size=(1, args.positions))
    ids[0, 0] = translator.config.decoder_start_token_id
    values = {
        ENCODER_ATTENTION_MASK: enc.attention_mask,
        INPUT_IDS: ids.astype(np.int64),
        ENCODER_HIDDEN_STATES: enc.hidden_states,
        MASK_INPUT: np.ones((1, args.positions), dtype=np.int64),
        POSITIONS_INPUT: np.arange(args.positions, dtype=np.int64)[None],
    }
    declared = {i.name for i in body.get_inputs()}
    feed = {name: value for name, value in values.items() if name in declared}
    hidden = body.run([head[1]], feed)[0]

    pieces: dict[str, Callable[[], Any]] = {
        "encode": partial(translator.encode, [source]),
        "body": partial(body.run, [head[1]], feed),
    }
    heads = [("lane", head)] + ([("all cores", everyone)] if everyone is not None else [])
    for label, (session, name) in heads:
        for count in (1, args.verify):
            states = np.ascontiguousarray(hidden[:, -count:])
            pieces[f"head x{count}, {label}"] = partial(session.run, [LOGITS], {name: states})
    results: dict[str, dict[str, list[float]]] = {p: {"hot": [], "cold": []} for p in pieces}
    for _ in range(args.rounds):
        for kind, gap in (("hot", 0.0), ("cold", args.gap)):
            for piece, run in pieces.items():
                run()  # warm up: the hot rounds measure what follows a call
                results[piece][kind].append(_median_ms(run, gap, args.reps))

    print(f"model {args.model} ({'fp32' if args.fp32 else 'int8'}); cold: after {args.gap} s idle")
    print(f"{'piece':<24} {'hot ms':>8} {'cold ms':>8} {'cold/hot':>9}")
    for piece, kinds in results.items():
        hot, cold = statistics.median(kinds["hot"]), statistics.median(kinds["cold"])
        print(f"{piece:<24} {hot:>8.2f} {cold:>8.2f} {cold / hot:>8.2f}x")
    translator.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
