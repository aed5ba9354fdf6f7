"""Decode speed per row-token on one device, the engine beside Hugging Face transformers.

Each side decodes B copies of one source with forced output lengths (greedy), twice: with
`--tokens` and with `--short` tokens; the difference over the extra steps is the cost of
a step without the encoder and the prefill, divided by B. Medians of `--reps` rounds, the
sides alternated within each round. The engine runs with its KV slots (the default) and,
at the rows `--copied-rows` names, with its state copied per step (`kv_slots=0`) as a
before figure. Prints one table; `--json` also writes it.

usage (a GPU machine; ../shared/gpu/README.md brings onnxruntime-gpu and the model):
  python examples/benchmarks/gpu_decode.py --model M/onnx --checkpoint M/checkpoint \\
      --device cuda --rows 1,16,64,256,1024
On the CPU (`--device cpu`, small rows) it is a smoke test of the same code.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from engine import DecodeOptions, Translator
from engine.decoding.scheduler import SchedulerOptions
from engine.decoding.timeline import Timeline
from engine.model.config import ModelConfig
from engine.model.marian import MarianOnnx
from engine.model.sessions import RuntimeOptions, device_options
from engine.model.tokenizer import MarianTokenizer

SOURCE = "我们明天下午三点在图书馆见面，然后一起去吃饭。"

Timer = Callable[[int, int], float]
"""decode(tokens, rows) -> seconds"""


TIMELINES: dict[str, Timeline] = {}

LAST: dict[int, list[tuple[int, ...]]] = {}
"""id(decode) -> the token ids of its last call: fp32 with and without CUDA graphs must
agree (a replayed graph that wrote elsewhere would leave stale choices)."""


def engine_timer(
    model: Path,
    device: str,
    rows: int,
    kv_slots: int | None,
    profile: str | None = None,
    cuda_graphs: bool | None = None,
) -> tuple[Timer, Translator]:
    scheduler = SchedulerOptions(
        lanes=1, max_rows=rows, kv_slots=kv_slots, prefill_positions=1 << 20
    )
    threads = scheduler.resolved()
    options = RuntimeOptions(
        intra_op_threads=threads.per_lane,
        head_threads=threads.head,
        profile=profile,
        kv_slots=kv_slots != 0,  # on the CPU too (a smoke test), where they are not the default
        cuda_graphs=cuda_graphs,
        **device_options(device),
    )
    config = ModelConfig.from_dir(model)
    tr = Translator(MarianOnnx(model, config, options), MarianTokenizer.from_dir(model), scheduler)
    tr.scheduler.timeline = Timeline()
    enc = tr.encode([tr.source_ids(SOURCE)])

    def decode(tokens: int, b: int) -> float:
        options = DecodeOptions(max_new_tokens=tokens, min_new_tokens=tokens)
        batch = enc.select(np.zeros(b, dtype=np.int64))
        start = time.perf_counter()
        hyps = tr.decode(batch, options)
        elapsed = time.perf_counter() - start
        assert all(len(h.token_ids) == tokens for h in hyps), [len(h.token_ids) for h in hyps]
        LAST[id(decode)] = [h.token_ids for h in hyps]
        return elapsed

    return decode, tr


def step_parts(timeline: Timeline, rows: int) -> str:
    """Median ms per step of a turn's parts, steps of `rows` rows that no row joined."""
    steps = [s for s in timeline.steps() if s.rows == rows and not s.joined and not s.encode_rows]
    if not steps:
        return "-"
    parts = {
        name: 1000 * statistics.median(getattr(s, name) for s in steps)
        for name in ("update", "schedule", "execute")
    }
    return " ".join(f"{k} {v:.2f}" for k, v in parts.items()) + f" ({len(steps)} steps)"


def profile_summary(tr: Translator, top: int = 14) -> None:
    """The slot step session's ONNX Runtime profile, by operator: ms per step."""
    pool = tr.scheduler.kv
    if pool is None:
        return
    path = pool.sessions["step"].end_profiling()
    events = json.loads(Path(path).read_text())
    runs = sum(1 for e in events if e.get("name") == "model_run")
    by_op: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time"):
            op = e.get("args", {}).get("op_name", "?")
            provider = e.get("args", {}).get("provider", "")
            key = f"{op} ({provider.replace('ExecutionProvider', '')})"
            by_op[key] = by_op.get(key, 0.0) + float(e.get("dur", 0))
    total = sum(by_op.values())
    print(f"profile: {runs} runs, kernels {total / max(runs, 1) / 1000:.3f} ms per run")
    for key, us in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {key:40s} {us / max(runs, 1) / 1000:.3f} ms per run")


def transformers_timer(checkpoint: Path, device: str, half: bool) -> Timer:
    import torch
    from transformers import MarianMTModel, MarianTokenizer

    tok = MarianTokenizer.from_pretrained(str(checkpoint))
    net = MarianMTModel.from_pretrained(str(checkpoint)).to(device).eval()
    if half:
        net = net.half()
    ids = tok([SOURCE], return_tensors="pt").input_ids.to(device)

    def decode(tokens: int, b: int) -> float:
        batch = ids.repeat(b, 1)
        torch.cuda.synchronize() if device.startswith("cuda") else None
        start = time.perf_counter()
        with torch.inference_mode():
            out = net.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                num_beams=1,
                do_sample=False,
                min_new_tokens=tokens,
                max_new_tokens=tokens,
            )
        torch.cuda.synchronize() if device.startswith("cuda") else None
        elapsed = time.perf_counter() - start
        assert out.shape[1] >= tokens, out.shape
        return elapsed

    return decode


