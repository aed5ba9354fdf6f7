"""Where a decode lane's thread CPU goes, turn by turn, and why a model call costs more in a
loaded server's lanes than in a quiet loop (docs/performance.md, issue 54's fifth pass).

Three modes, thread CPU, the fixture model unless `--model`:

- `parts` (the default): the engine in process under `host_cost.py`'s load (`--writers`
  streams, a partial every 0.3 s, a final every 8th); each lane turn's thread CPU split
  into ONNX Runtime's calls and the Python around them, by the calls the turn made; each
  part of a turn (inclusive, and its Python: less the ONNX Runtime calls inside it); the
  in-place steps and how many were bound anew. Every wrapped function costs about a
  microsecond more (two thread-clock reads): read the parts against each other, the
  headline figures from `host_cost.py`;
- `cold`: a growing partial whose draft is its whole answer, one at a time (`call_cost.py`'s
  turns): the lane's Python and ONNX Runtime's calls per request, back to back, after a
  sleep, and after other work touched memory and made Python objects meanwhile (what a
  loaded lane's turn comes after: the event loop's work, the other lane's);
- `rebind`: an in-place step over a kept binding whose rows alternate between one and two
  (each count's views the same arrays, as a lane's), against steps of one count.

    python examples/benchmarks/lane_turns.py
    python examples/benchmarks/lane_turns.py --mode cold
    python examples/benchmarks/lane_turns.py --mode rebind
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402

from engine import DecodeOptions, Translator  # noqa: E402
from engine.decoding import continuous  # noqa: E402
from engine.decoding.continuous import ContinuousBatch  # noqa: E402
from engine.decoding.policy import Priority, SchedulingPolicy  # noqa: E402
from engine.decoding.scheduler import DecodeScheduler, SchedulerOptions  # noqa: E402
from engine.model.kv.inplace.rows import InPlaceKv  # noqa: E402
from engine.model.kv.inplace.steps import InPlaceBinding, InPlaceSteps  # noqa: E402
from engine.model.layouts import EncoderOutput  # noqa: E402
from engine.model.marian import MarianOnnx  # noqa: E402

MODEL = ROOT / "models" / "fixture" / "model"
ORT_CALLS = ((ort.InferenceSession, "run"), (ort.InferenceSession, "run_with_iobinding"))
PARTS: tuple[tuple[Any, str], ...] = (
    (DecodeScheduler, "_run_encodes"),
    (MarianOnnx, "encode"),
    (DecodeScheduler, "_answer"),
    (SchedulingPolicy, "schedule"),
    (SchedulingPolicy, "update"),
    (SchedulingPolicy, "hold"),
    (ContinuousBatch, "update"),
    (ContinuousBatch, "schedule"),
    (ContinuousBatch, "execute"),
    (continuous, "confirm"),
    (InPlaceKv, "prefill"),
    (InPlaceKv, "join"),
    (InPlaceKv, "keep"),
    (InPlaceSteps, "step"),
    (InPlaceSteps, "_bind"),
)


class Clock:
    """Thread CPU of wrapped functions on the lanes' threads, once `on`: inclusive, and
    less the ONNX Runtime calls inside (`python`); and each turn's, by its calls."""

    def __init__(self) -> None:
        self.on = False
        self.spent: Counter[str] = Counter()
        self.python: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.turns: Counter[int] = Counter()
        self.turn_python: Counter[int] = Counter()
        self.turn_ort: Counter[int] = Counter()
        self._local = threading.local()

    def _ort(self) -> int:
        return int(getattr(self._local, "ort", 0))

    def wrap(self, owner: Any, name: str, is_ort: bool = False) -> None:
        method = getattr(owner, name)
        label = f"{getattr(owner, '__name__', owner).split('.')[-1]}.{name}"
        clock = self

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not clock.on or not threading.current_thread().name.startswith("decode-lane"):
                return method(*args, **kwargs)
            before, began = clock._ort(), time.thread_time_ns()
            try:
                return method(*args, **kwargs)
            finally:
                took = time.thread_time_ns() - began
                clock.spent[label] += took
                clock.calls[label] += 1
                if is_ort:
                    clock._local.ort = before + took
                    clock._local.count = getattr(clock._local, "count", 0) + 1
                else:
                    clock.python[label] += took - (clock._ort() - before)

        setattr(owner, name, wrapped)

    def wrap_turn(self) -> None:
        turn = DecodeScheduler._turn
        clock = self

        def timed(scheduler: DecodeScheduler, *args: Any) -> Any:
            if not clock.on:
                return turn(scheduler, *args)
            clock._local.ort, clock._local.count = 0, 0
            began = time.thread_time_ns()
            try:
                return turn(scheduler, *args)
            finally:
                took, calls = time.thread_time_ns() - began, int(clock._local.count)
                clock.turns[calls] += 1
                clock.turn_python[calls] += took - clock._ort()
                clock.turn_ort[calls] += clock._ort()

        setattr(DecodeScheduler, "_turn", timed)  # noqa: B010


