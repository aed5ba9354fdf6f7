"""Can KV slots be read in place on the CPU? The moonshot of issue 55, measured on whole
graphs: what the ways of reading a slot pool with ONNX Runtime's attention operators cost
a step, against the CPU's default (self-attention in place), with the greedy choice in
the graph or in NumPy.

The slot backend's step reads each row's keys and values out of the pool with `Gather`
(`engine.model.kv.slots.rewrite`), a copy per row and step. ONNX Runtime's CPU attention
operators that read a past buffer where it is (`GroupQueryAttention`, `MultiHeadAttention`,
`DecoderMaskedMultiHeadAttention` with a shared past and present) index that buffer by the
call's own batch row: row r of the step reads and writes row r of the buffer. None takes
a row -> slot map (`PagedAttention`, which does, has no CPU kernel in 1.32). So a pool
indexed by slot can be read in place in two ways only, and this times both:

- `pool`: the step runs over every slot of the pool, idle ones with length 0 (their
  outputs thrown away), so that row = slot: `--pool` rows of work for `rows` rows;
- `compact`: the running rows are kept in the pool's first rows (a leaving row's keys and
  values moved once into the hole), so that the step binds the first `rows` rows: that is
  the CPU's in-place backend (`engine.model.kv.inplace`), whose lane buffers are such a
  pool. Its extra cost is the move at a leave, timed here too (`leave ms`).

And the greedy choice in the graph (`ArgMax` over the logits, the ids returned instead of
the logits) against the logits returned and `numpy.argmax` on them, as the CPU's unscored
searches choose (`engine.decoding.search`), on the compact step.

Every variant runs the engine's rewritten step (`engine.model.passes.masks`, int8 per
token; one row the one-token graph, as the engine does), with its self-attention in place
(`engine.model.kv.inplace.rewrite`) or over slots (`rewrite_step`), whole graphs with the
projection, no Python around, `--tokens` steps from `--past` positions per decode. The
variants' steps are interleaved, each step of a decode run by every variant in a shuffled
order (the load of a shared machine then falls on all alike; a step streams its weights
from memory either way, more than the last-level cache holds), summed per round; medians
of the rounds' ms per step. The engine's figures for the same rows (its slots, in place,
CTranslate2) are `decode_speed.py`'s ("ours int8 slots", "ours int8 cache", "ct2 int8").

    python examples/benchmarks/slot_attention.py [--rows 1 16] [--pool 64] [--model DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO_ROOT / ".cache" / "benchmark-model" / "onnx"
CHOICE = "greedy_choice"

Array = np.ndarray[Any, Any]


def _session(model: bytes, threads: int, per_token: bool) -> ort.InferenceSession:
    """Opened as the engine opens its decoder sessions (`open_session`)."""
    from engine.model.sessions import RuntimeOptions, open_session

    return open_session(model, RuntimeOptions(intra_op_threads=threads), per_token=per_token)


def with_choice(model: bytes) -> bytes:
    """`model` returning the argmax of its logits over the vocabulary (int64 [rows, 1])
    instead of the logits."""
    from engine.model.names import LOGITS

    proto = onnx.load_from_string(model)
    graph = proto.graph
    graph.node.append(helper.make_node("ArgMax", [LOGITS], [CHOICE], axis=-1, keepdims=0))
    kept = [o for o in graph.output if o.name != LOGITS]
    del graph.output[:]
    graph.output.extend(kept)
    graph.output.append(helper.make_tensor_value_info(CHOICE, TensorProto.INT64, None))
    data: bytes = proto.SerializeToString()
    return data


class Step:
    """One in-place step session bound over buffers of `width` rows, of which the first
    `rows` run (the rest idle: length 0), decoding `tokens` steps from `past`."""

    def __init__(
        self,
        session: ort.InferenceSession,
        width: int,
        rows: int,
        args: argparse.Namespace,
        output: str,
    ) -> None:
        from engine.model.names import ENCODER_ATTENTION_MASK, ENCODER_HIDDEN_STATES

        self.session, self.width, self.rows, self.args = session, width, rows, args
        inputs = session.get_inputs()
        self_in = [i for i in inputs if ".decoder." in i.name]
        heads, head_dim = int(self_in[0].shape[1]), int(self_in[0].shape[3])
        rng = np.random.default_rng(7)
        self.binding = session.io_binding()
        self.binding.bind_output(output)
        self.held: list[Array] = []
        capacity = args.past + args.tokens + 1
        self.buffers: dict[str, Array] = {}
        for arg in inputs:
            value: Array | None = None
            if arg.name == ENCODER_ATTENTION_MASK:
                value = np.ones((width, args.source), dtype=np.int64)
            elif arg.name == ENCODER_HIDDEN_STATES:
                hidden = (width, args.source, heads * head_dim)
                value = rng.standard_normal(hidden).astype(np.float32)
            elif ".encoder." in arg.name:
                cross = (width, heads, args.source, head_dim)
                value = rng.standard_normal(cross).astype(np.float32)
            elif ".decoder." in arg.name:
                buffer = rng.standard_normal((width, heads, capacity, head_dim)).astype(np.float32)
                self.buffers[arg.name] = buffer
                dims, address = list(buffer.shape), buffer.ctypes.data
                self.binding.bind_input(arg.name, "cpu", 0, np.float32, dims, address)
                present = arg.name.replace("past_key_values", "present", 1)
                self.binding.bind_output(present, "cpu", 0, np.float32, dims, address)
            if value is not None:
                self.held.append(value)
                self.binding.bind_cpu_input(arg.name, value)
        vocab = args.vocab
        self.tokens = rng.integers(1, vocab, size=(args.tokens, width, 1), dtype=np.int64)
        self.running = np.arange(width) < rows

    def step(self, step: int, choose: Callable[[Array], Array] | None = None) -> Array:
        """Step `step` of a decode: the choice (by `choose` on the logits, or the
        graph's)."""
        from engine.model.names import INPUT_IDS, POSITIONS_INPUT, SEQLENS_INPUT, TOTAL_INPUT

        length = self.args.past + step
        lengths = np.where(self.running, length, 0)
        self.binding.bind_cpu_input(INPUT_IDS, self.tokens[step])
        self.binding.bind_cpu_input(POSITIONS_INPUT, lengths[:, None].astype(np.int64))
        self.binding.bind_cpu_input(SEQLENS_INPUT, lengths.astype(np.int32))
        self.binding.bind_cpu_input(TOTAL_INPUT, np.array(length + 1, dtype=np.int32))
        self.session.run_with_iobinding(self.binding)
        out = self.binding.get_outputs()[0].numpy()[: self.rows]
        chosen: Array = choose(out) if choose is not None else out.reshape(self.rows)
        return chosen

    def decode(self, choose: Callable[[Array], Array] | None = None) -> Array:
        """A decode of `tokens` steps: its last step's choice."""
        chosen: Array = np.zeros(0)
        for step in range(self.args.tokens):
            chosen = self.step(step, choose)
        return chosen


def logits_only(model: bytes) -> bytes:
    """The slot step `model` without its greedy choice: the logits out instead (and its
    updated buffers), the choice's nodes dropped."""
    from engine.model.names import NEXT_IDS, NEXT_SCORES
    from engine.model.passes.graph import live_nodes

    proto = onnx.load_from_string(model)
    graph = proto.graph
    kept = [o for o in graph.output if o.name not in (NEXT_IDS, NEXT_SCORES)]
    nodes = live_nodes(list(graph.node), {o.name for o in kept})
    del graph.output[:]
    graph.output.extend(kept)
    del graph.node[:]
    graph.node.extend(nodes)
    data: bytes = proto.SerializeToString()
    return data


class SlotStep:
    """The slot backend's step (`engine.model.kv.slots.rewrite.rewrite_step`: `Gather`
    of each row's positions out of the pool, `ScatterND` of the new one, the greedy
    choice in the graph) over a pool of `pool` slots, `rows` of them running, spread over
    the pool as a free list leaves them."""

    def __init__(
        self,
        model: bytes,
        per_token: bool,
        pool: int,
        rows: int,
        args: argparse.Namespace,
        choice: bool = True,
    ) -> None:
        from engine.model.config import ModelConfig
        from engine.model.kv.slots.graphed import bind_slot_buffers
        from engine.model.kv.slots.rewrite import SlotShape, rewrite_step
        from engine.model.names import (
            BAN_EOS,
            ENCODER_ATTENTION_MASK,
            LOGITS,
            NEXT_IDS,
            NEXT_SCORES,
            SLOT_ROWS,
            slot_names,
        )

        config = ModelConfig.from_dir(args.model)
        capacity = args.past + args.tokens + 1
        shape = SlotShape(
            config.decoder_layers,
            config.decoder_attention_heads,
            config.head_dim,
            capacity,
            args.source,
        )
        graph = rewrite_step(
            model, shape, config.vocab_size, config.bad_token_ids, config.eos_token_id
        )
        if graph is None:
            raise SystemExit(f"{args.model}: no step over slots for this graph (logged)")
        if not choice:
            graph = logits_only(graph)
        self.session = _session(graph, args.threads, per_token)
        self.args, self.rows, self.choice = args, rows, choice
        self.arrays: list[Array] = []
        buffers: dict[str, ort.OrtValue] = {}
        rng = np.random.default_rng(7)
        for side, positions in (("decoder", capacity), ("encoder", args.source)):
            for name in slot_names(shape.layers, side):
                dims = (pool * shape.heads * positions, shape.head_dim)
                array = rng.standard_normal(dims).astype(np.float32)
                self.arrays.append(array)
                buffers[name] = ort.OrtValue.ortvalue_from_numpy(array)
        self.binding = self.session.io_binding()
        declared = {i.name for i in self.session.get_inputs()}
        outputs = {o.name for o in self.session.get_outputs()}
        bind_slot_buffers(self.binding, buffers, shape.layers, declared, outputs)
        for name in (NEXT_IDS, NEXT_SCORES) if choice else (LOGITS,):
            self.binding.bind_output(name, "cpu")
        self.buffers = buffers
        self.declared = declared
        self.slots = (np.arange(rows) * (pool // rows)).astype(np.int64)
        self.tokens = rng.integers(1, args.vocab, size=(args.tokens, rows, 1), dtype=np.int64)
        fixed = {
            BAN_EOS: np.zeros((rows, 1), dtype=np.bool_),
            ENCODER_ATTENTION_MASK: np.ones((rows, args.source), dtype=np.int64),
            SLOT_ROWS: self.slots,
        }
        for name, value in fixed.items():
            if name in declared:
                self.binding.bind_cpu_input(name, value)

    def step(self, step: int) -> Array:
        """Step `step` of a decode: the graph's choice, or numpy's on its logits."""
        from engine.model.names import INPUT_IDS, MASK_INPUT, POSITIONS_INPUT

        rows, length = self.rows, self.args.past + step
        self.binding.bind_cpu_input(INPUT_IDS, self.tokens[step])
        positions = np.full((rows, 1), length, dtype=np.int64)
        self.binding.bind_cpu_input(POSITIONS_INPUT, positions)
        self.binding.bind_cpu_input(MASK_INPUT, np.ones((rows, length + 1), dtype=np.int64))
        self.session.run_with_iobinding(self.binding)
        if self.choice:
            chosen: Array = self.binding.get_outputs()[-2].numpy()
            return chosen
        return argmax_logits(self.binding.get_outputs()[-1].numpy())


def leave_ms(step: Step, rounds: int) -> float:
    """A leave in a compact pool: the last running row's keys and values (self-attention
    at the decode's end, cross-attention over the source) moved into the first row."""
    length = step.args.past + step.args.tokens
    last = step.rows - 1 if step.rows > 1 else 0
    hole = 0

    def move() -> None:
        for buffer in step.buffers.values():
            buffer[hole, :, :length] = buffer[last, :, :length]
        for value in step.held:
            if value.ndim == 4:
                value[hole] = value[last]

    times = []
    for _ in range(rounds * 20):
        start = time.perf_counter()
        move()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def choice_us(rows: int, vocab: int) -> tuple[float, float, float]:
    """us per call: ONNX Runtime's `ArgMax` over the vocabulary, its `ReduceMax` (the
    largest value alone, no position: a floor for any choice in the graph), and
    `numpy.argmax`, on the same logits, one thread."""
    from onnx import numpy_helper

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1

    def opened(node: onnx.NodeProto, kind: int, constants: list[onnx.TensorProto]) -> Any:
        graph = helper.make_graph(
            [node],
            "choice",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, vocab])],
            [helper.make_tensor_value_info("y", kind, None)],
            initializer=constants,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        return ort.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )

    argmax = opened(
        helper.make_node("ArgMax", ["x"], ["y"], axis=-1, keepdims=0), TensorProto.INT64, []
    )
    largest = opened(
        helper.make_node("ReduceMax", ["x", "axes"], ["y"], keepdims=0),
        TensorProto.FLOAT,
        [numpy_helper.from_array(np.array([-1], dtype=np.int64), "axes")],
    )
    logits = (np.random.default_rng(rows).standard_normal((rows, vocab)) * 3).astype(np.float32)
    assert np.array_equal(argmax.run(None, {"x": logits})[0], logits.argmax(axis=1))
    return (
        median_us(lambda: argmax.run(None, {"x": logits})),
        median_us(lambda: largest.run(None, {"x": logits})),
        median_us(lambda: logits.argmax(axis=1)),
    )


