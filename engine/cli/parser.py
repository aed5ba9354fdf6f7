"""The argument parser every `nmt-incremental` command is built with.

argparse, left alone, checks required options before it looks at unknown ones (so a
misspelt `--modle` is reported as a missing `--model`) and hands a subcommand's unknown
arguments up to the top-level parser (so `serve --prot 9000` shows the usage of
`nmt-incremental` rather than of `serve`). `Parser` checks a subcommand's arguments for
unknown options first, names each with its nearest known option, and reports them with
the subcommand's own usage.
"""

from __future__ import annotations

import argparse
import difflib
import itertools
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

MODEL_HINT = (
    "a model directory, a catalog name such as en-zh (`nmt-incremental models list`), a "
    "hub repo id OWNER/NAME, or a fixture the package ships: fixture, fixture_de, "
    "fixture_offline"
)
_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


class Parser(argparse.ArgumentParser):
    """An `ArgumentParser` that refuses unknown options before anything else is checked,
    with a close match where there is one; a leaf command (one without subcommands of its
    own) refuses stray arguments itself too, so its usage is the one shown."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        leaf = not any(isinstance(a, argparse._SubParsersAction) for a in self._actions)
        given = list(sys.argv[1:] if args is None else args)
        # A parser with subcommands owns only what comes before the subcommand.
        own = given if leaf else list(itertools.takewhile(lambda a: a.startswith("-"), given))
        unknown = self.unknown_options(own)
        if unknown:
            self.error("; ".join(self._describe(option) for option in unknown))
        parsed, extras = super().parse_known_args(args, namespace)
        if leaf and extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras

    def unknown_options(self, args: Sequence[str]) -> list[str]:
        """The arguments that look like options this parser does not have."""
        unknown = []
        for arg in args:
            if arg == "--":
                break
            if not arg.startswith("-") or arg == "-" or _NUMBER.match(arg):
                continue
            if not self._known(arg.split("=", 1)[0] if arg.startswith("--") else arg):
                unknown.append(arg.split("=", 1)[0])
        return unknown

    def _known(self, option: str) -> bool:
        strings = self._option_string_actions
        if option in strings:
            return True
        if option.startswith("--"):  # an abbreviation (argparse says when it is ambiguous)
            return self.allow_abbrev and any(s.startswith(option) for s in strings)
        return option[:2] in strings  # a short option with its value attached (-n5)

    def _describe(self, option: str) -> str:
        longs = [s for s in self._option_string_actions if s.startswith("--")]
        near = difflib.get_close_matches(option, longs, n=1, cutoff=0.7)
        hint = f" (did you mean {near[0]}?)" if near else ""
        return f"unrecognized option {option}{hint}"

    def error(self, message: str) -> NoReturn:
        """One `error:` line and where the options are listed, exit status 2: argparse's
        usage block before it buried the line that matters. A missing `--model` (no
        checkout fixture to default to) says what it takes; a missing subcommand names
        them."""
        if message.startswith("the following arguments are required") and "--model" in message:
            message += f" ({MODEL_HINT})"
        listed = "options"
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                listed = "commands"
                missing = message.startswith("the following arguments are required")
                if missing and message.endswith(action.dest):
                    message = "give a command: " + ", ".join(action.choices)
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists the {listed})\n")
