"""What a recogniser sends, read as untrusted input: a bridge must outlive any message.

The server checks every string it is sent (`protocol/messages.py`: UTF-8 encodable, so no
lone surrogate, which a JSON escape like "\\ud800" decodes to; times finite and in range)
and refuses what fails. A bridge forwards a recogniser's strings and times, so it checks
them the same way first: a bad string is repaired (its lone surrogates dropped, with a
warning) and a time that is no number (NaN, infinite) is taken as unknown, rather than the
event failing to build and the bridge dying with it. JSON nested too deep to parse is no
message, like JSON that does not parse.
"""

from __future__ import annotations

import json
import logging
import math
import re

logger = logging.getLogger(__name__)

_SURROGATE = re.compile("[\ud800-\udfff]")


def read_json(text: str | bytes) -> object | None:
    """The JSON value of one message or line, or None when it is none (invalid, or nested
    deeper than the parser's recursion allows)."""
    try:
        value: object = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value


def clean_text(text: str) -> tuple[str, int]:
    """`text` as the protocol takes it: lone surrogates (which cannot be written as UTF-8)
    dropped; also how many were dropped. A surrogate *pair* never reaches here: JSON
    decoding joins it into the character it encodes."""
    cleaned, dropped = _SURROGATE.subn("", text)
    if dropped:
        logger.warning(
            "the recogniser sent text with %d lone surrogate(s) (not UTF-8): dropped them",
            dropped,
        )
    return cleaned, dropped


def lone_surrogates(text: str) -> int:
    """How many characters `clean_text` would drop from `text`."""
    return len(_SURROGATE.findall(text))


def clean(text: str) -> str:
    """`clean_text` without the count (for status lines and notices)."""
    return clean_text(text)[0]


def finite(value: float | None) -> float | None:
    """A time as the protocol takes it: None for NaN or an infinity (unknown)."""
    return value if value is not None and math.isfinite(value) else None