def median_us(run: Callable[[], object], reps: int = 300) -> float:
    for _ in range(20):
        run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def argmax_logits(logits: Array) -> Array:
    chosen: Array = logits.reshape(logits.shape[0], -1).argmax(axis=1)
    return chosen


def measure(pair: Any, args: argparse.Namespace, rows: int) -> dict[str, float]:
    """ms per step of each variant at `rows` running rows, medians of rounds, steps interleaved."""
    from engine.model.kv.inplace.rewrite import rewrite_inplace
    from engine.model.names import LOGITS

    one = rows == 1 and pair.one_token is not None and not args.fp32
    graph = pair.one_token if one else pair.with_past
    per_token = not args.fp32 and not one
    rewritten = rewrite_inplace(graph, str(args.model))
    if rewritten is None:
        raise SystemExit(f"{args.model}: no step in place for this graph (logged)")
    # Over the whole pool, the engine would need the per-token graph (rows exact).
    pool_graph = rewrite_inplace(pair.with_past, str(args.model)) if one else rewritten
    assert pool_graph is not None
    compact = Step(_session(rewritten, args.threads, per_token), rows, rows, args, LOGITS)
    chosen = Step(
        _session(with_choice(rewritten), args.threads, per_token), rows, rows, args, CHOICE
    )
    pool = Step(_session(pool_graph, args.threads, not args.fp32), args.pool, rows, args, LOGITS)
    slots = SlotStep(graph, per_token, args.pool, rows, args)
    slot_logits = SlotStep(graph, per_token, args.pool, rows, args, choice=False)
    # The same tokens either way (the same weights, inputs and kernels).
    same = bool(np.array_equal(compact.decode(argmax_logits), chosen.decode()))
    runs: dict[str, Callable[[int], object]] = {
        "compact": lambda k: compact.step(k, lambda logits: logits),
        "compact + numpy argmax": lambda k: compact.step(k, argmax_logits),
        "compact, argmax in graph": chosen.step,
        "pool": lambda k: pool.step(k, lambda logits: logits),
        "slots": slots.step,
        "slots, numpy argmax": slot_logits.step,
    }
    names = list(runs)
    order = random.Random(rows)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(args.rounds + 1):  # the first warms up
        spent = dict.fromkeys(names, 0.0)
        for step in range(args.tokens):
            order.shuffle(names)
            for name in names:
                start = time.perf_counter()
                runs[name](step)
                spent[name] += time.perf_counter() - start
        if round_:
            for name, seconds in spent.items():
                times[name].append(seconds * 1000 / args.tokens)
    result = {name: statistics.median(values) for name, values in times.items()}
    result["leave"] = leave_ms(compact, args.rounds)
    result["same"] = float(same)
    return result


