"""Where a greedy row's choice is cheaper on the CPU: in NumPy after the projection, as the
searches make it, or inside the graph, as the KV-slot step makes it on a GPU.

A greedy search needs, at each position it reads, the argmax of the logits (the model's
banned tokens, and eos below the minimum length, excluded) and its log-probability. The
searches take it from the logits in NumPy (`engine.decoding.search._greedy_choice`: a
few passes over the vocabulary in one buffer kept per thread); the KV-slot graphs compute
it where the model runs and return two numbers a position instead of the logits
(`engine.model.kv.slots.rewrite._greedy_outputs`, the same float32 operations). On a GPU
that saves moving the logits to the host; on the CPU the logits are already in memory,
and what counts is which passes over them are faster. A third way is the token alone
(`_greedy_token`, `DecodeOptions.scores` False: the argmax of the logits as they are, one
pass), which a stream's partials take: their updates carry no score.

This times both on the same logits ([`--positions`, vocabulary] float32, random at the
spread of a trained model's), on one thread as a lane runs them, in alternated rounds,
and prints the median ms per position of each, their ratio, and whether they chose the
same tokens (the log-probabilities may differ in the last float32 bits: a sum's order).

    python examples/benchmarks/greedy_choice.py [--positions 32] [--model DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # this checkout's engine, not an installed one

from step_anatomy import median_ms  # noqa: E402

from engine.decoding.search import DecodeOptions, _greedy_choice, _greedy_token  # noqa: E402
from engine.model.config import ModelConfig  # noqa: E402
from engine.model.kv.slots.rewrite import _Builder, _greedy_outputs  # noqa: E402
from engine.model.names import BAN_EOS, LOGITS, NEXT_IDS, NEXT_SCORES  # noqa: E402

DEFAULT_MODEL = REPO_ROOT / ".cache" / "benchmark-model" / "onnx"


def choice_session(vocab: int, bans: list[int], eos: int) -> ort.InferenceSession:
    """A one-thread session of the KV-slot graphs' greedy choice alone: logits [1, T, V]
    and `BAN_EOS` [1, T] in, `NEXT_IDS` and `NEXT_SCORES` [1, T] out."""
    graph = helper.make_graph(
        [],
        "greedy_choice",
        [
            helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, [1, "positions", vocab]),
            helper.make_tensor_value_info(BAN_EOS, TensorProto.BOOL, [1, "positions"]),
        ],
        [
            helper.make_tensor_value_info(NEXT_IDS, TensorProto.INT64, [1, "positions"]),
            helper.make_tensor_value_info(NEXT_SCORES, TensorProto.FLOAT, [1, "positions"]),
        ],
    )
    builder = _Builder(graph, 17)
    _greedy_outputs(builder, LOGITS, vocab, bans, eos)
    graph.node.extend(builder.nodes)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=32, help="positions per call")
    parser.add_argument(
        "--model", type=Path, default=DEFAULT_MODEL, help="its config: vocabulary, bans, eos"
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds")
    parser.add_argument("--reps", type=int, default=30, help="calls per round and way")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.positions < 1:
        parser.error("--positions must be >= 1")
    config = ModelConfig.from_dir(args.model)
    vocab, eos = config.vocab_size, config.eos_token_id
    options = DecodeOptions()
    rng = np.random.default_rng(args.seed)
    logits = (rng.standard_normal((1, args.positions, vocab)) * 3).astype(np.float32)
    short = np.zeros((1, args.positions), dtype=np.bool_)  # every row past its minimum
    session = choice_session(vocab, sorted(config.bad_token_ids), eos)

    def in_numpy() -> list[tuple[int, float]]:
        return [_greedy_choice(logits[0, p], config, 1, options) for p in range(args.positions)]

    def in_graph() -> list[Any]:
        out: list[Any] = session.run([NEXT_IDS, NEXT_SCORES], {LOGITS: logits, BAN_EOS: short})
        return out

    def token_alone() -> list[int]:
        return [_greedy_token(logits[0, p], config, 1, options) for p in range(args.positions)]

    ids, scores = in_graph()
    mine = in_numpy()
    same = ids[0].tolist() == [token for token, _ in mine] == token_alone()
    worst = max(abs(float(scores[0, p]) - score) for p, (_, score) in enumerate(mine))
    for way in (in_numpy, in_graph, token_alone):  # warm-up
        median_ms(way, 3, warmup=0)
    numpy_ms, graph_ms, alone_ms = [], [], []
    for _ in range(args.rounds):
        numpy_ms.append(median_ms(in_numpy, args.reps, warmup=0))
        graph_ms.append(median_ms(in_graph, args.reps, warmup=0))
        alone_ms.append(median_ms(token_alone, args.reps, warmup=0))
    a, b = statistics.median(numpy_ms), statistics.median(graph_ms)
    c = statistics.median(alone_ms)
    per = 1e3 / args.positions
    print(f"{args.positions} positions x {vocab} logits, one thread, {args.rounds} rounds")
    print(f"  numpy (the searches):    {a * per:7.1f} us a position  ({a:.2f} ms a call)")
    print(f"  in the graph (KV slots): {b * per:7.1f} us a position  ({b:.2f} ms a call)")
    print(f"  the token alone (partials): {c * per:4.1f} us a position  ({c:.2f} ms a call)")
    print(f"  graph / numpy: {b / a:.2f}x; token alone / numpy: {c / a:.2f}x")
    print(f"  same tokens: {same}; scores differ by {worst:.2g}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
