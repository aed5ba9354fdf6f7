"""How many real-time streams one machine holds: N concurrent talkers, in process.

Each of N streams replays its own 5 FLORES zh sentences as a synthetic recogniser would
emit them (`generate_log`: 1-3 characters per partial, about 3 partials a second, occasional
corrections), starting at a random offset within the first second, all through one
`IncrementalTranslator` in real time (`replay --realtime`). The benchmark model has random
weights, so output lengths are forced (`forced_length_ratio`, 1.02 x source tokens: the
length a real zh->en model writes).

Per N it prints: update latency (partial pushed -> its update, as the engine measured it)
p50 / p95 / max; the share of non-final partials answered (the rest were superseded by a
newer partial of their stream before or during their decode); decoder rows per step
(p50 / p95 / max) and steps; CPU use (process CPU time / wall time / cores) while the
streams are live (`cpu`: first event to last update) and while all N talk at once
(`full`: the last stream's start to the first stream's end); RSS growth per stream; the
most decoder state the lanes held live at once (`state`, MiB: the running rows' keys and
values, `nmt_decoder_state_bytes`); draft
and lookahead tokens confirmed / offered; partials sent and answered per second while all N
talk (`sent/s ans/s`; sent counts the ~7% whose source did not change, which need no
update; past the knee ans/s stops growing with N: it is what the machine can answer).
Then the largest N with p95 <= 300 ms and >= 80% of partials answered.

Steps and CPU leave out what runs after the last update: the replay's check of every final
against offline `translate`, one final at a time on one core, which is not load and would
read as idle cores and one-row steps.

    HF_HUB_OFFLINE=1 python models/build_benchmark_model.py     # once
    python examples/benchmarks/capacity.py --streams 1,8,16,24,32,48
    python examples/benchmarks/capacity.py --batching lockstep   # the fallback, compared

Run it on a quiet machine: it measures latency against the wall clock.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's engine, not an installed one
DEFAULT_MODEL = ROOT / ".cache" / "benchmark-model" / "onnx"
FLORES_ZH = ROOT.parent / "shared" / "flores200-devtest" / "zho_Hans.devtest"
SOURCES = [FLORES_ZH]  # the sentences the streams say (`--sources`)
P95_MAX_MS = 300.0
ANSWERED_MIN = 0.80


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Sampler:
    """Every 20 ms in a thread: RSS (for the peak), the process CPU time and the
    scheduler's steps by rows so far, so that CPU use and rows per step can be read over
    any window of the run (`at`), not only over the whole of it."""

    def __init__(self, scheduler: Any = None) -> None:
        self.peak = rss_mib()
        self.state_peak = 0.0  # MiB of decoder state the lanes held live, at most
        self._scheduler = scheduler
        self.samples: list[tuple[float, float, Counter[int]]] = []
        self._sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        sizes: Counter[int] = Counter(getattr(self._scheduler, "batch_sizes", Counter()))
        self.samples.append((time.perf_counter(), time.process_time(), sizes))

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_mib())
            state = getattr(self._scheduler, "state_bytes", None)
            if state is not None:
                self.state_peak = max(self.state_peak, state.live / 2**20)
            self._sample()

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.peak

    def at(self, wall: float) -> tuple[float, float, Counter[int]]:
        """The last sample taken at or before `wall` (the first one if none was)."""
        chosen = self.samples[0]
        for sample in self.samples:
            if sample[0] > wall:
                break
            chosen = sample
        return chosen

    def cpu_use(self, start: float, end: float) -> float:
        """Share of the machine's cores the process used between two wall times."""
        (w0, c0, _), (w1, c1, _) = self.at(start), self.at(end)
        return (c1 - c0) / max(w1 - w0, 1e-9) / (os.cpu_count() or 1)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def make_lines(n: int, sentences: int, seed: int, first: int = 0) -> list[dict[str, Any]]:
    """The interleaved logs of streams `first` .. `first + n - 1` (a process of several
    says its own share of the streams: `--processes`)."""
    from engine.logs.make import generate_log
    from engine.logs.merge import interleave_logs

    pool = [line.strip() for line in SOURCES[0].read_text(encoding="utf-8").splitlines()]
    rng = random.Random(seed + first)
    logs = []
    for i in range(first, first + n):
        start = (i * sentences) % (len(pool) - sentences)
        logs.append(
            generate_log(
                pool[start : start + sentences],
                "zh",
                stream_id=f"s{i}",
                seed=seed + i,
                start_ms=rng.uniform(0.0, 1000.0),
            )
        )
    return interleave_logs(*logs)


