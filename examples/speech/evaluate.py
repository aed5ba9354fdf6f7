"""Evaluate speech in, captions out on the spoken test set (`make_set.py`).

    python examples/speech/evaluate.py [--realtime] [--models DIR ...] [--json OUT.json]

Each WAV of `manifest.jsonl` goes through the pipeline of `nmt-incremental listen`
(`engine.asr.transcriber.feed_audio`: pocketsphinx with the fixture's domain model, in a
worker thread, its events pushed into an `IncrementalTranslator`), once per model (by
default both en->zh fixtures: `models/fixture/model`, prefix-trained, and
`models/fixture_offline/model`, trained like OPUS-MT). Reported per model:

- stable text never retracted: within a segment every update's stable text extends the
  last one's; a final that does not is flagged `revised` (counted);
- every final equals offline `Translator.translate` of the recognizer's final text (with
  the options the stream used, as `replay` checks);
- streaming metrics from `engine.evaluation`: the recognizer's events written as a
  transcript log (`emit_ms` = the audio heard when each was made, the clock of a live
  microphone) and replayed with `engine.replay.replay` (LAAL on stable text, in source
  words and in ms; segments with stable text before their final; revised finals);
- the recognizer's word error rate against the manifest's text (per voice, and all);
- real-time factors: recognition alone (its time in the recognizer over the audio) and
  recognition + translation (the pipeline's wall time over the audio, as fast as it goes);
- the delay from the end of speech (a segment's `end_ms`) to its final subtitle, p50/p95:
  with `--realtime` measured on the wall clock, each file fed at its real speed; without,
  simulated as (audio heard when the recognizer made the final - end_ms) + the final's
  translation latency.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.asr.audio import WavSource  # noqa: E402
from engine.asr.domain import normalize_words  # noqa: E402
from engine.asr.sphinx import SphinxOptions, SphinxRecognizer  # noqa: E402
from engine.asr.transcriber import Transcriber, feed_audio  # noqa: E402
from engine.cli.listen_session import transcript_line  # noqa: E402
from engine.decoding.translator import Translator  # noqa: E402
from engine.evaluation.metrics import percentile  # noqa: E402
from engine.replay import ReplayOptions, ReplayResult, replay  # noqa: E402
from engine.streaming.controller import IncrementalTranslator  # noqa: E402
from engine.streaming.session import StreamingOptions  # noqa: E402
from engine.streaming.subscriptions import Subscription  # noqa: E402
from protocol import ErrorMessage, PartialTranscript, TranslationUpdate  # noqa: E402

HERE = Path(__file__).resolve().parent
MODELS = (ROOT / "models" / "fixture" / "model", ROOT / "models" / "fixture_offline" / "model")


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(Levenshtein distance in words, reference words): the numerator and denominator of
    the word error rate."""
    ref, hyp = reference.split(), hypothesis.split()
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, start=1):
        diagonal, row[0] = row[0], i
        for j, h in enumerate(hyp, start=1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (r != h))
    return row[len(hyp)], len(ref)


def recognizer_options() -> SphinxOptions:
    return SphinxOptions(language_model=HERE / "fixture.lm.gz", dictionary=HERE / "fixture.dict")


@dataclass
class FileRun:
    """One file through the pipeline: its events (with the audio heard when each was
    made), its replies (with their wall time from the first chunk), the times."""

    item: dict[str, Any]
    stream_id: str
    events: list[tuple[PartialTranscript, float]]
    replies: list[tuple[TranslationUpdate | ErrorMessage, float]]
    audio_s: float
    wall_s: float
    recognition_s: float
    failures: int
    refused: int


@dataclass
class ModelRun:
    model: Path
    files: list[FileRun] = field(default_factory=list)


async def collect(
    sub: Subscription, into: list[tuple[TranslationUpdate | ErrorMessage, float]]
) -> None:
    """Every reply of a stream with the wall time it came at, until the stream ends."""
    async for reply in sub:
        into.append((reply, time.perf_counter()))