def parts(args: argparse.Namespace) -> None:
    """The engine in process under `host_cost.py`'s load, its lanes' turns taken apart."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import host_cost

    clock = Clock()
    clock.wrap_turn()
    for owner, name in ORT_CALLS:
        clock.wrap(owner, name, is_ort=True)
    for owner, name in PARTS:
        clock.wrap(owner, name)
    timer = threading.Timer(args.warmup + 1.0, lambda: setattr(clock, "on", True))
    timer.daemon = True
    timer.start()  # after the model's load (about a second) and the warm-up
    load = ["--child", "inproc", "--root", str(ROOT), "--writers", str(args.writers)]
    load += ["--seconds", str(args.seconds), "--warmup", str(args.warmup + 1.0)]
    host_cost.main([*load, "--model", str(args.model)])
    turns = sum(clock.turns.values())
    if not turns:
        raise SystemExit("no lane turn was measured")
    print(f"{turns} lane turns measured; thread CPU us per turn, by the model calls it made:")
    for calls in sorted(clock.turns):
        n = clock.turns[calls]
        python, ort_us = clock.turn_python[calls] / n / 1e3, clock.turn_ort[calls] / n / 1e3
        print(f"  {calls} calls: {n:5d} turns, Python {python:6.1f}, ONNX Runtime {ort_us:6.1f}")
    print("each part (us a call, inclusive; its Python; its Python per turn):")
    for label, spent in clock.spent.most_common():
        n = clock.calls[label]
        own = ""
        if label in clock.python:
            mine = clock.python[label]
            own = f", Python {mine / n / 1e3:6.1f} ({mine / turns / 1e3:5.1f} a turn)"
        print(f"  {label:34s} {n:6d} calls {spent / n / 1e3:7.1f}{own}")
    steps, bound = clock.calls["InPlaceSteps.step"], clock.calls["InPlaceSteps._bind"]
    if steps:
        print(f"in-place steps bound anew: {bound} of {steps} ({bound / steps:.0%})")


def cold(args: argparse.Namespace) -> None:
    """A partial's lane turn, one at a time: back to back, after a sleep, after other work."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from call_cost import growing_partials

    tr = Translator.from_dir(args.model, scheduler=SchedulerOptions())
    clock = Clock()
    clock.wrap_turn()
    for owner, name in ORT_CALLS:
        clock.wrap(owner, name, is_ort=True)
    work = growing_partials(tr)
    junk = np.ones(2 << 20, dtype=np.uint8)

    def other_work() -> None:
        junk.sum()
        [str(i) for i in range(2000)]
        time.sleep(0.0005)

    modes: dict[str, Callable[[], object]] = {
        "back to back": lambda: None,
        "after a 2 ms sleep": lambda: time.sleep(0.002),
        "after other work": other_work,
    }
    spent: defaultdict[str, list[tuple[float, float]]] = defaultdict(list)
    clock.on = True
    for _ in range(args.rounds):
        for mode, between in modes.items():
            clock.turns.clear()
            clock.turn_python.clear()
            clock.turn_ort.clear()
            count = 0
            for _ in range(8):
                for source, draft in work:
                    between()
                    enc = tr.encoding([source])
                    tr.decode(enc, DecodeOptions(), drafts=[draft], priority=Priority.PARTIAL)
                    count += 1
            python = sum(clock.turn_python.values()) / count / 1e3
            spent[mode].append((python, sum(clock.turn_ort.values()) / count / 1e3))
    print("a partial that ends in its prefill, one at a time; lane thread CPU us per request")
    for mode, figures in spent.items():
        python = statistics.median(f[0] for f in figures)
        ort_us = statistics.median(f[1] for f in figures)
        print(f"  {mode:20s} Python {python:6.1f}, ONNX Runtime {ort_us:6.1f}")
    tr.close()


def rebind(args: argparse.Namespace) -> None:
    """An in-place step whose row count alternates 1, 2, 1, ..., against one count."""
    tr = Translator.from_dir(args.model, scheduler=SchedulerOptions())
    steps, config = tr.model.kv, tr.config
    if not isinstance(steps, InPlaceSteps):
        raise SystemExit("the model has no in-place steps")
    rng = np.random.default_rng(0)
    heads, size, layers = config.decoder_attention_heads, config.head_dim, config.decoder_layers
    buffers = [
        rng.standard_normal((4, heads, 64, size)).astype(np.float32) for _ in range(2 * layers)
    ]
    cross = [
        rng.standard_normal((4, heads, 16, size)).astype(np.float32) for _ in range(2 * layers)
    ]
    mask = np.ones((4, 16), dtype=np.int64)
    views = {
        n: (
            EncoderOutput(np.zeros((n, 0, 0), np.float32), mask[:n]),
            tuple(b[:n] for b in cross),
            tuple(b[:n] for b in buffers),
        )
        for n in (1, 2)
    }
    bound = InPlaceBinding()

    def step(rows: int) -> None:
        enc, cross_kv, self_kv = views[rows]
        ids, lengths = np.full((rows, 1), 7, np.int64), np.full(rows, 20, np.int64)
        steps.step(enc, ids, lengths, self_kv, cross_kv, bound=bound)

    def per_step(order: list[int], repeats: int = 200) -> float:
        for rows in order * 10:
            step(rows)
        began = time.thread_time_ns()
        for _ in range(repeats):
            for rows in order:
                step(rows)
        return (time.thread_time_ns() - began) / repeats / len(order) / 1e3

    orders = {"rows 1, 2, 1, 2, ...": [1, 2], "one row": [1], "two rows": [2]}
    spent: defaultdict[str, list[float]] = defaultdict(list)
    for _ in range(args.rounds):
        for name, order in orders.items():
            spent[name].append(per_step(order))
    print("an in-place step over a kept binding, thread CPU us a step (medians):")
    for name, figures in spent.items():
        print(f"  {name:22s} {statistics.median(figures):6.1f}")
    tr.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("parts", "cold", "rebind"), default="parts")
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--writers", type=int, default=120, help="parts: streams")
    parser.add_argument("--seconds", type=float, default=6.0, help="parts: measured")
    parser.add_argument("--warmup", type=float, default=1.0, help="parts: seconds before")
    parser.add_argument("--rounds", type=int, default=5, help="cold, rebind: medians of")
    args = parser.parse_args()
    {"parts": parts, "cold": cold, "rebind": rebind}[args.mode](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
