"""The one error a bridge raises for what a person must fix (an audio file it cannot send,
a recogniser it cannot reach or whose messages it cannot map); the command line prints it
as `error: ...` and exits 2."""

from __future__ import annotations


class BridgeError(Exception):
    """A bridge cannot go on; the message says why and, where it can, what to do."""
