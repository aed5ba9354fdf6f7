"""`nmt-incremental replay`: a transcript log through the incremental translator.

Updates go to stdout (or `--out`) as JSON Lines, the metrics table to stderr, and on
request the metrics as JSON, the peer tools' formats, an HTML report and subtitle files.
The work is `engine.replay`; this module reads the options and writes the files.

On a terminal, with no `--out`, hundreds of JSON lines are no use to a person: stdout shows
`LiveView` instead (each stream's stable text and tentative tail, the finals as lines, a
count), and the JSON Lines still go to a file or a pipe exactly as before.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import time
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from engine import subtitles
from engine.cli.args import (
    add_decode_arguments,
    add_model_arguments,
    add_policy_argument,
    load_translator,
    positive_float,
    read_glossary,
    streaming_options,
)
from engine.evaluation.html_report import render, write_html
from engine.evaluation.metrics import SegmentTrace
from engine.evaluation.peers import write_simuleval, write_simulstream
from engine.languages import word_joiner
from engine.logs.format import check_references, read_log, read_references
from engine.logs.updates import TimedUpdate, timed_update_line
from engine.replay import ReplayOptions, replay


def add_replay_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    rep = subparsers.add_parser(
        "replay",
        help="replay a transcript log and report streaming metrics",
        description=(
            "Push the partial transcripts of LOG (JSON Lines with emit_ms) through the "
            "incremental translator. Updates go to stdout (or --out) as JSON Lines (each "
            "with emit_ms and done_ms on the log's clock); on a terminal, without --out, "
            "stdout shows them for people instead (finals as lines, each stream's stable "
            "text and tentative tail, a count). The metrics table goes to stderr. By "
            "default every partial is translated and times are simulated on the log's "
            "clock; --realtime replays on the wall clock instead. "
            "Exits 1 when an event was refused or failed, or a final differed from the "
            "offline translation."
        ),
    )
    add_model_arguments(rep)
    add_decode_arguments(rep)
    rep.add_argument("log", help="transcript log (JSON Lines)")
    add_policy_argument(rep)
    rep.add_argument("--realtime", action="store_true", help="push events at their emit times")
    rep.add_argument("--speed", type=positive_float, default=1.0, help="realtime speed-up factor")
    rep.add_argument("--references", help="one reference per segment, in log order")
    rep.add_argument("--out", help="write updates here instead of stdout")
    rep.add_argument("--report", help="write the metrics as JSON here")
    rep.add_argument(
        "--simuleval",
        metavar="DIR",
        help="write SimulEval's instances.log and config.yaml here (simuleval --score-only "
        "--output DIR scores them; OmniSTEval reads instances.log too)",
    )
    rep.add_argument(
        "--vtt",
        metavar="FILE",
        help="write the finals as WebVTT subtitles (cue times from the log's audio times; "
        "one file per stream, named FILE.STREAM.vtt, when the log has several)",
    )
    rep.add_argument("--srt", metavar="FILE", help="the same as SubRip (.srt)")
    rep.add_argument(
        "--html",
        metavar="FILE",
        help="write a self-contained HTML report to open in a browser (a summary, every "
        "number explained, latency over time, each segment's timeline on demand)",
    )
    rep.add_argument(
        "--simulstream",
        metavar="FILE",
        help="write a simulstream log (what viewers saw, retractions included) here",
    )
    rep.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: on long logs when stderr is a terminal)",
    )


def run_replay(
    args: argparse.Namespace, stdout: TextIO, stderr: TextIO, *, terminal: bool | None = None
) -> int:
    """Replay a log: updates to --out or stdout, the table to stderr, JSON to --report.

    Inputs are read before the model is loaded, so a bad log fails fast. `terminal`: whether
    stdout is a person's terminal (None: ask it); then, without --out, stdout shows the
    live view instead of the JSON Lines.
    """
    lines = read_log(args.log)
    glossary = read_glossary(args)
    view = not args.out and (stdout.isatty() if terminal is None else terminal)
    references = None
    if args.references:
        references = read_references(args.references)
        check_references(references, lines, references_path=args.references, log_path=args.log)
    options = ReplayOptions(
        streaming=streaming_options(args),
        realtime=args.realtime,
        speed=args.speed,
        # the view counts on stdout: a bar on the same terminal would tear it in realtime
        progress=False if view and args.realtime and args.progress is None else args.progress,
    )
    translator = load_translator(args, glossary)
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(args.out, "w", encoding="utf-8")) if args.out else stdout
        live = LiveView.for_terminal(stdout, lines) if view else None

        def write(timed: TimedUpdate) -> None:
            if live is not None:
                live.update(timed)
                return
            out.write(timed_update_line(timed) + "\n")
            if args.realtime:
                out.flush()  # live: show each update as it comes

        try:
            result = replay(translator, lines, options, references=references, on_update=write)
        finally:
            if live is not None:
                live.close()
        out.flush()
    print(result.format_table(), file=stderr)
    config = translator.config
    if args.simuleval:
        write_simuleval(
            args.simuleval,
            result.report,
            result.references,
            source_lang=config.source_lang,
            target_lang=config.target_lang,
        )
    if args.simulstream:
        write_simulstream(args.simulstream, result.traces, target_lang=config.target_lang)
    if args.html:
        page = render(
            result.report,
            result.traces,
            {"model": args.model, "log": args.log, **result.settings},
            updates=[(u.emit_ms, u.latency_ms) for u in result.updates],
            title=f"Replay of {Path(args.log).name}",
        )
        print(f"report: {write_html(args.html, page)}", file=stderr)
    for path, kind in ((args.vtt, "vtt"), (args.srt, "srt")):
        if path:
            for written in write_subtitles(path, kind, result.traces):
                print(f"subtitles: {written}", file=stderr)
    if args.report:
        data = result.to_dict()
        data["settings"] = {"model": args.model, "log": args.log, **data["settings"]}
        Path(args.report).write_text(
            json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8"
        )
    failed = result.refused or result.mismatches or result.counts["errors"]
    return 1 if failed else 0


def write_subtitles(path: str, kind: str, traces: Sequence[SegmentTrace]) -> list[Path]:
    """Subtitle files of the finals in ``traces``: ``path`` itself for one stream, else one
    per stream with the stream id before the suffix."""
    finals: dict[str, list[subtitles.Final]] = {}
    for trace in traces:
        last = trace.updates[-1] if trace.updates else None
        if last is not None and last.is_final:
            finals.setdefault(trace.stream_id, []).append(
                subtitles.Final(trace.audio_start_ms, trace.audio_end_ms, last.text)
            )
    target = Path(path)
    written = []
    for stream, segments in finals.items():
        out = target if len(finals) == 1 else target.with_suffix(f".{stream}{target.suffix}")
        written.append(subtitles.write(out, subtitles.layout(segments), kind))
    return written


# -- the live view ----------------------------------------------------------------------

_DIM, _BOLD, _RESET = "\x1b[2m", "\x1b[1m", "\x1b[0m"
_UP, _CLEAR_RIGHT, _CLEAR_LINE = "\x1b[{n}A", "\x1b[K", "\x1b[2K"


def _columns(out: TextIO, env: Mapping[str, str]) -> int:
    """The width of the terminal `out` writes to (COLUMNS wins, as for `shutil`)."""
    with contextlib.suppress(ValueError):
        if int(env.get("COLUMNS", "0")) > 0:
            return int(env["COLUMNS"])
    try:
        return os.get_terminal_size(out.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return shutil.get_terminal_size((100, 24)).columns


def display_width(text: str) -> int:
    """Terminal columns `text` takes: East Asian wide and full-width characters take two
    (a Chinese line cut by characters would overflow and wrap, breaking the redraw)."""
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def clip_left(text: str, width: int) -> str:
    """The end of `text` in at most `width` columns, "…" marking what was cut: the newest
    words of a long line are the ones a live view must show."""
    if display_width(text) <= width:
        return text
    kept: list[str] = []
    used = 1  # the ellipsis
    for ch in reversed(text):
        used += display_width(ch)
        if used > width:
            break
        kept.append(ch)
    return "…" + "".join(reversed(kept))


def clip_right(text: str, width: int) -> str:
    """The start of `text` in at most `width` columns, "…" marking what was cut (for the
    count, whose first figures matter most)."""
    if display_width(text) <= width:
        return text
    kept: list[str] = []
    used = 1
    for ch in text:
        used += display_width(ch)
        if used > width:
            break
        kept.append(ch)
    return "".join(kept) + "…"


@dataclass
class _Stream:
    """What one stream (and language) shows now."""

    segment: int = 0
    stable: str = ""
    tentative: str = ""  # with what joins it to the stable text (a space in German)
    source: str = ""
    final: bool = False


class LiveView:
    """A person's view of a replay on a terminal: at the bottom one line per stream (its
    segment, the stable text, the tentative tail dimmed or, without colour, in brackets, and
    under it what the recogniser heard) and a count of updates, finals and log time; above
    them each final as a line of its own, as subtitles would keep it. The bottom lines are
    redrawn in place (at most `interval` apart, so a fast replay is not slowed by drawing);
    `ansi=False` (TERM=dumb) prints only the finals and the count.

    The updates are those `engine.replay` hands over: in `--realtime` as they are made,
    in the default fast mode once the log has been translated (it takes a second or two),
    so the view then shows the finals and the count at once.
    """

    def __init__(
        self,
        out: TextIO,
        *,
        segments: int,
        streams: Sequence[str],
        log_span_ms: float,
        log_start_ms: float = 0.0,
        last_segment: int = 0,
        width: int = 100,
        ansi: bool = True,
        color: bool = True,
        interval: float = 0.05,
    ) -> None:
        self.out = out
        self.segments = segments
        self.several = len(streams) > 1
        # labels of one width, so that the texts after them line up
        self.id_width = max((len(stream) for stream in streams), default=0)
        self.segment_width = len(str(last_segment))
        self.log_span_ms = log_span_ms
        self.log_start_ms = log_start_ms
        self.width = max(20, width)
        self.ansi = ansi
        self.color = color and ansi
        self.interval = interval
        self.streams: dict[tuple[str, str | None], _Stream] = {}
        self.finals: list[str] = []  # lines not yet printed
        self.updates = 0
        self.final_count = 0
        self.log_ms = log_start_ms
        self._drawn = 0  # bottom lines on screen now
        self._last_draw = 0.0

    @classmethod
    def for_terminal(
        cls, out: TextIO, lines: Sequence[Mapping[str, Any]], env: Mapping[str, str] | None = None
    ) -> LiveView:
        """A view sized to the terminal `out` is, for the log `lines`; NO_COLOR turns the
        colours off, TERM=dumb the redrawing."""
        env = os.environ if env is None else env
        segments = {(str(line["stream_id"]), line.get("segment_id")) for line in lines}
        emits = [float(line["emit_ms"]) for line in lines] or [0.0]
        return cls(
            out,
            segments=len(segments),
            streams=sorted({stream for stream, _ in segments}),
            log_span_ms=max(emits) - min(emits),
            log_start_ms=min(emits),
            last_segment=max((int(segment or 0) for _, segment in segments), default=0),
            width=_columns(out, env),
            ansi=env.get("TERM", "") != "dumb",
            color="NO_COLOR" not in env,
        )

    def _style(self, text: str, code: str) -> str:
        return f"{code}{text}{_RESET}" if self.color and text else text

    def _label(self, stream: str, segment: int) -> str:
        number = f"#{segment:<{self.segment_width}}"
        return f"{stream:<{self.id_width}} {number}" if self.several else number

    def update(self, timed: TimedUpdate) -> None:
        """Take one update; redraw when the last drawing is old enough."""
        update = timed.update
        self.updates += 1
        self.log_ms = max(self.log_ms, timed.done_ms)
        key = (update.stream_id, update.lang)
        shown = self.streams.setdefault(key, _Stream())
        shown.segment, shown.final = update.segment_id, update.is_final
        shown.stable, shown.tentative = update.stable_text, update.unstable_text
        if shown.stable and shown.tentative and " " not in (shown.stable[-1], shown.tentative[0]):
            shown.tentative = word_joiner(update.lang) + shown.tentative
        shown.source = update.source_text or ""
        if update.is_final:
            self.final_count += 1
            label = self._label(update.stream_id, update.segment_id)
            revised = " (revised what was shown)" if update.revised else ""
            heard = f"  ← {update.source_text}" if update.source_text else ""
            self.finals.append(
                f"{self._style(label, _DIM)}  {update.stable_text}"
                f"{self._style(revised + heard, _DIM)}"
            )
        now = time.monotonic()
        if now - self._last_draw >= self.interval:
            self._draw(now)

    def _count(self) -> str:
        # the last finals come after the last partial: the log's span is the whole
        done = min(self.log_ms - self.log_start_ms, self.log_span_ms) / 1000
        span = f" · log {done:.1f} s of {self.log_span_ms / 1000:.1f} s"
        return (
            f"{self.updates} updates · {self.final_count}/{self.segments} finals"
            f"{span if self.log_span_ms else ''}"
        )

    def _bottom(self) -> list[str]:
        """The lines redrawn in place: per stream its text and what was heard, the count."""
        out: list[str] = []
        room = self.width - 1  # never the last column: some terminals wrap there
        for (stream, _), shown in self.streams.items():
            label = self._label(stream, shown.segment)
            if shown.final:
                text = ""  # its final is a line above; the next segment has not started
            elif self.color:
                text = shown.stable + shown.tentative
            else:
                tentative = shown.tentative.lstrip()
                space = shown.tentative[: len(shown.tentative) - len(tentative)]
                text = shown.stable + (f"{space}[{tentative}]" if tentative else "")
            pad = " " * (display_width(label) + 2)
            line = clip_left(text, room - len(pad))
            if self.color and shown.tentative and not shown.final:
                # the clipped line still ends with the tentative tail: dim that part of it
                cut = max(0, len(line) - len(shown.tentative))
                line = line[:cut] + self._style(line[cut:], _DIM)
            out.append(f"{self._style(label, _BOLD)}  {line}")
            heard = clip_left(shown.source if not shown.final else "", room - len(pad))
            out.append(pad + self._style(heard, _DIM))
        out.append(self._style(clip_right(self._count(), room), _DIM))
        return out

    def _draw(self, now: float) -> None:
        if not self.ansi:
            for line in self.finals:
                self.out.write(line + "\n")
            self.finals.clear()
            self._last_draw = now
            return
        bottom = self._bottom()
        self._rewrite([*self.finals, *bottom])
        self.finals.clear()
        self._drawn = len(bottom)
        self._last_draw = now

    def _rewrite(self, lines: list[str]) -> None:
        """Write `lines` over the bottom lines drawn last, each line cleared to its end and
        the ones left over blanked. Line by line rather than clearing the screen below: a
        clear from the top left corner makes tmux push the old lines into its history."""
        parts = [_UP.format(n=self._drawn) + "\r" if self._drawn else "\r"]
        parts += [line + _CLEAR_RIGHT + "\n" for line in lines]
        left = self._drawn - len(lines)
        if left > 0:
            parts += [_CLEAR_LINE + "\n"] * left + [_UP.format(n=left)]
        self.out.write("".join(parts))
        self.out.flush()

    def close(self) -> None:
        """Print what is left: the last finals and the count (the stream lines go: every
        stream has ended), so the metrics table follows the finals."""
        lines = [*self.finals, self._style(self._count(), _DIM)]
        if self.ansi:
            self._rewrite(lines)
        else:
            self.out.write("".join(line + "\n" for line in lines))
            self.out.flush()
        self.finals.clear()
        self._drawn = 0
