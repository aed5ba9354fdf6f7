"""The README and the command line agree: every option of every command is documented,
and every option the README shows exists (so neither can drift from the other)."""

from __future__ import annotations

import argparse
import re

from engine.cli.main import build_parser
from tests.conftest import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")


def commands(parser: argparse.ArgumentParser, path: str = "") -> dict[str, set[str]]:
    """'translate', 'models pull', ... -> their long options."""
    out: dict[str, set[str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out |= commands(sub, f"{path} {name}".strip())
    if path:
        out[path] = {
            flag
            for action in parser._actions
            for flag in action.option_strings
            if flag.startswith("--") and flag != "--help"
        }
    return out


def test_every_option_is_in_the_readme() -> None:
    documented = set(re.findall(r"(--[a-z][a-z0-9-]*)", README))
    missing = {name: sorted(flags - documented) for name, flags in commands(build_parser()).items()}
    assert not {name: flags for name, flags in missing.items() if flags}


def test_every_option_the_readme_shows_exists() -> None:
    known = set().union(*commands(build_parser()).values(), {"--help"})
    # Options of other programs the README shows (Optimum, SimulEval, OmniSTEval, pip).
    others = {
        "--task", "--model", "--output", "--score-only", "--eval-latency-unit",
        "--sacrebleu-tokenizer", "--no-use-ref-len", "--hypothesis_file", "--char_level",
    }  # fmt: skip
    shown = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*)", README))
    assert not sorted(shown - known - others)
