"""A writer that restarts and numbers from 0 again: how many of its finals are answered.

One stream id, `--rounds` writers one after the other: each speaks five sentences (finals
at seq 0-4, or with a partial before each: finals at 1, 3, 5, 7, 9), then its connection
drops without `close_stream` (the stream is handed over), and the next writer, a
restarted process that lost its count, numbers from 0 again with other sentences. A
viewer follows the stream throughout (on the in-process bus it resumes after its cursor
when a life ends, as the subtitle page does; on Redis it watches from another node, and
the writers alternate between two nodes). Printed per bus and pattern, over the
restarted writers (every writer but the first): their finals answered with a
translation, those refused (and with what), and the finals the viewer saw of their
lives. On the committed fixture model; Redis is Debian's `redis-server`, started here.

    python examples/benchmarks/writer_restart.py [--rounds 20] [--only in-process]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's engine, not an installed one

from bus import Redis, cpu_name  # noqa: E402

from engine.decoding.translator import Translator  # noqa: E402
from engine.replies import Reply  # noqa: E402
from engine.streaming.bus import UpdateBus  # noqa: E402
from engine.streaming.controller import IncrementalTranslator  # noqa: E402
from engine.streaming.lifecycle import Owner  # noqa: E402
from engine.streaming.redis_bus import RedisBus  # noqa: E402
from protocol import ErrorMessage, PartialTranscript, TranslationUpdate  # noqa: E402

MODEL = ROOT / "models" / "fixture" / "model"
SENTENCES = [
    "I will meet Tom at three",
    "Tom reads a book",
    "we eat noodles",
    "we will see the film",
    "Tom will play tennis",
    "Does Tom draw a horse",
    "Tom reads a book in the library",
    "the cat sleeps",
    "I will meet Tom",
    "Tom will play tennis with Lucy at three tomorrow",
    "Does Tom draw",
]
STREAM = "talk"


def speech(round_: int, partials: bool) -> list[PartialTranscript]:
    """Five sentences (other ones each round), numbered from 0."""
    events, seq = [], 0
    for segment in range(5):
        sentence = SENTENCES[(round_ * 5 + segment) % len(SENTENCES)]
        if partials:
            first = " ".join(sentence.split()[:2])
            events.append(PartialTranscript(STREAM, segment, seq, first, False))
            seq += 1
        events.append(PartialTranscript(STREAM, segment, seq, sentence, True))
        seq += 1
    return events


class Viewer:
    """Follows the stream from one node: everything it is shown."""

    def __init__(self, nmt: IncrementalTranslator, resumes: bool) -> None:
        self.nmt, self.resumes = nmt, resumes
        self.seen: list[Reply] = []

    async def run(self) -> None:
        cursor = None
        while True:
            sub = self.nmt.updates(STREAM, lang="zh", after=cursor)
            async for reply in sub:
                self.seen.append(reply)
            cursor = sub.cursor or cursor
            if not self.resumes:
                return
            await anyio.sleep(0.005)

    def finals(self, epoch: int | None) -> int:
        return sum(
            isinstance(r, TranslationUpdate) and r.is_final and r.epoch == epoch for r in self.seen
        )


async def answers(sub: AsyncIterator[Reply], finals: int, timeout: float = 30) -> list[Reply]:
    """A writer's replies until each of its finals has one (an update or an error)."""
    got: list[Reply] = []
    with anyio.move_on_after(timeout):
        async for reply in sub:
            got.append(reply)
            answered = [r for r in got if isinstance(r, ErrorMessage) or r.is_final]
            if len(answered) >= finals:
                break
    return got


async def leave(nmt: IncrementalTranslator, owner: Owner) -> None:
    """The writer's connection drops: its stream is handed over, not closed."""
    await nmt.wait_idle(STREAM)
    nmt.owner_left(owner)
    with anyio.fail_after(30):
        while STREAM in nmt.streams:
            await anyio.sleep(0.005)


async def scenario(nodes: list[IncrementalTranslator], rounds: int, partials: bool) -> Counter[str]:
    viewer = Viewer(nodes[-1], resumes=not nodes[-1].bus.shared)
    counts: Counter[str] = Counter()
    async with anyio.create_task_group() as group:
        group.start_soon(viewer.run)
        await anyio.sleep(0.2)  # the viewer's node reads the stream's history
        epochs = []
        for round_ in range(rounds):
            nmt, owner = nodes[round_ % len(nodes)], Owner(f"writer {round_}")
            mine = nmt.updates(owner=owner)
            events = speech(round_, partials)
            for event in events:
                await nmt.push(event, owner)
            got = await answers(mine, sum(e.is_final for e in events))
            await leave(nmt, owner)
            epoch = next((r.epoch for r in got if isinstance(r, TranslationUpdate)), None)
            epochs.append(epoch)
            if round_ == 0:
                continue
            counts["finals sent"] += sum(e.is_final for e in events)
            counts["answered"] += sum(isinstance(r, TranslationUpdate) and r.is_final for r in got)
            for r in got:
                if isinstance(r, ErrorMessage):
                    counts[f"refused {r.code}"] += 1
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            shown = sum(viewer.finals(e) for e in epochs[1:] if e is not None)
            if shown >= counts["answered"]:
                break
            await anyio.sleep(0.02)
        counts["viewer saw"] = sum(viewer.finals(e) for e in epochs[1:] if e is not None)
        group.cancel_scope.cancel()
    return counts


@contextlib.asynccontextmanager
async def engines(
    translator: Translator, bus: str, redis: Redis | None
) -> AsyncIterator[list[IncrementalTranslator]]:
    async with contextlib.AsyncExitStack() as stack:
        nodes = []
        for _ in range(1 if bus == "in-process" else 2):
            shared: UpdateBus | None = None
            if redis is not None:
                shared = RedisBus(redis.url, lease_ms=600)
            nodes.append(
                await stack.enter_async_context(IncrementalTranslator(translator, bus=shared))
            )
        yield nodes


async def main(args: argparse.Namespace) -> None:
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; {args.rounds} writers, one stream id")
    translator = Translator.from_dir(MODEL)
    for bus in args.only:
        redis = Redis() if bus == "redis" else None
        try:
            for partials in (False, True):
                async with engines(translator, bus, redis) as nodes:
                    counts = await scenario(nodes, args.rounds, partials)
                pattern = "partial + final" if partials else "finals only"
                sent = counts.pop("finals sent")
                answered, seen = counts.pop("answered"), counts.pop("viewer saw")
                refused = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"
                print(
                    f"{bus:>10} {pattern:>15}: restarted writers' finals answered "
                    f"{answered}/{sent}, refused: {refused}; viewer saw {seen}/{sent} "
                    "of their lives' finals"
                )
        finally:
            if redis is not None:
                redis.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="writers, one after the other")
    parser.add_argument(
        "--only", nargs="+", default=["in-process", "redis"], choices=["in-process", "redis"]
    )
    asyncio.run(main(parser.parse_args()))