def run_one(
    translator: Any, n: int, args: argparse.Namespace, first: int = 0, raw: bool = False
) -> dict[str, Any]:
    """One run of streams `first` .. `first + n - 1`: its figures (`merge`), or with
    `raw` the samples they come from, for `merge` to pool with other processes'
    (`--processes`)."""
    from engine.replay import ReplayOptions, replay
    from engine.streaming.session import StreamingOptions

    lines = make_lines(n, args.sentences, args.seed, first)
    if args.glossary is not None:
        translator.glossary = synthetic_glossary(lines, args.glossary)
    partials = sum(1 for line in lines if not line["is_final"])
    scheduler = getattr(translator, "scheduler", None)
    sizes_before: Counter[int] = Counter(getattr(scheduler, "batch_sizes", Counter()))
    options = ReplayOptions(
        streaming=StreamingOptions(forced_length_ratio=args.ratio, drafts=not args.no_drafts),
        realtime=True,
        progress=False,
        max_streams=max(256, n),
        decode_slots=max(64, n) if args.device != "cpu" else None,
        check_finals=not args.no_final_check,
    )
    timeline = None
    if args.timeline is not None and scheduler is not None:
        from engine.decoding.timeline import Timeline

        timeline = scheduler.timeline = Timeline()
    rss0 = rss_mib()
    sampler = Sampler(scheduler)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    # Wall times of the updates, and the replay's clock (log ms -> wall) from the first.
    clock: dict[str, float] = {}
    partial_walls: list[float] = []  # when each partial's update came

    def on_update(timed: Any) -> None:
        now = time.perf_counter()
        clock.setdefault("t0", now - timed.done_ms / 1000.0)
        clock["last"] = now
        if not timed.update.is_final:
            partial_walls.append(now)

    result = replay(translator, lines, options, on_update=on_update)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    rss_peak = sampler.stop()
    # Windows: live (replay start -> last update; the replay's check of every final against
    # offline `translate` runs after it, one final at a time, and is not load) and full
    # load (every stream talking: the last first line -> the first last line).
    t0 = clock.get("t0", wall0)
    firsts: dict[str, float] = {}
    lasts: dict[str, float] = {}
    for line in lines:
        emit = float(line["emit_ms"]) / 1000.0
        firsts.setdefault(line["stream_id"], emit)
        lasts[line["stream_id"]] = emit
    emit0 = min(firsts.values(), default=0.0)
    full = (t0 + max(firsts.values()) - emit0, t0 + min(lasts.values()) - emit0)
    live_end = clock.get("last", wall0 + wall)
    # Throughput while all N talk: partials sent and partials answered per second. Past
    # the knee the second stops growing with N: it is what the machine can answer.
    full_s = max(0.0, full[1] - full[0])
    sent_full = sum(
        1
        for line in lines
        if not line["is_final"]
        and full[0] <= t0 + float(line["emit_ms"]) / 1000.0 - emit0 <= full[1]
    )
    answered_full = sum(1 for w in partial_walls if full[0] <= w <= full[1])
    latencies = [t.update.latency_ms for t in result.updates]
    # Before a worker took the event (its stream's earlier event, the worker limiter) and
    # in it (encoder and decoder trips through the scheduler, the session's Python).
    queued = [t.update.latency_ms - t.update.compute_ms for t in result.updates]
    computing = [t.update.compute_ms for t in result.updates]
    partial_updates = sum(1 for t in result.updates if not t.update.is_final)
    counts = result.counts
    sizes: list[float] = []
    if scheduler is not None:  # decoder calls of the live window
        delta = sampler.at(live_end)[2] - sizes_before
        sizes = [float(k) for k, v in delta.items() for _ in range(v)]
    finals = sum(1 for line in lines if line["is_final"])
    final_updates = sum(1 for t in result.updates if t.update.is_final)
    if timeline is not None and scheduler is not None:
        from engine.decoding.timeline import format_summary, summary

        scheduler.timeline = None
        steps, requests = timeline.steps(), timeline.answered()
        print(format_summary(summary(steps, requests)), flush=True)
        stem = f"{args.timeline}.{n}" + (f".from{first}" if raw else "")  # a process's own
        with Path(f"{stem}.jsonl").open("w") as f:
            for step in steps:
                f.write(json.dumps(step.to_dict()) + "\n")
        with Path(f"{stem}.requests.jsonl").open("w") as f:
            for request in requests:
                f.write(json.dumps(request.to_dict()) + "\n")
    samples = {
        "latencies": latencies,
        "queued": queued,
        "computing": computing,
        "sizes": sizes,
        "partial_updates": partial_updates,
        "partials_changed": partials - counts.get("unchanged", 0),
        "final_updates": final_updates,
        "finals": finals,
        "counts": dict(counts),
        "rss_growth_mib": max(0.0, rss_peak - rss0),
        "state_peak_mib": sampler.state_peak,
    }
    part = {
        "raw": samples,
        "streams": n,
        "partials": partials,
        "cpu_use": sampler.cpu_use(wall0, live_end),
        "cpu_full_load": sampler.cpu_use(*full) if full[1] > full[0] else float("nan"),
        "full_load_s": full_s,
        "sent_per_s_full": sent_full / full_s if full_s else float("nan"),
        "answered_per_s_full": answered_full / full_s if full_s else float("nan"),
        "cpu_whole_run": cpu / wall / (os.cpu_count() or 1),
        "wall_s": wall,
    }
    return part if raw else merge([part])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--streams", default="1,4,8,16,24,32,40,48", help="N values")
    parser.add_argument("--sentences", type=int, default=5, help="sentences per stream")
    parser.add_argument("--ratio", type=float, default=1.02, help="forced length ratio")
    parser.add_argument("--fp32", action="store_true", help="fp32 (default: int8)")
    parser.add_argument(
        "--int8-per-call",
        action="store_true",
        help="int8 activations quantized per call as the files do (default: per token, "
        "rows exact; see engine/model/passes/per_token.py)",
    )
    parser.add_argument(
        "--batching",
        choices=("continuous", "lockstep"),
        default="continuous",
        help="lockstep: without the rewritten decoder (the fallback path)",
    )
    parser.add_argument("--max-rows", type=int, default=None, help="scheduler rows per step")
    parser.add_argument("--lanes", type=int, default=None, help="scheduler lanes")
    parser.add_argument(
        "--batch-delay-ms",
        type=float,
        default=None,
        help="the scheduler's batch delay (`SchedulerOptions.batch_delay_ms`; default: its own)",
    )
    parser.add_argument(
        "--threads-per-lane",
        type=int,
        default=None,
        help="ONNX Runtime threads of each lane's calls (default: the scheduler's)",
    )
    parser.add_argument(
        "--head-threads",
        type=int,
        default=None,
        help="threads of a step's output projection (default: all cores; 1: the whole step "
        "on its lane's thread)",
    )
    parser.add_argument(
        "--prefill-positions",
        type=int,
        default=None,
        help="decoder positions one prefill call takes per turn (default: the scheduler's)",
    )
    parser.add_argument(
        "--kv-slots",
        type=int,
        default=None,
        help="KV slots (default: the scheduler's; 0: the state copied at every step)",
    )
    parser.add_argument("--no-drafts", action="store_true", help="no draft verification")
    parser.add_argument(
        "--no-inplace-attention",
        action="store_true",
        help="self-attention keys and values copied at every step (default: extended in "
        "place, engine/model/kv/inplace/rows.py)",
    )
    parser.add_argument(
        "--lookahead-positions",
        type=int,
        default=None,
        help="extra positions a step may compute for re-aligned draft tokens (default: the "
        "scheduler's; 0: drafts in the prefill only)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--glossary",
        choices=["none", "one"],
        default=None,
        help=f"every stream with a {GLOSSARY_ENTRIES}-entry glossary matching nothing in "
        "its sentences (none) or one term in each (one); default: no glossary",
    )
    parser.add_argument(
        "--device", default="cpu", help="cpu, or cuda[:N] with the [gpu] extra (fp32/fp16)"
    )
    parser.add_argument("--sources", type=Path, default=FLORES_ZH, help="zh sentences, one a line")
    parser.add_argument(
        "--no-final-check",
        action="store_true",
        help="leave out the check of every final against offline translate afterwards "
        "(one final at a time: minutes for thousands of streams)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--timeline",
        metavar="PREFIX",
        help="record every scheduler lane turn and answered request "
        "(engine/decoding/timeline.py): print a summary per N and write PREFIX.N.jsonl "
        "(turns) and PREFIX.N.requests.jsonl",
    )
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="greedy steps replayed as CUDA graphs (default: on a GPU with one lane)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="engine processes sharing the machine (and its GPU), each with its own model "
        "and its share of the N streams, started together; the figures are of all of them",
    )
    return parser