async def run_model(
    model: Path, items: Sequence[dict[str, Any]], realtime: bool, options: StreamingOptions
) -> ModelRun:
    translator = Translator.from_dir(model)
    run = ModelRun(model)
    async with IncrementalTranslator(translator, options) as nmt:
        for n, item in enumerate(items):
            stream_id = f"f{n:02d}"
            sub = nmt.updates(stream_id)
            replies: list[tuple[TranslationUpdate | ErrorMessage, float]] = []
            source = WavSource(HERE / item["file"])
            transcriber = Transcriber(
                nmt, SphinxRecognizer(recognizer_options()), stream_id, sample_rate=source.rate
            )
            async with anyio.create_task_group() as group:
                group.start_soon(collect, sub, replies)
                fed = await feed_audio(transcriber, source, realtime=realtime)
            source.close()
            run.files.append(
                FileRun(
                    item,
                    stream_id,
                    fed.events,
                    [(reply, at - fed.started) for reply, at in replies],
                    fed.heard_ms / 1000,
                    fed.wall_s,
                    transcriber.stream.busy_s,
                    len(fed.failures),
                    len(transcriber.refused),
                )
            )
    return run


@dataclass
class Checks:
    segments: int = 0
    finals: int = 0
    retractions: int = 0  # a non-final update whose stable text drops committed text
    revised: int = 0  # finals flagged revised
    unflagged: int = 0  # finals that drop committed text without the flag (a bug)
    offline_mismatches: int = 0
    missing_finals: int = 0  # segments with a final event and no final update
    errors: int = 0
    delays_ms: list[float] = field(default_factory=list)


def check(
    run: ModelRun, translator: Translator, options: StreamingOptions, realtime: bool
) -> Checks:
    out = Checks()
    lang = translator.config.source_lang
    for f in run.files:
        finals_heard = {e.segment_id: (e, heard) for e, heard in f.events if e.is_final}
        by_segment: dict[int, list[tuple[TranslationUpdate, float]]] = defaultdict(list)
        for reply, at in f.replies:
            if isinstance(reply, ErrorMessage):
                out.errors += 1
            else:
                by_segment[reply.segment_id].append((reply, at))
        out.segments += len({e.segment_id for e, _ in f.events})
        for segment, (event, heard) in finals_heard.items():
            updates = by_segment.get(segment, [])
            final = next((u for u, _ in updates if u.is_final), None)
            if final is None:
                out.missing_finals += 1
                continue
            out.finals += 1
            stable = ""
            for update, _ in updates:
                if update.is_final:
                    if not update.stable_text.startswith(stable):
                        out.unflagged += 0 if update.revised else 1
                    out.revised += update.revised
                elif not update.stable_text.startswith(stable):
                    out.retractions += 1
                else:
                    stable = update.stable_text
            source = options.clean(event.text, lang)
            decode = options.decode_for(len(translator.source_ids(source)))
            if translator.translate([source], decode)[0].text != final.stable_text:
                out.offline_mismatches += 1
            end_ms = float(event.end_ms or 0.0)
            at = next(at for u, at in updates if u.is_final)
            if realtime:
                out.delays_ms.append(at * 1000 - end_ms)
            else:
                out.delays_ms.append(heard - end_ms + final.latency_ms)
    return out


def transcript_log(run: ModelRun) -> list[dict[str, Any]]:
    return [json.loads(transcript_line(e, heard)) for f in run.files for e, heard in f.events]


def wer_by_voice(run: ModelRun) -> dict[str, tuple[int, int]]:
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for f in run.files:
        heard = " ".join(e.text for e, _ in f.events if e.is_final)
        errors, words = word_errors(normalize_words(f.item["text"]), normalize_words(heard))
        for key in (f.item["voice"], "all"):
            totals[key][0] += errors
            totals[key][1] += words
    return {voice: (e, n) for voice, (e, n) in totals.items()}


