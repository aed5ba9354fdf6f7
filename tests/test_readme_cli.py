"""The documentation and the command line agree: every option of every command is in the
CLI reference (docs/cli.md), and every option the README or docs/ show exists (so neither
can drift from the other)."""

from __future__ import annotations

import argparse
import re

from engine.cli.main import build_parser
from tests.conftest import ROOT

CLI_REFERENCE = ROOT / "docs" / "cli.md"
README = ROOT / "README.md"
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


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


def sections(text: str) -> dict[str, str]:
    """The text of each `## name` section of a Markdown page."""
    parts = re.split(r"^## +(.+)$", text, flags=re.MULTILINE)
    return {name.strip(): body for name, body in zip(parts[1::2], parts[2::2], strict=True)}


def test_every_option_is_in_the_cli_reference() -> None:
    reference = CLI_REFERENCE.read_text(encoding="utf-8")
    documented = set(re.findall(r"(--[a-z][a-z0-9-]*)", reference))
    missing = {name: sorted(flags - documented) for name, flags in commands(build_parser()).items()}
    assert not {name: flags for name, flags in missing.items() if flags}


def test_every_subcommand_has_its_section() -> None:
    """Each top-level command has a `## name` section whose text names every option that
    command has (not merely somewhere on the page)."""
    reference = sections(CLI_REFERENCE.read_text(encoding="utf-8"))
    shared = reference["Options every model command shares"]
    for name, flags in commands(build_parser()).items():
        top = name.split()[0]
        assert top in reference, f"docs/cli.md has no '## {top}' section"
        text = reference[top] + (
            shared if top in ("translate", "replay", "serve", "listen") else ""
        )
        missing = sorted(
            flag for flag in flags if flag not in set(re.findall(r"--[a-z0-9-]+", text))
        )
        assert not missing, f"docs/cli.md, section {top}: {name} {missing}"


def test_every_option_the_docs_show_exists() -> None:
    parser = build_parser()
    top = {flag for action in parser._actions for flag in action.option_strings}
    known = set().union(*commands(parser).values(), top)
    # Options of other programs the docs show (Optimum, SimulEval, OmniSTEval, the example
    # client).
    others = {
        "--task", "--output", "--score-only", "--eval-latency-unit", "--sacrebleu-tokenizer",
        "--no-use-ref-len", "--hypothesis_file", "--char_level", "--url",
    }  # fmt: skip
    for path in DOCUMENTS:
        shown = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*)", path.read_text(encoding="utf-8")))
        assert not sorted(shown - known - others), path.relative_to(ROOT)


def test_the_readmes_command_list_names_every_subcommand() -> None:
    listed = sections(README.read_text(encoding="utf-8"))["Command line"]
    names = {name.split()[0] for name in commands(build_parser())}
    missing = sorted(name for name in names if f"`{name}`" not in listed)
    assert not missing, f"README.md, section Command line, lacks {missing}"


def test_the_readmes_command_list_names_every_subcommand_of_a_group() -> None:
    """`models` and `logs` have subcommands of their own: their bullet names each."""
    listed = sections(README.read_text(encoding="utf-8"))["Command line"]
    groups: dict[str, set[str]] = {}
    for name in commands(build_parser()):
        top, _, sub = name.partition(" ")
        if sub:
            groups.setdefault(top, set()).add(sub)
    assert groups.keys() >= {"models", "logs"}
    for top, subs in groups.items():
        bullet = next(line for line in listed.splitlines() if line.startswith(f"- `{top}`"))
        missing = sorted(sub for sub in subs if not re.search(rf"\b{sub}\b", bullet))
        assert not missing, f"README.md, section Command line, `{top}` lacks {missing}"
