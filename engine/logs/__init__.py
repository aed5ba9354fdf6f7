"""Transcript logs: what a replay reads, in one JSON Lines format (`format`), and the tools
that make them: synthetic logs from parallel text (`make`), recogniser stability hints
(`hints`) and several streams' logs merged into one (`merge`). How a log's partials change
is measured in `engine.evaluation.revisions`.
"""

from engine.logs.format import (
    MESSAGE_TYPE,
    PathLike,
    SegmentKey,
    TranscriptLogError,
    check_references,
    event_of,
    read_lines,
    read_log,
    read_references,
    references_output_path,
    segment_order,
    validate_message,
    write_log,
)
from engine.logs.hints import with_stability_hints
from engine.logs.make import DEFAULT_STREAM_ID, FIX_SHARE, AsrStyle, generate_log, make_log_files
from engine.logs.merge import by_emit_time, interleave_logs

__all__ = [
    "DEFAULT_STREAM_ID",
    "FIX_SHARE",
    "MESSAGE_TYPE",
    "AsrStyle",
    "PathLike",
    "SegmentKey",
    "TranscriptLogError",
    "by_emit_time",
    "check_references",
    "event_of",
    "generate_log",
    "interleave_logs",
    "make_log_files",
    "read_lines",
    "read_log",
    "read_references",
    "references_output_path",
    "segment_order",
    "validate_message",
    "with_stability_hints",
    "write_log",
]