def cpu() -> str:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return f"{names[0] if names else platform.processor()}, {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--manifest", type=Path, default=HERE / "manifest.jsonl")
    parser.add_argument("--models", type=Path, nargs="+", default=list(MODELS))
    parser.add_argument("--realtime", action="store_true", help="feed each file at real speed")
    parser.add_argument("--json", type=Path, help="write the numbers here as JSON")
    parser.add_argument(
        "--source-agreement",
        type=int,
        metavar="N",
        help="commit only after N partials only extended the words (StreamingOptions)",
    )
    parser.add_argument(
        "--settled-source",
        type=int,
        metavar="N",
        help="treat the words N partials share as settled (StreamingOptions)",
    )
    args = parser.parse_args()
    items = [json.loads(line) for line in args.manifest.read_text().splitlines() if line.strip()]
    options = StreamingOptions(
        source_agreement=args.source_agreement, settled_source=args.settled_source
    )
    table: dict[str, dict[str, str]] = {}
    numbers: dict[str, Any] = {"cpu": cpu(), "files": len(items), "realtime": args.realtime}
    wer: dict[str, tuple[int, int]] = {}
    heard_texts: list[list[str]] = []
    for model in args.models:
        run = anyio.run(run_model, model, items, args.realtime, options)
        translator = Translator.from_dir(model)
        checks = check(run, translator, options, args.realtime)
        replayed: ReplayResult = replay(translator, transcript_log(run), ReplayOptions(options))
        report = replayed.report
        audio = sum(f.audio_s for f in run.files)
        wer = wer_by_voice(run)
        heard_texts.append([e.text for f in run.files for e, _ in f.events if e.is_final])
        name = model.parent.name
        delays = checks.delays_ms
        row = {
            "segments (recognizer finals)": f"{checks.finals} of {checks.segments}",
            "stable text retracted before final": str(checks.retractions),
            "finals revising stable text (live, flagged)": f"{checks.revised}",
            "finals revising stable text unflagged": str(checks.unflagged),
            "finals = offline translate of heard text": (
                f"{checks.finals - checks.offline_mismatches} of {checks.finals}"
            ),
            "finals missing / errors": f"{checks.missing_finals} / {checks.errors}",
            "LAAL stable (source words)": _num(report.laal_stable, 2),
            "LAAL stable (ms, from speech start)": _num(report.laal_ms_stable, 0),
            "segments with stable text before final": f"{report.segments_with_early_stable}"
            f" of {report.segments}",
            "replay: final exact match": _num(replayed.final_exact_match, 3),
            "replay: finals revising stable text": str(report.revised_finals),
            "recognition RTF": _num(sum(f.recognition_s for f in run.files) / audio, 3),
            "recognition + translation RTF": "-"
            if args.realtime
            else _num(sum(f.wall_s for f in run.files) / audio, 3),
            "end of speech -> final p50 (ms)": _num(percentile(delays, 50), 0),
            "end of speech -> final p95 (ms)": _num(percentile(delays, 95), 0),
            "recognizer failures / refused": f"{sum(f.failures for f in run.files)}"
            f" / {sum(f.refused for f in run.files)}",
        }
        table[name] = row
        numbers[name] = {
            "checks": {k: v for k, v in checks.__dict__.items() if k != "delays_ms"},
            "delays_ms": delays,
            "report": report.to_dict(),
            "audio_s": audio,
        }
    same = all(texts == heard_texts[0] for texts in heard_texts)
    numbers["wer"] = {voice: e / n for voice, (e, n) in wer.items()}
    print(
        f"CPU: {numbers['cpu']}; {len(items)} files, "
        f"{sum(f.audio_s for f in run.files):.1f} s of audio; "
        f"{'realtime' if args.realtime else 'as fast as it goes'}"
    )
    print(
        "word error rate of the recognizer: "
        + ", ".join(f"{voice} {e / n:.3f} ({e}/{n})" for voice, (e, n) in sorted(wer.items()))
        + ("" if same else " (recognition differed between the runs!)")
    )
    names = list(table)
    width = max(len(k) for k in table[names[0]])
    cols = [max(len(n), 12) for n in names]
    print(f"{'':<{width}}  " + "  ".join(f"{n:>{c}}" for n, c in zip(names, cols, strict=True)))
    for key in table[names[0]]:
        print(
            f"{key:<{width}}  "
            + "  ".join(f"{table[n][key]:>{c}}" for n, c in zip(names, cols, strict=True))
        )
    if args.json:
        args.json.write_text(json.dumps(numbers, indent=2, ensure_ascii=False) + "\n")


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    main()
