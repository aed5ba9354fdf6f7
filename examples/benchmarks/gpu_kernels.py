"""GPU time of the engine's decode by CUDA kernel: which kernels a step's time goes to
at a few row counts, read with PyTorch's CUPTI profiler, which sees every kernel the
process launches (ONNX Runtime's included). For a GPU machine with PyTorch (docs/gpu.md).

usage: python examples/benchmarks/gpu_kernels.py --model M/onnx --rows 1,16,256
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_decode import engine_timer


def main(argv: list[str] | None = None) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", default="1,16,256")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--max-rows", type=int, default=1024)
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--top", type=int, default=14)
    args = parser.parse_args(argv)
    decode, _ = engine_timer(
        args.model, args.device, args.max_rows, None, cuda_graphs=args.cuda_graphs
    )
    for rows in (int(r) for r in args.rows.split(",")):
        decode(args.tokens, rows)  # warm-up
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            seconds = decode(args.tokens, rows)
            torch.cuda.synchronize()
        stats = []
        for ev in prof.key_averages():
            device = getattr(ev, "self_device_time_total", None)
            if device is None:
                device = getattr(ev, "self_cuda_time_total", 0)
            if device:
                stats.append((float(device), int(ev.count), str(ev.key)))
        stats.sort(reverse=True)
        total = sum(s[0] for s in stats)
        print(
            f"rows {rows}: decode of {args.tokens} tokens {1000 * seconds:.1f} ms, "
            f"GPU kernels {total / 1000:.1f} ms ({total / 1000 / args.tokens:.2f} ms per token)"
        )
        for us, count, name in stats[: args.top]:
            print(f"  {us / 1000:8.2f} ms {count:6d}x  {name[:110]}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
