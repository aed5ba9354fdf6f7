"""The host's work per update: server CPU per update through `serve`, and in process.

N writers, one stream each, send a partial every `--interval` seconds (0.3) that grows a
held-out sentence of the fixture word by word, and a final every 8th message; their start
is staggered over the first interval. Two ways, each on a checkout (`--root`, repeatable:
the trees are alternated run by run, the order turned round every repeat (ABBA), medians
of `--repeats`):

- `serve`: the server is `nmt-incremental serve` in a subprocess; the writers are this
  process, over WebSocket on loopback. Server CPU comes from `/proc/PID/stat` over the
  measured window (after `--warmup` seconds), divided by the updates the writers received
  in it. Also: the partials' p95 (sent -> their update received), the server's threads.
- `inproc`: one `IncrementalTranslator` in a subprocess of its own (started from the
  checkout under test) and the same events pushed on its event loop; the process's CPU
  over the window per update published.

`--load-only` (in process) runs the same load with no engine at all: a stub answers each
event at once, so the run measures what the load itself (its timers, the events made, the
reader's tally) adds to the in-process figures, which count the whole process.
`--null-decode` swaps the model's decode for one that costs nothing (`Translator.decode`
answers at once with the source's own ids as the translation: no scheduler, no ONNX), so
that what is left is the host's share alone. `--stages` adds a breakdown: each stage's
CPU per update (thread CPU, exclusive of the stages it calls: parse, connection rules,
admission, normalize, tokenize, session and policy, submit to the scheduler, the
lanes' answers reaching the loop (the inbox's drain, the self-pipe's read), detokenize,
publish and fan-out, serialize, the socket's write), the rest of the event-loop thread's
CPU (tasks, awaits, websockets framing, metrics) and the other threads' (worker threads,
decode lanes, ONNX Runtime's pool). The probes cost about a microsecond each, so the
headline figures come from runs without them. `--switches` adds, per update, each kind
of thread's context switches (voluntary: it waited on a lock, the GIL or the selector;
involuntary: preempted) and the loop's self-pipe writes (another thread waking it) and
selector polls.

    python examples/benchmarks/host_cost.py                          # serve, 120 writers
    python examples/benchmarks/host_cost.py --mode inproc --null-decode --stages
    git worktree add /tmp/before HEAD~3
    python examples/benchmarks/host_cost.py --root /tmp/before --root . --repeats 3

`--serve-args "ARGS"` (repeatable) measures each checkout once per set of extra `serve`
options, alternated with the rest (`--serve-args "" --serve-args "--batch-delay-ms 2"`:
the option off and on, in one tree); `--arm "ROOT ARGS"` (repeatable) adds one checkout
with its own options (an older checkout may lack the option). Each run also reads the
decode schedulers' counters over the window (`/metrics` through `serve`): encoder calls
and prefills per update and their rows per call. In process, `--coalesce-ms MS` runs the
engine on `engine.streaming.wakeups`' loop (as an embedder may; default: asyncio's own),
and `--serve-args "--coalesce-ms MS"` alternates settings of it.

`--profile FILE` writes a cProfile of the event loop's thread over the measured window
(thread-CPU clock: waits in the selector or for the GIL are not counted; the profiler's
own cost per call inflates small, frequent functions, so rank by it and weigh by
micro-measures). One run: give one `--root`.

The default run is short (2 s warm-up, 8 s measured) for a shared machine; the issue's
figures used `--seconds 30`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = Path(__file__).resolve().parents[2]
# This checkout's engine, not an installed one; a child measuring another checkout
# (`--root`) puts that one first instead, before it imports the engine.
sys.path.insert(0, str(ROOT))
HELDOUT = ROOT / "models" / "fixture" / "heldout.tsv"
MODEL = ROOT / "models" / "fixture" / "model"
FINAL_EVERY = 8
CLOCK_TICK = os.sysconf("SC_CLK_TCK")


# -- the load ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    at: float  # seconds from the run's start
    stream_id: str
    segment_id: int
    seq: int
    text: str
    is_final: bool
    changed: bool = True  # a partial whose text differs from its segment's last one


def schedule(writers: int, seconds: float, interval: float, seed: int = 0) -> list[list[Send]]:
    """Each writer's messages: a partial every `interval`, growing a sentence word by word
    over seven partials, then its final; writers start at random within one interval."""
    sentences = [
        row.split("\t")[0].strip()
        for row in HELDOUT.read_text(encoding="utf-8").splitlines()
        if row.strip()
    ]
    rng = random.Random(seed)
    plans = []
    for w in range(writers):
        start = rng.uniform(0.0, interval)
        sends: list[Send] = []
        seq = 0
        while start + seq * interval < seconds:
            segment, k = divmod(seq, FINAL_EVERY)
            words = sentences[(w * 7 + segment) % len(sentences)].split()
            final = k == FINAL_EVERY - 1
            shown = len(words) if final else max(1, round((k + 1) * len(words) / FINAL_EVERY))
            text = " ".join(words[:shown])
            changed = k == 0 or text != sends[-1].text
            at = start + seq * interval
            sends.append(Send(at, f"w{w}", segment, seq, text, final, changed))
            seq += 1
        plans.append(sends)
    return plans


@dataclass
class Tally:
    """What the writers saw: updates by arrival time, partial latencies, finals."""

    window: tuple[float, float]
    updates: int = 0
    partial_ms: list[float] = field(default_factory=list)
    finals_sent: int = 0
    partials_changed: int = 0  # partials sent whose text changed (each owes an update)
    partial_updates: int = 0  # updates of partials received, the whole run
    final_replies: dict[tuple[str, int], int] = field(default_factory=lambda: defaultdict(int))
    errors: int = 0

    def seen(self, now: float, stream_id: str, seq: int, final: bool, sent: float | None) -> None:
        if self.window[0] <= now <= self.window[1]:
            self.updates += 1
            if not final and sent is not None:
                self.partial_ms.append((now - sent) * 1000.0)
        if final:
            self.final_replies[(stream_id, seq)] += 1
        else:
            self.partial_updates += 1

    def sending(self, send: Send) -> None:
        self.finals_sent += send.is_final
        self.partials_changed += not send.is_final and send.changed


def percentile(values: list[float], q: float) -> float:
    from capacity import percentile as pick

    return pick(values, q)


# -- probes: CPU per stage ---------------------------------------------------------------

PROBES: list[tuple[str, str, str]] = [
    # (stage, module, attribute path); missing ones (another checkout) are skipped
    ("parse", "protocol.codec", "parse"),
    ("connection rules", "engine.server.connection", "ConnectionCore.receive"),
    ("admission", "engine.streaming.lifecycle", "StreamTable.admit"),
    ("admission", "engine.streaming.lifecycle", "StreamTable.accept"),
    ("admission", "engine.streaming.lifecycle", "StreamTable.open"),
    ("normalize", "engine.streaming.session", "StreamingOptions.clean"),
    ("tokenize", "engine.decoding.translator", "Translator.source_ids"),
    ("session and policy", "engine.streaming.session", "StreamSession.answer"),
    ("session and policy", "engine.streaming.session", "StreamSession.steps"),
    ("submit and wait", "engine.decoding.translator", "Translator.decode"),
    ("submit and wait", "engine.decoding.translator", "Translator.submit"),
    ("answers reaching the loop", "engine.streaming.awaiting", "_Inbox._drain"),
    ("answers reaching the loop", "engine.streaming.awaiting", "_Inbox._read"),
    (
        "answers reaching the loop",
        "asyncio.selector_events",
        "BaseSelectorEventLoop._read_from_self",
    ),
    ("submit and wait", "engine.decoding.translator", "Translator.encoding"),
    ("detokenize", "engine.decoding.translator", "Translator.detokenize"),
    ("publish and fan-out", "engine.streaming.bus", "InProcessBus.publish"),
    ("serialize", "protocol.codec", "serialize"),
    ("socket write", "asyncio.selector_events", "_SelectorSocketTransport.write"),
    (
        "model calls (ONNX Runtime)",
        "onnxruntime.capi.onnxruntime_inference_collection",
        "Session.run",
    ),
    (
        "model calls (ONNX Runtime)",
        "onnxruntime.capi.onnxruntime_inference_collection",
        "Session.run_with_iobinding",
    ),
]


class Probes:
    """Thread CPU per stage, exclusive of nested probes (a stack per thread)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)  # stage -> seconds
        self.by_thread: dict[int, float] = defaultdict(float)  # native id -> probed seconds
        self._local = threading.local()

    def wrap(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.thread_time
        local = self._local
        totals, by_thread = self.totals, self.by_thread

        def enter() -> tuple[list[float], float]:
            stack = getattr(local, "stack", None)
            if stack is None:
                stack = local.stack = [0.0]
            stack.append(0.0)  # time spent in nested probes
            return stack, clock()

        def leave(stack: list[float], start: float) -> None:
            spent = clock() - start
            nested = stack.pop()
            totals[stage] += spent - nested
            stack[-1] += spent
            if len(stack) == 1:
                by_thread[threading.get_native_id()] += spent
                stack[0] = 0.0

        def resumed(gen: Generator[Any, Any, Any]) -> Generator[Any, Any, Any]:
            """A generator (a session's steps) timed at each resumption."""
            value: Any = None
            thrown: BaseException | None = None
            while True:
                stack, start = enter()
                try:
                    item = gen.throw(thrown) if thrown is not None else gen.send(value)
                except StopIteration as done:
                    return done.value
                finally:
                    leave(stack, start)
                try:
                    value, thrown = (yield item), None
                except BaseException as exc:  # passed on into the generator
                    value, thrown = None, exc

        def probed(*args: Any, **kwargs: Any) -> Any:
            stack, start = enter()
            try:
                out = fn(*args, **kwargs)
            finally:
                leave(stack, start)
            return resumed(out) if inspect.isgenerator(out) else out

        probed.__wrapped__ = fn  # type: ignore[attr-defined]
        return probed

    def install(self) -> list[str]:
        """Wrap every probe that exists in the checkout imported; returns those missing."""
        import importlib

        missing = []
        for stage, module_name, path in PROBES:
            try:
                owner: Any = importlib.import_module(module_name)
                *parents, name = path.split(".")
                for part in parents:
                    owner = getattr(owner, part)
                fn = getattr(owner, name)
            except (ImportError, AttributeError):
                missing.append(f"{module_name}.{path}")
                continue
            setattr(owner, name, self.wrap(stage, fn))
            if module_name == "protocol.codec":  # also the package's re-export
                import protocol

                setattr(protocol, name, getattr(owner, name))
        return missing


def thread_kind(tid: int, names: dict[int, str]) -> str:
    """What a thread of this process is: the event loop (main thread), worker threads,
    decode lanes, another Python thread by name, or a native one (ONNX Runtime's pool)."""
    name = names.get(tid)
    if tid == os.getpid():
        return "event loop thread"
    if name is None:
        return "native threads (ONNX Runtime)"
    if name.startswith("decode-lane"):
        return "decode lanes"
    if "worker" in name.lower():
        return "worker threads"
    return f"thread {name}"


def thread_cpu(probes: Probes | None) -> tuple[dict[str, float], dict[str, float]]:
    """CPU seconds of this process's threads by kind (`thread_kind`), and of those the
    seconds the probes took."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    cpu: dict[str, float] = defaultdict(float)
    probed: dict[str, float] = defaultdict(float)
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        cpu[thread_kind(int(task.name), names)] += (int(fields[11]) + int(fields[12])) / CLOCK_TICK
    if probes is not None:
        for tid, seconds in list(probes.by_thread.items()):
            probed[thread_kind(tid, names)] += seconds
    return dict(cpu), dict(probed)


def null_decode() -> None:
    """`Translator.decode` (and `submit`, where the checkout has it) answers at once: each
    source's ids (eos dropped) after its prefix, as if the model echoed the source;
    nothing reaches the scheduler."""
    from concurrent.futures import Future

    from engine.decoding import translator as module
    from engine.decoding.search import Hypothesis

    def decode(self: Any, enc: Any, options: Any = None, **kwargs: Any) -> list[Any]:
        prefixes = kwargs.get("prefixes") or [()] * enc.input_ids.shape[0]
        eos, pad = self.config.eos_token_id, self.config.pad_token_id
        out = []
        for row, prefix in zip(enc.input_ids.tolist(), prefixes, strict=True):
            source = [t for t in row if t not in (eos, pad)]
            out.append(Hypothesis(tuple(prefix) + tuple(source[len(prefix) :]), 0.0, True))
        return out

    def submit(self: Any, enc: Any, options: Any = None, **kwargs: Any) -> list[Any]:
        futures = []
        for hypothesis in decode(self, enc, options, **kwargs):
            future: Future[Any] = Future()
            future.set_result(hypothesis)
            futures.append(future)
        return futures

    module.Translator.decode = decode  # type: ignore[method-assign]
    if hasattr(module.Translator, "submit"):
        module.Translator.submit = submit  # type: ignore[method-assign]


def thread_switches() -> dict[str, float]:
    """Context switches of this process's threads by kind (`thread_kind`), voluntary (the
    thread waited: a lock, the GIL, epoll) and involuntary (preempted), from
    /proc/self/task/*/status."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[str, float] = defaultdict(float)
    for task in Path("/proc/self/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:
            continue
        kind = thread_kind(int(task.name), names)
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                out[f"{kind}, voluntary"] += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches:"):
                out[f"{kind}, involuntary"] += int(line.split()[1])
    return dict(out)


WAKES: dict[str, int] = defaultdict(int)


def count_wakes() -> None:
    """Count the event loop's self-pipe writes (a thread waking the loop:
    `call_soon_threadsafe`), the eventfd writes (a lane waking it through
    `engine.streaming.awaiting`'s inbox) and its selector's polls (`epoll_wait`), for
    `--switches`."""
    import asyncio.selector_events as events
    import selectors

    loop_class: Any = events.BaseSelectorEventLoop  # its self-pipe write is asyncio's own
    write = loop_class._write_to_self
    select = selectors.EpollSelector.select

    def write_to_self(self: Any) -> None:
        WAKES["self-pipe writes"] += 1
        write(self)

    def polled(self: Any, timeout: float | None = None) -> Any:
        WAKES["selector polls"] += 1
        return select(self, timeout)

    loop_class._write_to_self = write_to_self
    selectors.EpollSelector.select = polled  # type: ignore[method-assign]
    eventfd_write = getattr(os, "eventfd_write", None)
    if eventfd_write is not None:  # a lane waking the loop through the inbox's eventfd

        def counted(fd: int, value: int) -> None:
            WAKES["eventfd writes"] += 1
            eventfd_write(fd, value)

        os.eventfd_write = counted


def snapshot(probes: Probes | None) -> dict[str, Any]:
    threads, probed = thread_cpu(probes)
    return {
        "threads": threads,
        "probed": probed,
        "probes": dict(probes.totals) if probes else {},
        "os_threads": len(os.listdir("/proc/self/task")),
        "switches": {**thread_switches(), **WAKES},
    }


# -- child processes: the server and the in-process engine --------------------------------


class LoopProfile:
    """cProfile of the thread that calls `toggle` (the event loop's: the in-process marks
    run on it, and `serve`'s SIGUSR1 handler runs on the main thread, which runs its loop),
    on a thread-CPU clock so that time waiting in the selector or for the GIL is not
    counted; the first toggle starts it, the second stops it and writes the stats."""

    def __init__(self, path: Path) -> None:
        import cProfile

        self.path = path
        self.profile = cProfile.Profile(time.thread_time)
        self.running = False

    def toggle(self) -> None:
        if not self.running:
            self.running = True
            self.profile.enable()
        else:
            self.profile.disable()
            self.running = False
            self.profile.dump_stats(str(self.path))


def child_serve(args: argparse.Namespace, rest: list[str]) -> int:
    """`serve` with the probes (and the null decode) installed; SIGUSR1 writes a snapshot
    of the per-stage and per-thread CPU to `--dump` (appending one JSON line)."""
    probes = Probes() if args.stages else None
    if probes is not None:
        probes.install()
    if args.null_decode:
        null_decode()

    def dump(*_: Any) -> None:
        with open(args.dump, "a") as f:
            f.write(json.dumps(snapshot(probes)) + "\n")

    if args.switches:
        count_wakes()
    profile = LoopProfile(args.profile) if args.profile else None

    def dumped(*_: Any) -> None:
        dump()
        if profile is not None:
            profile.toggle()

    signal.signal(signal.SIGUSR1, dumped)
    from engine.cli.serve import main

    return int(main(rest) or 0)


class LoadOnly:
    """`--load-only`: in place of the engine, one update made and handed to the reader at
    each event pushed, through an anyio memory stream; what the in-process load itself (its
    sends' timers, the events made, the reader's tally) costs the process."""

    def __init__(self) -> None:
        import anyio

        self._send, self._receive = anyio.create_memory_object_stream[Any](1 << 16)
        self._last: dict[str, str] = {}  # each stream's last text: an unchanged partial gets none

    async def __aenter__(self) -> LoadOnly:
        return self

    async def __aexit__(self, *_: object) -> None:
        self._send.close()

    def updates(self) -> LoadOnly:
        return self

    def __aiter__(self) -> Any:
        return self._receive

    def end(self) -> None:
        self._send.close()

    async def push(self, event: Any) -> None:
        from protocol import TranslationUpdate

        last, self._last[event.stream_id] = self._last.get(event.stream_id), event.text
        if not event.is_final and event.text == last:
            return
        update = TranslationUpdate(
            event.stream_id, event.segment_id, event.seq, event.text, "", event.is_final, 0.0, 0.0
        )
        self._send.send_nowait(update)

    async def wait_idle(self) -> None:
        return None


def child_inproc(args: argparse.Namespace) -> int:
    """The engine in this process, the load pushed on its loop; prints one JSON line."""
    probes = Probes() if args.stages else None
    if probes is not None:
        probes.install()
    if args.null_decode:
        null_decode()
    if args.switches:
        count_wakes()
    profile = LoopProfile(args.profile) if args.profile else None
    import anyio

    from engine.streaming.controller import IncrementalTranslator
    from protocol import PartialTranscript, TranslationUpdate

    plans = schedule(args.writers, args.warmup + args.seconds, args.interval, args.seed)
    sends = sorted((s for plan in plans for s in plan), key=lambda s: s.at)
    tally = Tally((args.warmup, args.warmup + args.seconds))
    marks: dict[str, Any] = {}

    async def run() -> None:
        from engine.decoding.targets import Targets

        nmt: Any
        if args.load_only:
            nmt = LoadOnly()
        else:
            targets = Targets.load([args.model])
            nmt = IncrementalTranslator(targets, max_streams=args.writers + 8)
        async with nmt:
            updates = nmt.updates()
            sent: dict[tuple[str, int], float] = {}
            t0 = time.perf_counter()

            async def read() -> None:
                async for reply in updates:
                    now = time.perf_counter() - t0
                    if isinstance(reply, TranslationUpdate):
                        key = (reply.stream_id, reply.seq)
                        tally.seen(now, *key, reply.is_final, sent.get(key))
                    else:
                        tally.errors += 1

            async def mark(name: str, at: float) -> None:
                await anyio.sleep(max(0.0, at - (time.perf_counter() - t0)))
                marks[name] = (time.process_time(), snapshot(probes))
                if profile is not None:
                    profile.toggle()

            async with anyio.create_task_group() as group:
                group.start_soon(read)
                group.start_soon(mark, "start", tally.window[0])
                group.start_soon(mark, "end", tally.window[1])
                for s in sends:
                    delay = s.at - (time.perf_counter() - t0)
                    if delay > 0:
                        await anyio.sleep(delay)
                    sent[(s.stream_id, s.seq)] = time.perf_counter() - t0
                    tally.sending(s)
                    event = PartialTranscript(s.stream_id, s.segment_id, s.seq, s.text, s.is_final)
                    await nmt.push(event)
                await nmt.wait_idle()
                updates.end()

    if args.coalesce_ms > 0:  # an embedder's choice of loop (engine.streaming.wakeups)
        from engine.streaming.wakeups import coalescing_loop

        loop = coalescing_loop(args.coalesce_ms / 1000)
        anyio.run(run, backend_options={"loop_factory": loop})
    else:
        anyio.run(run)
    (c0, s0), (c1, s1) = marks["start"], marks["end"]
    print(json.dumps(result(tally, c1 - c0, s0, s1)))
    return 0


def result(
    tally: Tally, cpu: float, before: dict[str, Any], after: dict[str, Any]
) -> dict[str, Any]:
    def delta(key: str) -> dict[str, float]:
        return {k: v - before[key].get(k, 0.0) for k, v in after[key].items()}

    stages = delta("probes")
    if stages:  # each kind of thread's CPU outside the probes
        probed = delta("probed")
        for kind, seconds in delta("threads").items():
            stages[f"{kind}, unprobed"] = seconds - probed.get(kind, 0.0)
    finals = tally.final_replies
    threads = delta("threads")
    lanes = threads.get("decode lanes", 0.0) + threads.get("native threads (ONNX Runtime)", 0.0)
    return {
        "updates": tally.updates,
        "cpu_s": cpu,
        "ms_per_update": cpu / max(1, tally.updates) * 1000.0,
        "partial_p50_ms": percentile(tally.partial_ms, 50),
        "partial_p95_ms": percentile(tally.partial_ms, 95),
        # Partials answered: the rest were superseded (latest wins) before an update.
        "answered": tally.partial_updates / max(1, tally.partials_changed),
        "finals_sent": tally.finals_sent,
        "finals_answered_once": sum(1 for n in finals.values() if n == 1),
        "finals_answered_twice": sum(1 for n in finals.values() if n > 1),
        "errors": tally.errors,
        "threads": after["os_threads"],
        # The decode lanes' threads (ONNX Runtime's pool with them) and the event loop's.
        "lanes_ms_per_update": lanes / max(1, tally.updates) * 1000.0,
        "loop_ms_per_update": threads.get("event loop thread", 0.0) / max(1, tally.updates) * 1e3,
        "stages_ms_per_update": {
            k: v / max(1, tally.updates) * 1000.0 for k, v in sorted(stages.items())
        },
        "switches_per_update": {
            k: v / max(1, tally.updates) for k, v in sorted(delta("switches").items())
        },
    }


# -- the serve run, from this process -----------------------------------------------------


WORK_KINDS = (
    "encoder_calls",
    "encoder_rows",
    "prefill_calls",
    "prefill_rows",
    "decoder_steps",
    "decoder_step_rows",
)


def scheduler_work(base: str) -> dict[str, float]:
    """The decode schedulers' counters (`nmt_scheduler_work`), summed over languages."""
    from load_server import http_get

    work: dict[str, float] = defaultdict(float)
    for line in http_get(base + "/metrics")[1].splitlines():
        if line.startswith("nmt_scheduler_work_total{"):
            labels, _, value = line.partition("} ")
            kind = labels.split('kind="', 1)[1].split('"', 1)[0]
            work[kind] += float(value)
    return dict(work)


def calls(updates: int, before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Encoder calls and prefills per update, and their rows per call, over the window."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in WORK_KINDS}
    n = max(1, updates)
    return {
        "encoder_calls_per_update": d["encoder_calls"] / n,
        "encoder_rows_per_call": d["encoder_rows"] / max(1.0, d["encoder_calls"]),
        "prefills_per_update": d["prefill_calls"] / n,
        "prefill_rows_per_call": d["prefill_rows"] / max(1.0, d["prefill_calls"]),
        "steps_per_update": d["decoder_steps"] / n,
        "step_rows_per_call": d["decoder_step_rows"] / max(1.0, d["decoder_steps"]),
    }


def proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


async def writers(url: str, plans: list[list[Send]], tally: Tally, on_mark: Any) -> None:
    from websockets.asyncio.client import connect

    import protocol
    from protocol import PartialTranscript, TranslationUpdate

    t0 = time.perf_counter() + 1.0  # time to connect everyone first
    connections = [await connect(url, max_queue=None) for _ in plans]

    async def one(ws: Any, plan: list[Send]) -> None:
        sent: dict[int, float] = {}
        finals = {s.seq for s in plan if s.is_final}

        async def read() -> None:
            async for data in ws:
                now = time.perf_counter() - t0
                msg = protocol.parse(data)
                if isinstance(msg, TranslationUpdate):
                    tally.seen(now, msg.stream_id, msg.seq, msg.is_final, sent.get(msg.seq))
                    finals.discard(msg.seq) if msg.is_final else None
                else:
                    tally.errors += 1
                if not finals and len(sent) == len(plan):
                    return

        reader = asyncio.ensure_future(read())
        for s in plan:
            delay = s.at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            event = PartialTranscript(s.stream_id, s.segment_id, s.seq, s.text, s.is_final)
            sent[s.seq] = time.perf_counter() - t0
            tally.sending(s)
            await ws.send(protocol.serialize(event))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(reader, timeout=30)
        await ws.close()

    async def marks() -> None:
        for name, at in (("start", tally.window[0]), ("end", tally.window[1])):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            on_mark(name)

    await asyncio.gather(
        marks(), *(one(ws, plan) for ws, plan in zip(connections, plans, strict=True))
    )


def run_serve(root: Path, args: argparse.Namespace, extra: str = "") -> dict[str, Any]:
    from load_server import free_port, wait_ready

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "dump.jsonl"
        command = [
            sys.executable, str(HERE / "host_cost.py"), "--child", "serve",
            "--dump", str(dump), "--root", str(root),
        ]  # fmt: skip
        command += ["--stages"] if args.stages else []
        command += ["--null-decode"] if args.null_decode else []
        command += ["--switches"] if args.switches else []
        command += ["--profile", str(args.profile.resolve())] if args.profile else []
        command += [
            "--", "--model", str(args.model), "--port", str(port), "--log-level", "warning",
            "--max-streams", str(args.writers * 2 + 8), *shlex.split(extra),
        ]  # fmt: skip
        log = open(Path(tmp) / "server.log", "w+", encoding="utf-8")  # noqa: SIM115
        env = dict(os.environ, PYTHONPATH=str(root))
        server = subprocess.Popen(command, cwd=root, stdout=log, stderr=log, env=env)
        try:
            if not wait_ready(server, f"http://127.0.0.1:{port}", log):
                raise SystemExit(f"the server under {root} did not start")
            plans = schedule(args.writers, args.warmup + args.seconds, args.interval, args.seed)
            tally = Tally((args.warmup, args.warmup + args.seconds))
            cpu: dict[str, float] = {}
            work: dict[str, dict[str, float]] = {}

            def on_mark(name: str) -> None:
                cpu[name] = proc_cpu(server.pid)
                server.send_signal(signal.SIGUSR1)
                work[name] = scheduler_work(f"http://127.0.0.1:{port}")

            asyncio.run(writers(f"ws://127.0.0.1:{port}/ws", plans, tally, on_mark))
            time.sleep(0.3)
            snaps = [json.loads(line) for line in dump.read_text().splitlines()]
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
            log.close()
    out = result(tally, cpu["end"] - cpu["start"], snaps[0], snaps[1])
    out.update(calls(tally.updates, work["start"], work["end"]))
    return out


def run_inproc(root: Path, args: argparse.Namespace, extra: str = "") -> dict[str, Any]:
    command = [
        sys.executable, str(HERE / "host_cost.py"), "--child", "inproc", "--root", str(root),
        "--writers", str(args.writers), "--seconds", str(args.seconds),
        "--warmup", str(args.warmup), "--interval", str(args.interval),
        "--model", str(args.model), "--seed", str(args.seed),
    ]  # fmt: skip
    command += ["--stages"] if args.stages else []
    command += ["--null-decode"] if args.null_decode else []
    command += ["--load-only"] if args.load_only else []
    command += ["--switches"] if args.switches else []
    command += ["--profile", str(args.profile.resolve())] if args.profile else []
    command += ["--coalesce-ms", str(args.coalesce_ms)]
    command += shlex.split(extra)  # the in-process child's own options (--coalesce-ms)
    env = dict(os.environ, PYTHONPATH=str(root))
    out = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"in-process run under {root} failed:\n{out.stderr[-3000:]}")
    parsed: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return parsed


# -- main ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("serve", "inproc"), default="serve")
    parser.add_argument("--writers", type=int, default=120)
    parser.add_argument("--seconds", type=float, default=8.0, help="measured window")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--interval", type=float, default=0.3, help="seconds between messages")
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--null-decode", action="store_true", help="a decode that costs nothing")
    parser.add_argument(
        "--load-only",
        action="store_true",
        help="in process: no engine, each event answered at once by a stub (the load's own CPU)",
    )
    parser.add_argument("--stages", action="store_true", help="CPU per stage (probed)")
    parser.add_argument(
        "--switches",
        action="store_true",
        help="context switches per update per kind of thread; the loop's wake-ups and polls",
    )
    parser.add_argument(
        "--root", type=Path, action="append", help="checkout(s) to measure (default: this one)"
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs per checkout, alternated")
    parser.add_argument(
        "--arm",
        action="append",
        metavar="'ROOT ARGS'",
        help="one more checkout, with its own extra `serve` options (repeatable)",
    )
    parser.add_argument(
        "--serve-args",
        action="append",
        metavar="ARGS",
        help="extra `serve` options (in process: --coalesce-ms only); repeated: each "
        "checkout once per set, alternated",
    )
    parser.add_argument(
        "--coalesce-ms",
        type=float,
        default=0.0,
        help="in process: the loop's wake-ups coalesced over MS ms (engine.streaming.wakeups; "
        "default 0: asyncio's own loop, as an embedder gets it)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="FILE",
        help="cProfile of the event loop's thread on a thread-CPU clock over the measured "
        "window, written to FILE (pstats; one run: use with one --root)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write every run here")
    parser.add_argument("--child", choices=("serve", "inproc"), help=argparse.SUPPRESS)
    parser.add_argument("--dump", type=Path, help=argparse.SUPPRESS)
    return parser


def cpu_name() -> str:
    """The CPU as /proc/cpuinfo names it, with its family and model (names repeat)."""
    info: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    return (
        f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model "
        f"{info.get('model', '?')}), {os.cpu_count()} cores"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, rest = argv[:at], argv[at + 1 :]
    args = build_parser().parse_args(argv)
    if args.child is not None:
        root = (args.root or [ROOT])[0]
        sys.path.insert(0, str(root))
        return child_serve(args, rest) if args.child == "serve" else child_inproc(args)
    roots = [r.resolve() for r in (args.root or ([] if args.arm else [ROOT]))]
    extras = args.serve_args or [""]
    arms = [(root, extra) for root in roots for extra in extras]
    for arm in args.arm or []:
        root, *rest = shlex.split(arm)
        arms.append((Path(root).resolve(), shlex.join(rest)))
    run = run_serve if args.mode == "serve" else run_inproc
    if args.load_only and args.mode != "inproc":
        raise SystemExit("--load-only measures the in-process load: give --mode inproc")
    decode = (
        "no engine: the load alone"
        if args.load_only
        else "null decode"
        if args.null_decode
        else "its decode"
    )
    print(f"CPU: {cpu_name()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(
        f"{args.mode}: {args.writers} writers, a message every {args.interval} s, a final every "
        f"{FINAL_EVERY}th; model {args.model.name} ({decode}); {args.seconds:g} s measured "
        f"after {args.warmup:g} s"
    )

    def label(arm: tuple[Path, str]) -> str:
        return f"{arm[0].name} {arm[1]}".strip()

    runs: dict[tuple[Path, str], list[dict[str, Any]]] = {arm: [] for arm in arms}
    for i in range(args.repeats):
        # ABBA: the order turns round every repeat; on a shared machine the first run of
        # each pair was slower whatever it ran (docs/performance.md).
        for arm in arms if i % 2 == 0 else arms[::-1]:
            r = run(arm[0], args, arm[1])
            runs[arm].append(r)
            print(
                f"  run {i + 1} {label(arm)}: {r['updates']} updates, {r['ms_per_update']:.3f} "
                f"ms CPU/update, partial p50/p95 {r['partial_p50_ms']:.1f}/"
                f"{r['partial_p95_ms']:.1f} ms, {r['answered']:.0%} of partials answered, "
                f"finals {r['finals_answered_once']}/{r['finals_sent']} once "
                f"({r['finals_answered_twice']} twice), {r['errors']} errors, "
                f"{r['threads']} threads, lanes {r['lanes_ms_per_update']:.3f} / loop "
                f"{r['loop_ms_per_update']:.3f} ms per update"
                + (
                    f", per update {r['encoder_calls_per_update']:.2f} encoder calls x "
                    f"{r['encoder_rows_per_call']:.2f} rows, {r['prefills_per_update']:.2f} "
                    f"prefills x {r['prefill_rows_per_call']:.2f} rows, "
                    f"{r['steps_per_update']:.2f} steps x {r['step_rows_per_call']:.2f} rows"
                    if "encoder_calls_per_update" in r
                    else ""
                ),
                flush=True,
            )
    print()
    print(
        "| run | updates/s | ms CPU per update | lanes / loop | partial p50 / p95 ms | answered "
        "| threads | encoder calls x rows | prefills x rows |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for arm, rs in runs.items():
        med = {
            key: statistics.median(r[key] for r in rs)
            for key in rs[0]
            if key not in ("stages_ms_per_update", "switches_per_update")
        }
        work = (
            f"{med['encoder_calls_per_update']:.2f} x {med['encoder_rows_per_call']:.2f} | "
            f"{med['prefills_per_update']:.2f} x {med['prefill_rows_per_call']:.2f}"
            if "encoder_calls_per_update" in med
            else "- | -"
        )
        print(
            f"| {label(arm)} | {med['updates'] / args.seconds:.0f} | "
            f"{med['ms_per_update']:.3f} | {med['lanes_ms_per_update']:.3f} / "
            f"{med['loop_ms_per_update']:.3f} | {med['partial_p50_ms']:.1f} / "
            f"{med['partial_p95_ms']:.1f} | {med['answered']:.0%} | {med['threads']:.0f} "
            f"| {work} |"
        )
    if args.stages:
        for arm, rs in runs.items():
            print(f"\nstages, ms of CPU per update ({label(arm)}, median of {len(rs)}):")
            keys = sorted({k for r in rs for k in r["stages_ms_per_update"]})
            for key in keys:
                value = statistics.median(r["stages_ms_per_update"].get(key, 0.0) for r in rs)
                print(f"  {key:32s} {value:7.3f}")
    if args.switches:
        for arm, rs in runs.items():
            print(f"\nper update ({label(arm)}, median of {len(rs)}):")
            keys = sorted({k for r in rs for k in r["switches_per_update"]})
            for key in keys:
                value = statistics.median(r["switches_per_update"].get(key, 0.0) for r in rs)
                print(f"  {key:50s} {value:7.2f}")
    if args.json:
        args.json.write_text(json.dumps({label(k): v for k, v in runs.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
