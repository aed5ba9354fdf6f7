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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from engine import DecodeOptions, Translator
from engine.decoding.scheduler import SchedulerOptions

SOURCE = "我们明天下午三点在图书馆见面，然后一起去吃饭。"

Timer = Callable[[int, int], float]
"""decode(tokens, rows) -> seconds"""


def engine_timer(model: Path, device: str, rows: int, kv_slots: int | None) -> Timer:
    tr = Translator.from_dir(
        model,
        scheduler=SchedulerOptions(
            lanes=1, max_rows=rows, kv_slots=kv_slots, prefill_positions=1 << 20
        ),
        device=device,
    )
    enc = tr.encode([tr.source_ids(SOURCE)])

    def decode(tokens: int, b: int) -> float:
        options = DecodeOptions(max_new_tokens=tokens, min_new_tokens=tokens)
        batch = enc.select(np.zeros(b, dtype=np.int64))
        start = time.perf_counter()
        hyps = tr.decode(batch, options)
        elapsed = time.perf_counter() - start
        assert all(len(h.token_ids) == tokens for h in hyps), [len(h.token_ids) for h in hyps]
        return elapsed

    return decode


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
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    copied = {int(r) for r in args.copied_rows.split(",") if r}
    most = max(rows)
    sides: dict[str, Timer] = {}
    loaded: dict[str, float] = {}
    t0 = time.perf_counter()
    sides["engine fp32 (slots)"] = engine_timer(args.model, args.device, most, None)
    loaded["engine fp32"] = time.perf_counter() - t0
    if args.fp16_model is not None:
        t0 = time.perf_counter()
        sides["engine fp16 (slots)"] = engine_timer(args.fp16_model, args.device, most, None)
        loaded["engine fp16"] = time.perf_counter() - t0
    if copied:
        sides["engine fp32 (copied)"] = engine_timer(args.model, args.device, most, 0)
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