def per_row_token(timer: Timer, rows: int, tokens: int, short: int) -> float:
    """ms per row-token of the extra steps (one round)."""
    long_s, short_s = timer(tokens, rows), timer(short, rows)
    return 1000 * (long_s - short_s) / ((tokens - short) * rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="the ONNX model directory")
    parser.add_argument("--checkpoint", type=Path, help="its PyTorch checkpoint (the peer)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", default="1,16,64,256,1024")
    parser.add_argument("--copied-rows", default="1,256", help="rows run with kv_slots=0 too")
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--short", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--fp16-model", type=Path, help="an fp16 ONNX model to run as well")
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run fp32 with and without its greedy steps replayed as CUDA graphs, and fp16 "
        "with them (--no-cuda-graphs: both without)",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--profile-rows", type=int, default=0, help="profile the fp32 slot step at these rows"
    )
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    copied = {int(r) for r in args.copied_rows.split(",") if r}
    most = max(rows)
    sides: dict[str, Timer] = {}
    engines: dict[str, Translator] = {}
    loaded: dict[str, float] = {}
    # (name, model, kv_slots, cuda_graphs): None is the device's default.
    variants: list[tuple[str, Path, int | None, bool | None]] = [
        ("engine fp32 (slots)", args.model, None, False)
    ]
    if args.cuda_graphs:
        variants.append(("engine fp32 (graphs)", args.model, None, True))
    if args.fp16_model is not None:  # fp16 one way only: the time of a lent GPU is short
        kind = "graphs" if args.cuda_graphs else "slots"
        variants.append((f"engine fp16 ({kind})", args.fp16_model, None, args.cuda_graphs))
    if copied:
        variants.append(("engine fp32 (copied)", args.model, 0, False))
    for name, path, kv_slots, graphs in variants:
        t0 = time.perf_counter()
        sides[name], engines[name] = engine_timer(
            path, args.device, most, kv_slots, cuda_graphs=graphs
        )
        loaded[name] = time.perf_counter() - t0
        pool = engines[name].scheduler.kv
        if graphs and (pool is None or pool.graphed is None):
            print(f"{name}: no CUDA graphs (see the warning above); its steps are ordinary")
    if args.checkpoint is not None:
        torch_device = "cuda" if args.device.startswith("cuda") else "cpu"
        sides["transformers fp32"] = transformers_timer(args.checkpoint, torch_device, False)
        if torch_device == "cuda":
            sides["transformers fp16"] = transformers_timer(args.checkpoint, torch_device, True)
    print("loaded in", {k: round(v, 1) for k, v in loaded.items()}, "s", flush=True)
    results: dict[str, dict[int, float]] = {name: {} for name in sides}
    for b in rows:
        for name, timer in sides.items():
            if "copied" in name and b not in copied:
                continue
            timer(args.short, b)  # warm-up: shapes, arenas, kernels
        samples: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(args.reps):
            for name, timer in sides.items():
                if "copied" in name and b not in copied:
                    continue
                samples[name].append(per_row_token(timer, b, args.tokens, args.short))
        for name, values in samples.items():
            if values:
                results[name][b] = statistics.median(values)
        line = "  ".join(f"{n}: {results[n][b]:.4f}" for n in sides if b in results[n])
        print(f"rows {b:5d}  ms per row-token  {line}", flush=True)
        plain, graphed = sides["engine fp32 (slots)"], sides.get("engine fp32 (graphs)")
        if graphed is not None:
            same = LAST[id(plain)] == LAST[id(graphed)]
            print(f"    fp32 tokens with CUDA graphs equal those without: {same}", flush=True)
        for name, tr in engines.items():
            assert tr.scheduler.timeline is not None
            pool = tr.scheduler.kv
            replayed = None if pool is None else pool.graphed
            counted = "" if replayed is None else f", {replayed.graphs} graphs"
            print(
                f"    {name} per step: {step_parts(tr.scheduler.timeline, b)}{counted}", flush=True
            )
    if args.profile_rows:
        prefix = str(Path(tempfile.mkdtemp(prefix="gpu-decode-")) / "slot_step")
        # The ordinary step: a replayed CUDA graph has no operators for the profile to see.
        timer, tr = engine_timer(
            args.model, args.device, args.profile_rows, None, prefix, cuda_graphs=False
        )
        timer(args.tokens, args.profile_rows)
        print(f"rows {args.profile_rows}, {args.tokens} tokens:")
        profile_summary(tr)
    print()
    print("| rows | " + " | ".join(sides) + " |")
    print("| ---: |" + " ---: |" * len(sides))
    for b in rows:
        cells = [f"{results[n][b]:.4f}" if b in results[n] else "-" for n in sides]
        print(f"| {b} | " + " | ".join(cells) + " |")
    if args.json is not None:
        payload: dict[str, Any] = {"device": args.device, "results": results, "loaded": loaded}
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