GLOSSARY_ENTRIES = 1000


def synthetic_glossary(lines: list[dict[str, Any]], kind: str) -> Any:
    """A `GLOSSARY_ENTRIES`-entry zh->en glossary (`--glossary`): two-character terms that
    no final of `lines` holds ("none"), or with each final's first two CJK characters
    among them ("one": one term per sentence); every target is an English word."""
    from engine.glossary import Glossary

    finals = [line["text"] for line in lines if line["is_final"]]
    held = {text[i : i + 2] for text in finals for i in range(len(text) - 1)}
    pairs: dict[str, str] = {}
    if kind == "one":
        for text in finals:
            cjk = [ch for ch in text if "\u4e00" <= ch <= "\u9fff"]
            pairs.setdefault("".join(cjk[:2]), "glossary")
    code = 0x4E00
    while len(pairs) < GLOSSARY_ENTRIES:
        term = chr(code) + chr(code + 1)
        code += 2
        if term not in held:
            pairs.setdefault(term, "term")
    return Glossary.from_pairs("zh", "en", list(pairs.items()))


def load_translator(args: argparse.Namespace) -> Any:
    from engine import Translator

    kwargs: dict[str, Any] = {"quantized": not args.fp32}
    if args.device != "cpu":
        kwargs["device"] = args.device
    if args.int8_per_call:
        kwargs["int8_per_token"] = False
    if args.cuda_graphs is not None:
        kwargs["cuda_graphs"] = args.cuda_graphs
    try:
        from engine.decoding.scheduler import SchedulerOptions

        kwargs["batchable"] = args.batching == "continuous"
        chosen: dict[str, Any] = {
            "max_rows": args.max_rows,
            "lanes": args.lanes,
            "threads_per_lane": args.threads_per_lane,
            "head_threads": args.head_threads,
        }
        if args.lookahead_positions is not None:
            chosen["lookahead_positions"] = args.lookahead_positions
        if args.prefill_positions is not None:
            chosen["prefill_positions"] = args.prefill_positions
        if args.kv_slots is not None:
            chosen["kv_slots"] = args.kv_slots
        if args.no_inplace_attention:
            chosen["inplace_attention"] = False
        if args.batch_delay_ms is not None:
            chosen["batch_delay_ms"] = args.batch_delay_ms
        kwargs["scheduler"] = SchedulerOptions(**{k: v for k, v in chosen.items() if v is not None})
    except ImportError:  # an older engine, for before/after runs
        pass
    return Translator.from_dir(args.model, **kwargs)


