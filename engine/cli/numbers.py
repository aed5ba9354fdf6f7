"""Number options checked while parsing, apart from `engine.cli.args` so that a command
that loads no model (`send`, `examples/replay_client.py`) imports none of the engine's
model layers with them."""

from __future__ import annotations

import argparse
import math


def number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None


def positive_float(value: str) -> float:
    parsed = number(value)
    if not (parsed > 0 and math.isfinite(parsed)):
        raise argparse.ArgumentTypeError("must be a positive number")
    return parsed


def non_negative_float(value: str) -> float:
    parsed = number(value)
    if not (parsed >= 0 and math.isfinite(parsed)):
        raise argparse.ArgumentTypeError("must be a number >= 0")
    return parsed
