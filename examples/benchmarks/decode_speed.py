"""Greedy decode speed of the engine vs CTranslate2 on the OPUS-MT-sized benchmark model.

How it measures, and why:
- The benchmark model (``models/build_benchmark_model.py``) has random weights, so output
  lengths are forced (eos masked until N tokens): every engine does exactly N steps.
- Per-token cost excludes the encoder. Ours: ``Translator.decode`` is timed on a precomputed
  encoder output, ms/token = decode time / N. CTranslate2 runs encoder and decoder in one
  ``translate_batch`` call, so it is timed at N and at 1 token and
  ms/token = (T(N) - T(1)) / (N - 1): the encoder and the first step cancel out (T(1) is
  reported as "first ms"). A per-step callback would time it directly but costs it ~5%.
  The same slope is given for ours, (decode(N) - decode(1)) / (N - 1); ratios both ways.
- Each variant runs in its own worker process (as a deployed engine would: one model, one
  process), so thread pools and allocations of one variant cannot slow another; the workers
  are driven in interleaved, shuffled rounds so that load drift on a shared machine hits
  all variants alike. Reported values are medians; CPU time per token is given too (close
  to wall time when nothing else competed for the cores).
- "ours" runs the engine's defaults (split decoder files when present, ORT worker threads
  that sleep instead of spinning). ``--tuned`` adds other settings for comparison
  (merged ``If`` decoder, spinning threads). ``--hugepages`` starts every worker with
  ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (weights on transparent huge pages).

    HF_HUB_OFFLINE=1 python models/build_benchmark_model.py      # once
    python examples/benchmarks/decode_speed.py --threads 2 --lengths 40 --rows 1 16
    python examples/benchmarks/decode_speed.py --tuned --json out/decode_speed.json

Needs the ``bench`` extra (CTranslate2) and ``../shared/flores200-devtest`` (``--line``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO_ROOT / ".cache" / "benchmark-model"
DEFAULT_SOURCE = REPO_ROOT.parent / "shared" / "flores200-devtest" / "zho_Hans.devtest"
# Line 37 (0-based) has 26 source tokens with eos, the median of the devtest set.
DEFAULT_LINE = 37
TARGETS = {"int8_vs_ct2_int8_max": 0.35, "cache_speedup_min": 2.0}
HUGEPAGES_ENV = "glibc.malloc.hugetlb=1"

# name -> worker spec; "ours" variants use the engine API, "ct2" ones CTranslate2.
VARIANTS: dict[str, dict[str, Any]] = {
    "ours fp32 cache": {"engine": "ours", "quantized": False, "use_cache": True},
    "ours fp32 no-cache": {"engine": "ours", "quantized": False, "use_cache": False},
    "ours int8 cache": {"engine": "ours", "quantized": True, "use_cache": True},
    "ours int8 no-cache": {"engine": "ours", "quantized": True, "use_cache": False},
    # The files' per-call activation scale (rows then depend on their batch mates).
    "ours int8 per call": {
        "engine": "ours",
        "quantized": True,
        "use_cache": True,
        "int8_per_token": False,
    },
    # The decoder state in KV slots (`--kv-slots`; on the CPU the default copies it per step).
    "ours int8 slots": {"engine": "ours", "quantized": True, "use_cache": True, "kv_slots": 64},
    # Self-attention's keys and values copied at every step (`--no-inplace-attention`), as
    # before the default extended them in place (`engine.model.kv.inplace.rows`).
    "ours int8 copied": {
        "engine": "ours",
        "quantized": True,
        "use_cache": True,
        "inplace_attention": False,
    },
    "ct2 fp32": {"engine": "ct2", "dir": "ct2-float32"},
    "ct2 int8": {"engine": "ct2", "dir": "ct2-int8"},
}
# With --glossary: the default int8 variant with a 1,000-entry glossary (`synthetic_glossary`)
# that matches nothing in the source ("none": the plain search, matching costs only), or
# one term of it ("one": the constrained greedy search, its term placed at the end).
GLOSSARY: dict[str, dict[str, Any]] = {
    "ours int8 glossary none": {
        "engine": "ours",
        "quantized": True,
        "use_cache": True,
        "glossary": "none",
    },
    "ours int8 glossary one": {
        "engine": "ours",
        "quantized": True,
        "use_cache": True,
        "glossary": "one",
    },
}
GLOSSARY_ENTRIES = 1000


def synthetic_glossary(source: str, kind: str) -> Any:
    """`GLOSSARY_ENTRIES` zh->en terms of two CJK characters that the source does not hold
    (`kind` "none"), or the same with the source's first two CJK characters as one of them
    ("one"); every target is an English word."""
    from engine.glossary import Glossary

    held = {source[i : i + 2] for i in range(len(source) - 1)}
    pairs: list[tuple[str, str | None]] = []
    code = 0x4E00
    while len(pairs) < GLOSSARY_ENTRIES - (kind == "one"):
        term = chr(code) + chr(code + 1)
        code += 2
        if term not in held:
            pairs.append((term, "term"))
    if kind == "one":
        cjk = [ch for ch in source if "\u4e00" <= ch <= "\u9fff"]
        pairs.append(("".join(cjk[:2]), "glossary"))
    return Glossary.from_pairs("zh", "en", pairs)


# With --tuned: settings the engine does not use by default, for comparison (the
# merged `If` decoder, ORT worker threads that spin, every op of a step on all --threads,
# every op of a step on one thread).
TUNED: dict[str, dict[str, Any]] = {
    "ours int8 cache all-threads": {
        "engine": "ours",
        "quantized": True,
        "use_cache": True,
        "intra_op_threads": "all",
    },
    "ours int8 cache one-thread": {
        "engine": "ours",
        "quantized": True,
        "use_cache": True,
        "head_threads": 1,
    },
    "ours int8 cache merged+spin": {
        "engine": "ours",
        "quantized": True,
        "use_cache": True,
        "prefer_split": False,
        "allow_spinning": True,
    },
    "ours fp32 cache merged+spin": {
        "engine": "ours",
        "quantized": False,
        "use_cache": True,
        "prefer_split": False,
        "allow_spinning": True,
    },
}


# -- worker side: one variant per process ------------------------------------------------


Runner = Callable[[int, int], dict[str, float]]
"""run(N, B): decode B copies of the source at once, N forced tokens each."""


def _ours_runner(spec: dict[str, Any]) -> tuple[Runner, Callable[[], None]]:
    import numpy as np

    from engine import DecodeOptions, Translator
    from engine.decoding.scheduler import SchedulerOptions

    # --threads is the cores the model may use, set the way the engine sets them: its
    # scheduler decides the threads of each call (one per lane, the output projection on
    # all); "all-threads" puts every op of a call on all of them.
    everything = spec.get("intra_op_threads") == "all"
    tr = Translator.from_dir(
        Path(spec["model"]) / "onnx",
        quantized=spec["quantized"],
        use_cache=spec["use_cache"],
        prefer_split=spec.get("prefer_split", True),
        allow_spinning=spec.get("allow_spinning", False),
        intra_op_threads=spec["threads"] if everything else None,
        scheduler=SchedulerOptions(
            cores=spec["threads"],
            head_threads=spec.get("head_threads"),
            **({"kv_slots": spec["kv_slots"]} if "kv_slots" in spec else {}),
            **(
                {"inplace_attention": spec["inplace_attention"]}
                if "inplace_attention" in spec
                else {}
            ),
        ),
        int8_per_token=spec.get("int8_per_token", True),
    )
    ids = tr.source_ids(spec["source"])
    enc = tr.encode([ids])
    glossary = synthetic_glossary(spec["source"], spec["glossary"]) if "glossary" in spec else None

    def run(n: int, b: int) -> dict[str, float]:
        options = DecodeOptions(beam_size=1, max_new_tokens=n, min_new_tokens=n)
        rows = enc.select(np.zeros(b, dtype=np.int64))  # B copies: one batched decode
        start = time.perf_counter()
        if glossary is not None:  # matched per call, as a stream's every partial is
            terms = tr.constraints(spec["source"], glossary)
            hyps = tr.decode(rows, options, constraints=[terms] * b if terms else None)
        else:
            hyps = tr.decode(rows, options)
        elapsed = time.perf_counter() - start
        if any(len(hyp.token_ids) != n for hyp in hyps):
            raise RuntimeError(f"forced length {n}, got {[len(h.token_ids) for h in hyps]}")
        return {"decode": elapsed}

    def encode() -> None:
        tr.encode([ids])

    return run, encode


def _ct2_runner(spec: dict[str, Any]) -> Runner:
    import ctranslate2

    from engine.model.tokenizer import MarianTokenizer

    tok = MarianTokenizer.from_dir(Path(spec["model"]) / "onnx")
    pieces = [tok.id_to_piece(i) for i in tok.encode_source(spec["source"])]
    tr = ctranslate2.Translator(
        str(Path(spec["model"]) / spec["dir"]),
        device="cpu",
        intra_threads=spec["threads"],
        inter_threads=1,
    )

    def run(n: int, b: int) -> dict[str, float]:
        start = time.perf_counter()
        results = tr.translate_batch(
            [pieces] * b,
            beam_size=1,  # greedy; CTranslate2's default is 2
            max_decoding_length=n,
            min_decoding_length=n,
            return_scores=False,
        )
        total = time.perf_counter() - start
        if any(len(result.hypotheses[0]) != n for result in results):
            raise RuntimeError(f"forced length {n}, got other lengths")
        return {"total": total}

    return run


def worker(spec: dict[str, Any]) -> int:
    """Serve `run N` / `encode` / `quit` lines on stdin with one JSON line each on stdout."""
    sys.path.insert(0, str(REPO_ROOT))
    encode: Callable[[], None] | None = None
    if spec["engine"] == "ours":
        run, encode = _ours_runner(spec)
    else:
        run = _ct2_runner(spec)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "quit":
            break
        cpu = time.process_time()
        if command[0] == "run":
            rows = int(command[2]) if len(command) > 2 else 1
            reply: dict[str, float] = run(int(command[1]), rows)
        elif command[0] == "encode" and encode is not None:
            start = time.perf_counter()
            encode()
            reply = {"encoder": time.perf_counter() - start}
        else:
            reply = {}
        reply["cpu"] = time.process_time() - cpu
        print(json.dumps(reply), flush=True)
    return 0


# -- driver side --------------------------------------------------------------------------


@dataclass
class Worker:
    """A variant's worker process and the samples it returned."""

    name: str
    engine: str
    proc: subprocess.Popen[str]
    samples: dict[str, list[float]] = field(default_factory=dict)

    def ask(self, command: str) -> dict[str, float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name!r} died (see its stderr above)")
        reply: dict[str, float] = json.loads(line)
        return reply

    def record(self, key: str, value: float) -> None:
        self.samples.setdefault(key, []).append(value)