def _vocab(model: Path) -> int:
    import json

    config = json.loads((model / "config.json").read_text())
    return int(config["vocab_size"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--fp32", action="store_true", help="fp32 files (default: int8)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--pool", type=int, default=64, help="slots in the pool")
    parser.add_argument("--past", type=int, default=1, help="positions before the first step")
    parser.add_argument("--tokens", type=int, default=40, help="steps per decode")
    parser.add_argument("--source", type=int, default=32, help="source positions")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    from engine.model.load import load_batched_decoder

    args.vocab = _vocab(args.model)
    pair = load_batched_decoder(args.model, quantized=not args.fp32, check=False, per_token=True)
    if pair is None:
        print(f"{args.model}: the decoder could not be rewritten (logged)", file=sys.stderr)
        return 1
    print(
        f"{args.model} ({'fp32' if args.fp32 else 'int8'}), {args.threads} threads; "
        f"{args.tokens} steps from {args.past} past positions, {args.source} source, "
        f"a pool of {args.pool} slots; medians of {args.rounds} rounds, steps interleaved; "
        f"{_cpu_name()}"
    )
    columns = {
        "compact": "in place",
        "compact + numpy argmax": "+ numpy argmax",
        "compact, argmax in graph": "argmax in graph",
        "slots": "slots (Gather)",
        "slots, numpy argmax": "+ numpy argmax",
        "pool": "GQA over the pool",
    }
    print("ms per step; x: against in place + numpy argmax (the CPU's default)")
    print(
        f"{'rows':>5}"
        + "".join(f" {title:>18}" for title in columns.values())
        + f" {'leave ms':>9} {'same ids':>9}"
    )
    for rows in args.rows:
        r = measure(pair, args, rows)
        base = r["compact + numpy argmax"]
        cells = "".join(f" {r[key]:>10.3f} ({r[key] / base:4.2f}x)" for key in columns)
        print(f"{rows:>5}{cells} {r['leave']:>9.3f} {bool(r['same'])!s:>9}")
    print()
    print(
        f"the greedy choice alone, us per call of [rows, {args.vocab}] float32 logits, "
        "1 thread, medians of 300 calls"
    )
    print(f"{'rows':>5} {'ORT ArgMax':>11} {'ORT ReduceMax':>14} {'numpy argmax':>13}")
    for rows in args.rows:
        ort_argmax, ort_max, numpy_argmax = choice_us(rows, args.vocab)
        print(f"{rows:>5} {ort_argmax:>11.1f} {ort_max:>14.1f} {numpy_argmax:>13.1f}")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
