"""What one model call and one partial's lane turn cost the CPU, bare and through the engine.

Two parts, in a quiet process (thread CPU, medians of `--rounds`):

- **calls**: the encoder and the prefill of one row, as a bare `InferenceSession.run` of
  the files in the Optimum layout and through the engine's path (`MarianOnnx.encode`; the
  rewritten prefill body alone, then `MaskedDecoder.prefill` with the projection of the
  positions read), and the encoder and the prefill over more rows;
- **turns**: the common update of a stream, a growing partial whose draft is its whole
  answer (it ends in its prefill), submitted one at a time: the lane's thread CPU per
  request, split into ONNX Runtime's calls and the Python around them;
- **folded** (`--folded`, instead of the two above): the model loaded twice, its shape
  computations folded (`engine.model.passes.shapes`, the default) and not, and one row's
  encoder, prefill and in-place step through the engine on each, alternated in rounds;
- **against** (`--against DIR`): the same one-row calls and turns of another checkout's
  engine (DIR) and of this one, each in a process of its own, alternated (ABBA)
  `--repeats` times (the turns: `turn: lane`, `ort`, `python` ms and `calls` per request).

    python examples/benchmarks/call_cost.py
    python examples/benchmarks/call_cost.py --model models/fixture/model --rounds 5
    python examples/benchmarks/call_cost.py --folded [--quantized] [--model DIR]
    git worktree add /tmp/before HEAD~3
    python examples/benchmarks/call_cost.py --against /tmp/before [--quantized] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# This checkout's engine, not an installed one; `--engine-root DIR` (used by `--against`):
# another checkout's, run by this script.
ENGINE_ROOT = (
    Path(sys.argv[sys.argv.index("--engine-root") + 1]).resolve()
    if "--engine-root" in sys.argv[:-1]
    else ROOT
)
sys.path.insert(0, str(ROOT))
if ENGINE_ROOT != ROOT:
    sys.path.insert(0, str(ENGINE_ROOT))

import numpy as np  # noqa: E402
import numpy.typing as npt  # noqa: E402
import onnxruntime as ort  # noqa: E402

from engine import DecodeOptions, Translator  # noqa: E402
from engine.decoding.policy import Priority  # noqa: E402
from engine.decoding.scheduler import DecodeScheduler, SchedulerOptions  # noqa: E402
from engine.model.kv.inplace.steps import InPlaceBinding, InPlaceSteps  # noqa: E402
from engine.model.layouts import EncoderOutput  # noqa: E402

SENTENCE = "Lucy wants to play tennis with my brother on Sunday"


def cpu_ms(call: Callable[[], object], repeats: int) -> float:
    """Thread CPU of one `call`, ms (after a warm-up)."""
    for _ in range(20):
        call()
    began = time.thread_time()
    for _ in range(repeats):
        call()
    return (time.thread_time() - began) / repeats * 1000


def bare_session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def calls(tr: Translator, rounds: int) -> None:
    model, masked = tr.model, tr.model.masked
    if masked is None:
        raise SystemExit("the model batches in lockstep: no rewritten prefill to compare")
    ids = np.array([tr.source_ids(SENTENCE, partial=True)], dtype=np.int64)
    mask = np.ones_like(ids)
    enc = model.encode(ids, mask)
    length = 13
    dec = np.array([[tr.config.decoder_start_token_id, *range(5, 4 + length)]], dtype=np.int64)
    dec_mask = np.ones_like(dec)
    encoder = bare_session(model.files["encoder"])
    plain = bare_session(model.files["no_past"])
    plain_feed = {
        "encoder_attention_mask": mask,
        "input_ids": dec,
        "encoder_hidden_states": enc.hidden_states,
    }
    body, head, _ = masked.prefills
    body_feed: dict[str, Any] = {
        "encoder_attention_mask": mask,
        "input_ids": dec,
        "encoder_hidden_states": enc.hidden_states,
        "decoder_attention_mask": dec_mask,
        "decoder_position_ids": np.arange(length, dtype=np.int64)[None],
    }
    declared = {i.name for i in body.get_inputs()}
    body_feed = {k: v for k, v in body_feed.items() if k in declared}
    body_out = [head[1]] if head is not None else None
    read = np.array([length - 3])

    def engine_prefill() -> None:
        logits = masked.prefill(enc, dec, dec_mask, read)[0].row(0, length - 3)
        for i in range(3):
            logits[i]

    encoder_feed = {"input_ids": ids, "attention_mask": mask}
    rows: list[tuple[str, Callable[[], object]]] = [
        ("encoder, bare", lambda: encoder.run(["last_hidden_state"], encoder_feed)),
        ("encoder, MarianOnnx.encode", lambda: model.encode(ids, mask)),
        (f"prefill {length} positions, bare no-past file", lambda: plain.run(None, plain_feed)),
        ("prefill, the rewritten body alone", lambda: body.run(body_out, body_feed)),
        ("prefill, MaskedDecoder.prefill + 3 positions read", engine_prefill),
    ]  # fmt: skip
    # Rounds interleave the calls, so that a busy moment of a shared machine falls on all.
    spent: dict[str, list[float]] = {name: [] for name, _ in rows}
    for _ in range(rounds):
        for name, call in rows:
            spent[name].append(cpu_ms(call, 300))
    print(f"one row, thread CPU ms per call (median of {rounds} rounds):")
    for name, times in spent.items():
        print(f"  {name:52s} {statistics.median(times):.3f}")
    print("over more rows (encoder; prefill with every position projected):")
    for batch in (1, 2, 4, 8):
        encode, prefill = over_rows(tr, ids, dec, batch)
        print(f"  {batch} rows: encoder {encode:.3f}, prefill {prefill:.3f}")


def over_rows(
    tr: Translator, ids: npt.NDArray[np.int64], dec: npt.NDArray[np.int64], batch: int
) -> tuple[float, float]:
    """Thread CPU ms of the encoder and of a prefill (every position projected) over
    `batch` copies of one row."""
    masked = tr.model.masked
    assert masked is not None
    many = np.repeat(ids, batch, 0)
    many_mask = np.ones_like(many)
    states = tr.model.encode(many, many_mask)
    decs = np.repeat(dec, batch, 0)
    decs_mask = np.ones_like(decs)
    encode = cpu_ms(lambda: tr.model.encode(many, many_mask), 200)
    prefill = cpu_ms(lambda: masked.prefill(states, decs, decs_mask)[0].values, 200)
    return encode, prefill


def growing_partials(tr: Translator) -> list[tuple[list[int], list[int]]]:
    """`SENTENCE` as growing partials, word by word from two: each one's source ids and
    its translation's ids, the draft with which its turn ends in its prefill."""
    words = SENTENCE.split()
    work = []
    for end in range(2, len(words) + 1):
        source = tr.source_ids(" ".join(words[:end]), partial=True)
        work.append((source, list(tr.decode(tr.encoding([source]))[0].token_ids)))
    return work