def start_worker(name: str, spec: dict[str, Any], hugepages: bool) -> Worker:
    env = {**os.environ, **spec.get("env", {})}
    if hugepages:
        env["GLIBC_TUNABLES"] = ":".join(
            t for t in (env.get("GLIBC_TUNABLES", ""), HUGEPAGES_ENV) if t
        )
    proc = subprocess.Popen(
        [sys.executable, __file__, "--worker", json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    w = Worker(name, spec["engine"], proc)
    assert proc.stdout is not None
    if not json.loads(proc.stdout.readline() or "{}").get("ready"):
        raise RuntimeError(f"worker {name!r} failed to start (see its stderr above)")
    return w


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def summarize(workers: list[Worker], lengths: list[int]) -> dict[str, dict[str, float]]:
    """Medians per variant: encoder ms, ms/token and CPU ms/token at each length, slope."""
    out: dict[str, dict[str, float]] = {}
    longest = max(lengths)
    for w in workers:
        row: dict[str, float] = {}
        if "encoder" in w.samples:
            row["encoder_ms"] = _median_ms(w.samples["encoder"])
        for n in lengths:
            if f"cpu@{n}" not in w.samples:
                continue
            if w.engine == "ours":
                row[f"decode_ms@{n}"] = _median_ms(w.samples[f"decode@{n}"])
                row[f"ms_per_token@{n}"] = row[f"decode_ms@{n}"] / n
                row[f"cpu_ms_per_token@{n}"] = _median_ms(w.samples[f"cpu@{n}"]) / n
            else:
                row[f"total_ms@{n}"] = _median_ms(w.samples[f"total@{n}"])
                if n > 1 and "total@1" in w.samples:
                    # Encoder and first step cancel out: what is left is steps 2..N.
                    row[f"ms_per_token@{n}"] = (
                        row[f"total_ms@{n}"] - _median_ms(w.samples["total@1"])
                    ) / (n - 1)
                    row[f"cpu_ms_per_token@{n}"] = (
                        _median_ms(w.samples[f"cpu@{n}"]) - _median_ms(w.samples["cpu@1"])
                    ) / (n - 1)
        if w.engine == "ours" and "decode_ms@1" in row and f"decode_ms@{longest}" in row:
            row[f"slope_ms_per_token@{longest}"] = (
                row[f"decode_ms@{longest}"] - row["decode_ms@1"]
            ) / (longest - 1)
        elif w.engine == "ct2" and f"ms_per_token@{longest}" in row:
            row[f"slope_ms_per_token@{longest}"] = row[f"ms_per_token@{longest}"]
            row["first_ms"] = row["total_ms@1"]
        out[w.name] = row
    return out


def ratios(summary: dict[str, dict[str, float]], n: int) -> dict[str, float]:
    """The ratios the team's targets are stated in (pairs with a missing side are left out)."""

    def get(name: str, key: str) -> float | None:
        return summary.get(name, {}).get(key)

    tok, slope = f"ms_per_token@{n}", f"slope_ms_per_token@{n}"
    pairs = {
        f"ours int8 / ct2 int8 per token @{n} (decode/N vs ct2 slope)": (
            get("ours int8 cache", tok),
            get("ct2 int8", tok),
        ),
        f"ours int8 / ct2 int8 per token @{n} (slope vs ct2 slope)": (
            get("ours int8 cache", slope),
            get("ct2 int8", slope),
        ),
        f"ours int8 merged+spin / ct2 int8 per token @{n} (decode/N vs ct2 slope)": (
            get("ours int8 cache merged+spin", tok),
            get("ct2 int8", tok),
        ),
        f"ours fp32 / ct2 fp32 per token @{n} (decode/N vs ct2 slope)": (
            get("ours fp32 cache", tok),
            get("ct2 fp32", tok),
        ),
        f"no-cache / cache, int8, per token @{n}": (
            get("ours int8 no-cache", tok),
            get("ours int8 cache", tok),
        ),
        f"no-cache / cache, fp32, per token @{n}": (
            get("ours fp32 no-cache", tok),
            get("ours fp32 cache", tok),
        ),
        f"ours int8 / fp32 per token @{n}": (
            get("ours int8 cache", tok),
            get("ours fp32 cache", tok),
        ),
        "ours int8 / fp32 encoder": (
            get("ours int8 cache", "encoder_ms"),
            get("ours fp32 cache", "encoder_ms"),
        ),
        f"ct2 int8 / fp32 per token @{n}": (get("ct2 int8", tok), get("ct2 fp32", tok)),
    }
    return {k: a / b for k, (a, b) in pairs.items() if a is not None and b}


def check_targets(rat: dict[str, float], n: int) -> dict[str, dict[str, Any]]:
    """Pass/fail of the team's targets (the CT2 one under both per-token methods)."""
    result: dict[str, dict[str, Any]] = {}
    limit = TARGETS["int8_vs_ct2_int8_max"]
    for key in (
        f"ours int8 / ct2 int8 per token @{n} (decode/N vs ct2 slope)",
        f"ours int8 / ct2 int8 per token @{n} (slope vs ct2 slope)",
    ):
        if key in rat:
            result[key] = {"value": rat[key], "target": f"<= {limit}", "met": rat[key] <= limit}
    low = TARGETS["cache_speedup_min"]
    for key in (f"no-cache / cache, int8, per token @{n}",):
        if key in rat:
            result[key] = {"value": rat[key], "target": f">= {low}", "met": rat[key] >= low}
    return result


def print_table(summary: dict[str, dict[str, float]], lengths: list[int]) -> None:
    shown = [n for n in lengths if n > 1]
    longest = max(lengths)
    columns = [("encoder ms", "encoder_ms")]
    columns += [(f"ms/tok @{n}", f"ms_per_token@{n}") for n in shown]
    columns += [
        (f"slope @{longest}", f"slope_ms_per_token@{longest}"),
        (f"cpu/tok @{longest}", f"cpu_ms_per_token@{longest}"),
    ]
    head = f"{'variant':<22}" + "".join(f"{title:>13}" for title, _ in columns)
    head += f"{'first ms':>10}"
    print(head)
    print("-" * len(head))
    for name, row in summary.items():
        cells = "".join(f"{row[key]:>13.2f}" if key in row else f"{'-':>13}" for _, key in columns)
        first = row.get("first_ms", row.get("decode_ms@1"))
        print(f"{name:<22}{cells}" + (f"{first:>10.2f}" if first is not None else f"{'-':>10}"))
    print(
        "ct2 ms/tok is its slope (T(N) - T(1)) / (N - 1); first ms: ours = decode(1), the"
        " first decoder call; ct2 = T(1), encoder + first step"
    )


def summarize_rows(workers: list[Worker], n: int, rows: list[int]) -> dict[str, dict[str, float]]:
    """ms per row-token with B rows decoded at once: ours decode(N, B) / (N * B); ct2 its
    slope (T(N, B) - T(1, B)) / ((N - 1) * B), which cancels its encoder and first step."""
    out: dict[str, dict[str, float]] = {}
    for w in workers:
        row: dict[str, float] = {}
        for b in rows:
            tag = f"@{n}" if b == 1 else f"@{n}x{b}"
            first = "@1" if b == 1 else f"@1x{b}"
            if w.engine == "ours" and f"decode{tag}" in w.samples:
                row[f"B={b}"] = _median_ms(w.samples[f"decode{tag}"]) / (n * b)
            elif w.engine == "ct2" and f"total{tag}" in w.samples and f"total{first}" in w.samples:
                slope = _median_ms(w.samples[f"total{tag}"]) - _median_ms(
                    w.samples[f"total{first}"]
                )
                row[f"B={b}"] = slope / ((n - 1) * b)
        if row:
            out[w.name] = row
    return out


def print_rows(batched: dict[str, dict[str, float]], n: int) -> None:
    keys = sorted({k for row in batched.values() for k in row}, key=lambda k: int(k[2:]))
    print(
        f"\nms per row-token, B rows decoded at once (N={n}); ours: one Translator.decode of B"
        " sources (the scheduler runs them as one batch); ct2: translate_batch of B"
    )
    print(f"{'variant':<22}" + "".join(f"{k:>10}" for k in keys))
    for name, row in batched.items():
        print(
            f"{name:<22}" + "".join(f"{row[k]:>10.2f}" if k in row else f"{'-':>10}" for k in keys)
        )
    ours, ct2 = batched.get("ours int8 cache"), batched.get("ct2 int8")
    if ours and ct2:
        print(
            "ours int8 / ct2 int8: "
            + ", ".join(f"{k} {ours[k] / ct2[k]:.2f}" for k in keys if k in ours and k in ct2)
        )


def _load_source(path: Path, line: int) -> str:
    if not path.is_file():
        sys.exit(
            f"error: {path} not found (the FLORES-200 devtest is read from ../shared: "
            "docs/repository.md)"
        )
    lines = path.read_text(encoding="utf-8").splitlines()
    if not 0 <= line < len(lines):
        sys.exit(f"error: --line {line} outside 0..{len(lines) - 1}")
    return lines[line].strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        type=Path,
        default=DEFAULT_MODEL,
        help="benchmark model (build_benchmark_model.py --out)",
    )
    parser.add_argument("--source-file", type=Path, default=DEFAULT_SOURCE)
    parser.add_argument(
        "--line",
        type=int,
        default=DEFAULT_LINE,
        help="0-based line of the source file (default: a median-length one)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="cores: CTranslate2's intra-op threads; ours: what the scheduler gives each "
        "call on that many cores (inter-op: 1)",
    )
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[20, 60],
        help="forced output lengths (N=1 is added for the slope)",
    )
    parser.add_argument("--reps", type=int, default=15, help="measured rounds")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured rounds first")
    parser.add_argument(
        "--no-cache-reps",
        type=int,
        default=None,
        help="measured rounds that include the slow no-cache variants (default: all)",
    )
    parser.add_argument(
        "--tuned", action="store_true", help=f"also run {', '.join(repr(v) for v in TUNED)}"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=sorted({**VARIANTS, **TUNED, **GLOSSARY}),
        default=None,
        metavar="VARIANT",
        help=f"variants to run (default: all of {', '.join(repr(v) for v in VARIANTS)})",
    )
    parser.add_argument(
        "--glossary",
        action="store_true",
        help=f"also run {', '.join(repr(v) for v in GLOSSARY)} "
        f"({GLOSSARY_ENTRIES}-entry glossaries)",
    )
    parser.add_argument(
        "--hugepages", action="store_true", help=f"run workers with GLIBC_TUNABLES={HUGEPAGES_ENV}"
    )
    parser.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=[1],
        help="also decode B copies of the source at once (one batched call; CTranslate2: "
        "translate_batch of B), at the longest length, e.g. --rows 1 4 16",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))

    model: Path = args.model
    needed = [
        model / "onnx" / "decoder_model_merged_quantized.onnx",
        model / "ct2-int8" / "model.bin",
        model / "ct2-float32" / "model.bin",
    ]
    if missing := [str(p) for p in needed if not p.is_file()]:
        sys.exit(
            f"error: benchmark model incomplete ({', '.join(missing)} missing); "
            "run python models/build_benchmark_model.py first"
        )
    source = _load_source(args.source_file, args.line)
    lengths = sorted({1, *args.lengths})
    longest = max(lengths)
    specs = {**VARIANTS, **TUNED, **GLOSSARY}
    names = args.only or list(VARIANTS) + (list(TUNED) if args.tuned else [])
    if args.glossary and not args.only:
        names += list(GLOSSARY)

    sys.path.insert(0, str(REPO_ROOT))
    import ctranslate2
    import onnxruntime

    from engine.model.tokenizer import MarianTokenizer

    n_source = len(MarianTokenizer.from_dir(model / "onnx").encode_source(source))
    print(f"source line {args.line} ({n_source} tokens with eos): {source}")
    print(
        f"threads={args.threads} lengths={lengths} warmup={args.warmup} reps={args.reps} "
        f"hugepages={args.hugepages} tuned={args.tuned}"
    )
    common = {"model": str(model), "source": source, "threads": args.threads}
    workers = [start_worker(n, {**specs[n], **common}, args.hugepages) for n in names]
    load_before = os.getloadavg()
    print(f"load average {load_before[0]:.2f} (cores: {os.cpu_count()})", flush=True)

    no_cache_reps = args.reps if args.no_cache_reps is None else args.no_cache_reps
    rng = random.Random(0)
    try:
        for rnd in range(args.warmup + args.reps):
            measured = rnd >= args.warmup
            skip_slow = rnd - args.warmup >= no_cache_reps
            runs = [f"run {n}" for n in lengths]
            for b in sorted(set(args.rows) - {1}):
                runs += [f"run {longest} {b}", f"run 1 {b}"]
            todo = [
                (w, job)
                for w in workers
                for job in ([*runs, "encode"] if w.engine == "ours" else runs)
                if not (skip_slow and "no-cache" in w.name)
            ]
            rng.shuffle(todo)
            for w, job in todo:
                reply = w.ask(job)
                if measured and reply:
                    parts = job.split()
                    suffix = f"@{parts[1]}" if job.startswith("run") else ""
                    suffix += f"x{parts[2]}" if len(parts) > 2 else ""
                    for key, value in reply.items():
                        w.record(key if key == "encoder" else key + suffix, value)
            print(f"  round {rnd + 1}/{args.warmup + args.reps}", file=sys.stderr, flush=True)
    finally:
        for w in workers:
            if w.proc.poll() is None and w.proc.stdin is not None:
                w.proc.stdin.close()  # the worker exits at end of input
                w.proc.wait(timeout=60)
    load_after = os.getloadavg()

    summary = summarize(workers, lengths)
    rat = ratios(summary, longest)
    targets = check_targets(rat, longest)
    print()
    print_table(summary, lengths)
    print("\nratios of medians:")
    for key, value in rat.items():
        print(f"  {key:<62}{value:7.3f}")
    print("targets:")
    for key, t in targets.items():
        verdict = "met" if t["met"] else "NOT met"
        print(f"  {key:<62}{t['value']:7.3f}  (target {t['target']}: {verdict})")
    batched = summarize_rows(workers, longest, sorted(set(args.rows)))
    if len(batched) > 0 and set(args.rows) != {1}:
        print_rows(batched, longest)
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    report = {
        "meta": {
            "source_line": args.line,
            "source_tokens": n_source,
            "threads": args.threads,
            "lengths": lengths,
            "warmup": args.warmup,
            "reps": args.reps,
            "no_cache_reps": no_cache_reps,
            "hugepages": args.hugepages,
            "variants": names,
            "load_avg_before": load_before,
            "load_avg_after": load_after,
            "cpu_count": os.cpu_count(),
            "onnxruntime": onnxruntime.__version__,
            "ctranslate2": ctranslate2.__version__,
            "python": platform.python_version(),
            "method": __doc__,
        },
        "results": summary,
        "rows": batched,
        "ratios": rat,
        "targets": targets,
    }
    print(json.dumps(report, indent=1))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
