"""Embed the incremental translator in a speech pipeline, without a server.

The "recogniser" here is a toy async generator that reveals each sentence word by word
and then finalises it; a real one (e.g. a streaming Whisper or Vosk loop) yields the same
`PartialTranscript` events. One task pushes, another shows the updates:

    python examples/embed_pipeline.py [--model models/fixture/model]
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import anyio

from engine import IncrementalTranslator
from protocol import ErrorMessage, PartialTranscript

SENTENCES = ["I will meet Tom at three", "Tom reads a book"]


async def toy_recogniser(
    stream_id: str, words_per_second: float = 3.0
) -> AsyncIterator[PartialTranscript]:
    """Growing partials, one word at a time, then a final per sentence."""
    seq = 0
    for segment_id, sentence in enumerate(SENTENCES):
        words = sentence.split()
        for n in range(1, len(words) + 1):
            await anyio.sleep(1 / words_per_second)
            final = n == len(words)
            yield PartialTranscript(stream_id, segment_id, seq, " ".join(words[:n]), final)
            seq += 1


async def main(model: str) -> None:
    async with IncrementalTranslator.from_dir(model) as nmt:
        updates = nmt.updates("mic")  # subscribe before pushing: nothing is missed

        async def show() -> None:
            async for u in updates:  # ends when the stream is closed
                if isinstance(u, ErrorMessage):  # a final that failed to translate
                    print(f"ERROR seq {u.seq}: {u.message}")
                    continue
                tail = f" [{u.unstable_text}]" if u.unstable_text else ""
                print(f"{'FINAL' if u.is_final else '     '} {u.stable_text}{tail}")

        async with anyio.create_task_group() as tg:
            tg.start_soon(show)
            async for event in toy_recogniser("mic"):
                await nmt.push(event)  # returns at once; stale partials are skipped
            await nmt.close_stream("mic")  # waits for the pending finals


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Incremental translation in a toy pipeline.")
    parser.add_argument("--model", default="models/fixture/model")
    anyio.run(main, parser.parse_args().model)
