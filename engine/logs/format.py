"""The transcript-log format (JSON Lines): read, validate and write logs and their references.

One line is a ``partial_transcript`` wire message plus ``emit_ms``::

    {"type": "partial_transcript", "stream_id": "s1", "segment_id": 0, "seq": 0,
     "text": "I will", "is_final": false, "start_ms": 0.0, "end_ms": 600.0, "emit_ms": 650.0}

``text`` is the whole current transcript of the segment, ``start_ms``/``end_ms`` the audio
it covers and ``emit_ms`` when the ASR emitted it, all on one clock (``emit_ms = end_ms +``
ASR delay); ``seq`` increases per stream across segments. A references file holds one
reference per segment per line, in order of the segments' first appearance.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from protocol import PartialTranscript

PathLike = str | os.PathLike[str]
SegmentKey = tuple[str, int]

MESSAGE_TYPE = "partial_transcript"
_FIELDS = tuple(f.name for f in dataclasses.fields(PartialTranscript))
_REQUIRED_FIELDS = tuple(
    f.name for f in dataclasses.fields(PartialTranscript) if f.default is dataclasses.MISSING
)


class TranscriptLogError(ValueError):
    """A transcript log or its companion file is malformed; the message names file and line."""


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def event_of(line: Mapping[str, Any]) -> PartialTranscript:
    """The protocol event of a log line (raises ``InvalidMessage`` for one it forbids);
    the keys that are not message fields (``emit_ms``, annotations) are left out."""
    return PartialTranscript(
        **{key: line[key] for key in _FIELDS if key in line or key in _REQUIRED_FIELDS}
    )


def validate_message(obj: object) -> dict[str, Any]:
    """Check one log line's shape; returns it typed as a dict or raises ValueError saying why.

    The message fields are checked by `protocol.PartialTranscript` itself, so a log is
    refused here for exactly what the engine would refuse at replay. ``start_ms``/``end_ms``
    are optional (not every recogniser reports audio times); ``emit_ms`` is required; other
    keys are kept so that logs can carry annotations.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if obj.get("type") != MESSAGE_TYPE:
        raise ValueError(f"'type' must be {MESSAGE_TYPE!r}, got {obj.get('type')!r}")
    for key in (*_REQUIRED_FIELDS, "emit_ms"):
        if key not in obj:
            raise ValueError(f"missing field {key!r}")
    if not _is_number(obj["emit_ms"]):
        raise ValueError(f"'emit_ms' must be a finite number, got {obj['emit_ms']!r}")
    event_of(obj)  # raises InvalidMessage
    return obj


def read_log(path: PathLike) -> list[dict[str, Any]]:
    """Read and validate a transcript log; blank lines are skipped.

    Raises TranscriptLogError naming ``path:line`` for the first malformed line.
    """
    lines: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise TranscriptLogError(
                    f"{path}:{lineno}: invalid JSON: {exc.msg} (column {exc.colno})"
                ) from None
            try:
                lines.append(validate_message(obj))
            except ValueError as exc:
                raise TranscriptLogError(f"{path}:{lineno}: {exc}") from None
    return lines


def write_log(path: PathLike, lines: Iterable[Mapping[str, Any]]) -> int:
    """Validate and write ``lines`` as UTF-8 JSON Lines; returns the number written.

    Everything is validated before the file is opened, so a bad line never leaves a
    half-written log behind.
    """
    checked: list[dict[str, Any]] = []
    for lineno, line in enumerate(lines, start=1):
        try:
            checked.append(validate_message(dict(line)))
        except ValueError as exc:
            raise TranscriptLogError(f"{path}:{lineno}: {exc}") from None
    with open(path, "w", encoding="utf-8") as f:
        for line in checked:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    return len(checked)


def read_lines(path: PathLike) -> list[str]:
    """The lines of a UTF-8 text file, surrounding spaces stripped."""
    try:
        with open(path, encoding="utf-8") as f:
            return [line.strip() for line in f.read().splitlines()]
    except UnicodeDecodeError as exc:
        raise TranscriptLogError(f"{path}: not UTF-8 text ({exc.reason})") from None


def read_references(path: PathLike) -> list[str]:
    """One reference per segment per line, in segment order (surrounding spaces stripped)."""
    return read_lines(path)


def references_output_path(out_path: PathLike) -> Path:
    """Where ``make_log_files`` puts the references aligned with a log: ``<stem>.ref.txt``."""
    out = Path(out_path)
    return out.with_name(out.stem + ".ref.txt")


def segment_order(lines: Sequence[Mapping[str, Any]]) -> list[SegmentKey]:
    """Segments ``(stream_id, segment_id)`` in order of first appearance (reference order)."""
    keys: dict[SegmentKey, None] = {}
    for line in lines:
        keys.setdefault((line["stream_id"], line["segment_id"]), None)
    return list(keys)


def check_references(
    references: Sequence[str],
    lines: Sequence[Mapping[str, Any]],
    *,
    references_path: PathLike | None = None,
    log_path: PathLike | None = None,
) -> None:
    """Raise TranscriptLogError unless there is one reference per segment of the log; the
    message names the files when given."""
    segments = len(segment_order(lines))
    if len(references) != segments:
        where = f"{references_path}: " if references_path is not None else ""
        log = log_path if log_path is not None else "the log"
        raise TranscriptLogError(
            f"{where}{len(references)} references for {segments} segments in {log}"
        )