def _worker(argv: list[str], n: int, first: int, ready: Any, results: Any) -> None:
    """One of `--processes`: its own model, streams `first` .. `first + n - 1`, started
    when every process has loaded its model."""
    args = build_parser().parse_args(argv)
    SOURCES[0] = args.sources
    translator = load_translator(args)
    ready.wait()
    results.put(run_one(translator, n, args, first, raw=True))


def run_processes(n: int, argv: list[str], processes: int) -> dict[str, Any]:
    """N streams shared by `processes` processes (spawned, so that none inherits another's
    device state), measured together."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    shares = [n // processes + (k < n % processes) for k in range(processes)]
    firsts = [sum(shares[:k]) for k in range(processes)]
    busy = [(share, first) for share, first in zip(shares, firsts, strict=True) if share]
    ready, results = context.Barrier(len(busy)), context.Queue()
    workers = [
        context.Process(target=_worker, args=(argv, share, first, ready, results))
        for share, first in busy
    ]
    for worker in workers:
        worker.start()
    parts = [results.get() for _ in workers]
    for worker in workers:
        worker.join()
    return merge(parts)


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one or several processes' `run_one(..., raw=True)`: latencies and
    rows per step pooled, rates, CPU shares and memory added up."""
    raw = [p["raw"] for p in parts]

    def pooled(key: str) -> list[float]:
        return [v for r in raw for v in r[key]]

    def total(key: str) -> float:
        return float(sum(p[key] for p in parts))

    latencies, sizes = pooled("latencies"), pooled("sizes")
    counts: Counter[str] = Counter()
    for r in raw:
        counts.update(r["counts"])
    n = int(total("streams"))
    return {
        "streams": n,
        "processes": len(parts),
        "partials": int(total("partials")),
        "p50_ms": percentile(latencies, 50),
        "p95_ms": percentile(latencies, 95),
        "max_ms": max(latencies, default=float("nan")),
        "queued_p95_ms": percentile(pooled("queued"), 95),
        "compute_p50_ms": percentile(pooled("computing"), 50),
        "compute_p95_ms": percentile(pooled("computing"), 95),
        "answered": sum(r["partial_updates"] for r in raw)
        / max(1, sum(r["partials_changed"] for r in raw)),
        "cancelled": counts.get("cancelled", 0),
        "superseded": counts.get("superseded", 0),
        "finals": f"{sum(r['final_updates'] for r in raw)}/{sum(r['finals'] for r in raw)}",
        "rows_p50": percentile(sizes, 50),
        "rows_p95": percentile(sizes, 95),
        "rows_max": max(sizes, default=float("nan")),
        "steps": len(sizes),
        "draft": f"{counts.get('draft_accepted', 0)}/{counts.get('draft_offered', 0)}",
        "lookahead": f"{counts.get('lookahead_accepted', 0)}/{counts.get('lookahead_offered', 0)}",
        "cpu_use": total("cpu_use"),
        "cpu_full_load": total("cpu_full_load"),
        "full_load_s": min(p["full_load_s"] for p in parts),
        "sent_per_s_full": total("sent_per_s_full"),
        "answered_per_s_full": total("answered_per_s_full"),
        "cpu_whole_run": total("cpu_whole_run"),
        "rss_mib_per_stream": sum(r["rss_growth_mib"] for r in raw) / max(n, 1),
        "state_peak_mib": sum(r.get("state_peak_mib", 0.0) for r in raw),
        "wall_s": max(p["wall_s"] for p in parts),
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.sources.is_file():
        print(f"needs {args.sources}", file=sys.stderr)
        return 2
    SOURCES[0] = args.sources
    if args.processes < 1:
        print("--processes must be at least 1", file=sys.stderr)
        return 2
    translator = None if args.processes > 1 else load_translator(args)
    batching = getattr(getattr(translator, "scheduler", None), "batching", "none")
    if args.processes > 1:
        batching = f"{args.processes} processes"
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((x.split(":", 1)[1].strip() for x in cpuinfo if "model name" in x), "?")
    precision = "fp32" if args.fp32 else "int8 per call" if args.int8_per_call else "int8"
    print(f"model {args.model} ({precision}), batching: {batching}")
    print(f"CPU: {cpu}, {os.cpu_count()} cores; {args.sentences} sentences per stream")
    header = (
        f"{'N':>3} {'p50':>6} {'p95':>6} {'max':>6} {'answered':>8} {'cancel':>6} "
        f"{'rows p50/p95/max':>16} {'steps':>6} {'cpu':>5} {'full':>5} {'MiB/str':>7} "
        f"{'state':>6} {'finals':>8} "
        f"{'draft acc/off':>13} {'lookahead acc/off':>17} {'queued p95':>10} "
        f"{'compute p50/p95':>15} {'sent/s ans/s':>12}"
    )
    print(header)
    results = []
    holds = 0
    for n in [int(x) for x in args.streams.split(",")]:
        if translator is None:
            r = run_processes(n, sys.argv[1:] if argv is None else argv, args.processes)
        else:
            r = run_one(translator, n, args)
        results.append(r)
        rows = f"{r['rows_p50']:.0f}/{r['rows_p95']:.0f}/{r['rows_max']:.0f}"
        compute = f"{r['compute_p50_ms']:.0f}/{r['compute_p95_ms']:.0f}"
        rates = f"{r['sent_per_s_full']:.0f} {r['answered_per_s_full']:.0f}"
        print(
            f"{n:>3} {r['p50_ms']:>6.0f} {r['p95_ms']:>6.0f} {r['max_ms']:>6.0f} "
            f"{r['answered']:>8.0%} {r['cancelled']:>6} {rows:>16} {r['steps']:>6} "
            f"{r['cpu_use']:>5.0%} {r['cpu_full_load']:>5.0%} {r['rss_mib_per_stream']:>7.1f} "
            f"{r['state_peak_mib']:>6.1f} {r['finals']:>8} "
            f"{r['draft']:>13} {r['lookahead']:>17} {r['queued_p95_ms']:>10.0f} "
            f"{compute:>15} {rates:>12}",
            flush=True,
        )
        if r["p95_ms"] <= P95_MAX_MS and r["answered"] >= ANSWERED_MIN:
            holds = max(holds, n)
    print(
        f"largest N with p95 <= {P95_MAX_MS:.0f} ms and >= {ANSWERED_MIN:.0%} of partials "
        f"answered: {holds}"
    )
    if args.json:
        args.json.write_text(json.dumps({"results": results, "holds": holds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