def turns(tr: Translator, rounds: int, quiet: bool = False) -> dict[str, float]:
    """The lane's CPU per request, and ONNX Runtime's share of it (wrapped sessions):
    each round printed (unless `quiet`), their medians returned (ms per request: `lane`,
    `ort`, `python`; `calls` per request)."""
    spent: defaultdict[str, float] = defaultdict(float)
    per_round: defaultdict[str, list[float]] = defaultdict(list)
    session = ort.InferenceSession
    run, bound = session.run, session.run_with_iobinding

    def timed(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            began = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                spent["ort"] += time.thread_time() - began
                spent["calls"] += 1

        return call

    turn = DecodeScheduler._turn

    def lane_turn(*args: Any, **kwargs: Any) -> Any:
        began = time.thread_time()
        try:
            return turn(*args, **kwargs)
        finally:
            spent["lane"] += time.thread_time() - began

    setattr(session, "run", timed(run))  # noqa: B010
    setattr(session, "run_with_iobinding", timed(bound))  # noqa: B010
    setattr(DecodeScheduler, "_turn", lane_turn)  # noqa: B010
    try:
        work = growing_partials(tr)
        if not quiet:
            print("a partial that ends in its prefill, one at a time, lane CPU ms per request:")
        for r in range(rounds):
            spent.clear()
            count = 0
            for _ in range(20):
                for source, draft in work:
                    enc = tr.encoding([source])
                    tr.decode(enc, DecodeOptions(), drafts=[draft], priority=Priority.PARTIAL)
                    count += 1
            lane, ort_ms = spent["lane"] / count * 1000, spent["ort"] / count * 1000
            per_round["lane"].append(lane)
            per_round["ort"].append(ort_ms)
            per_round["python"].append(lane - ort_ms)
            per_round["calls"].append(spent["calls"] / count)
            if not quiet:
                print(
                    f"  round {r + 1}: lane {lane:.3f} = ONNX Runtime {ort_ms:.3f} "
                    f"({spent['calls'] / count:.1f} calls) + Python {lane - ort_ms:.3f}"
                )
    finally:
        setattr(session, "run", run)  # noqa: B010
        setattr(session, "run_with_iobinding", bound)  # noqa: B010
        setattr(DecodeScheduler, "_turn", turn)  # noqa: B010
    return {name: statistics.median(values) for name, values in per_round.items()}


def one_row_calls(
    tr: Translator, past: int, rows: int = 1
) -> list[tuple[str, Callable[[], object]]]:
    """One row's encoder, prefill (3 positions read) and in-place step (`past` cached
    tokens, the step's buffers bound in place as a lane binds them) through the engine;
    `rows`: the same calls over that many rows (each row's positions read), as
    `host_floor.py` weighs them."""
    model, masked, config = tr.model, tr.model.masked, tr.config
    if masked is None or not isinstance(model.kv, InPlaceSteps):
        raise SystemExit("the model has no in-place steps: nothing to compare")
    steps: InPlaceSteps = model.kv
    ids = np.array([tr.source_ids(SENTENCE, partial=True)] * rows, dtype=np.int64)
    mask = np.ones_like(ids)
    enc = model.encode(ids, mask)
    length = 13
    dec = np.array([[config.decoder_start_token_id, *range(5, 4 + length)]] * rows, dtype=np.int64)
    read = np.full(rows, length - 3)
    rng = np.random.default_rng(0)
    heads, head_dim = config.decoder_attention_heads, config.head_dim
    buffers = [
        rng.standard_normal((rows, heads, past + 8, head_dim)).astype(np.float32)
        for _ in range(2 * config.decoder_layers)
    ]
    source = ids.shape[1]
    cross = tuple(
        rng.standard_normal((rows, heads, source, head_dim)).astype(np.float32)
        for _ in range(2 * config.decoder_layers)
    )
    step_enc = EncoderOutput(enc.hidden_states, enc.attention_mask)
    token, lengths = np.full((rows, 1), 7, dtype=np.int64), np.full(rows, past)
    bound = InPlaceBinding()

    def prefill() -> None:
        logits = masked.prefill(enc, dec, np.ones_like(dec), read)[0]
        for row in range(rows):
            logits.row(row, length - 3)

    def step() -> None:
        steps.step(step_enc, token, lengths, buffers, cross, bound=bound)

    return [
        ("encoder", lambda: model.encode(ids, mask)),
        (f"prefill {length} positions", prefill),
        (f"in-place step, past {past}", step),
    ]


def other_shapes_first(tr: Translator) -> None:
    """One encoder call of other shapes than those timed.

    Why: an ONNX Runtime session's memory pattern serves the shapes of its first call
    only; after a call of other shapes each call costs 10-20% more (measured here on the
    fixture's encoder). A load's checks run most sessions on probes first, and a server's
    calls come in every shape anyway: every session is timed in that state."""
    ids = np.array([[5, 6, 7, 8, 9]] * 2, dtype=np.int64)
    tr.model.encode(ids, np.ones_like(ids))


def medians(rows: list[tuple[str, Callable[[], object]]], rounds: int) -> dict[str, float]:
    spent: dict[str, list[float]] = defaultdict(list)
    for _ in range(rounds):
        for name, call in rows:
            spent[name].append(cpu_ms(call, 200))
    return {name: statistics.median(times) for name, times in spent.items()}


def one_row(model_dir: Path, quantized: bool, rounds: int, past: int) -> None:
    """`one_row_calls`' medians of this process's engine, then those of its `turns`
    (named `turn: ...`), as one line of JSON."""
    tr = Translator.from_dir(model_dir, quantized=quantized, scheduler=SchedulerOptions())
    try:
        other_shapes_first(tr)
        got = medians(one_row_calls(tr, past), rounds)
        got.update({f"turn: {k}": v for k, v in turns(tr, rounds, quiet=True).items()})
        print(json.dumps(got))
    finally:
        tr.close()


def against(before: Path, args: argparse.Namespace) -> None:
    """`one_row` of the engine in `before` and of this checkout's, alternated (ABBA)."""
    roots = {"before": before.resolve(), "after": ROOT}
    got: dict[str, list[dict[str, float]]] = defaultdict(list)
    for repeat in range(args.repeats):
        order = ("before", "after") if repeat % 2 == 0 else ("after", "before")
        for label in order:
            command = [sys.executable, __file__, "--one-row", "--model", str(args.model)]
            command += ["--rounds", str(args.rounds), "--past", str(args.past)]
            command += ["--quantized"] * args.quantized + ["--engine-root", str(roots[label])]
            out = subprocess.run(command, capture_output=True, text=True, check=True)
            got[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
    kind = "int8" if args.quantized else "fp32"
    print(f"{args.model} ({kind}), one row, thread CPU ms per call, medians of {args.repeats}")
    print(f"processes each ({args.rounds} rounds): before = {before}, after = this checkout")
    print(f"  {'call':32s} {'before':>9s} {'after':>9s}  ratio")
    for name in got["before"][0]:
        first = statistics.median(r[name] for r in got["before"])
        second = statistics.median(r[name] for r in got["after"])
        print(f"  {name:32s} {first:9.3f} {second:9.3f}  {second / first:.2f}")


def folded(model_dir: Path, quantized: bool, rounds: int, past: int) -> None:
    """The calls of `one_row_calls` with the shapes folded and not, alternated."""
    loads = {
        fold: Translator.from_dir(
            model_dir, quantized=quantized, scheduler=SchedulerOptions(), fold_shapes=fold
        )
        for fold in (False, True)
    }
    try:
        for tr in loads.values():
            other_shapes_first(tr)
        rows = {fold: one_row_calls(tr, past) for fold, tr in loads.items()}
        spent: dict[tuple[str, bool], list[float]] = defaultdict(list)
        for r in range(rounds):
            order = (False, True) if r % 2 == 0 else (True, False)  # ABBA: neither first
            for i in range(len(rows[False])):
                for fold in order:
                    name, call = rows[fold][i]
                    spent[(name, fold)].append(cpu_ms(call, 200))
        kind = "int8" if quantized else "fp32"
        print(f"{model_dir} ({kind}), one row, thread CPU ms per call, median of {rounds}:")
        print(f"  {'call':32s} {'unfolded':>9s} {'folded':>9s}  ratio")
        for name, _ in rows[False]:
            before = statistics.median(spent[(name, False)])
            after = statistics.median(spent[(name, True)])
            print(f"  {name:32s} {before:9.3f} {after:9.3f}  {after / before:.2f}")
    finally:
        for tr in loads.values():
            tr.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "fixture" / "model")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--folded", action="store_true", help="shapes folded against not")
    parser.add_argument("--quantized", action="store_true", help="the int8 files (--folded)")
    parser.add_argument("--past", type=int, default=20, help="cached tokens of the step")
    parser.add_argument("--against", type=Path, help="another checkout, to compare with")
    parser.add_argument("--repeats", type=int, default=4, help="processes each (--against)")
    parser.add_argument("--one-row", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine-root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.folded:
        folded(args.model, args.quantized, args.rounds, args.past)
        return 0
    if args.one_row:
        one_row(args.model, args.quantized, args.rounds, args.past)
        return 0
    if args.against is not None:
        against(args.against, args)
        return 0
    # The scheduler's defaults, as `serve` opens the model: on two cores two lanes, each
    # call on one intra-op thread (what the bare sessions get).
    tr = Translator.from_dir(args.model, scheduler=SchedulerOptions())
    try:
        calls(tr, args.rounds)
        turns(tr, args.rounds)
    finally:
        tr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
