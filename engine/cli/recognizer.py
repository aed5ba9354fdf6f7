"""The recognizer's options, shared by `listen` and `serve --asr`: one definition of the
arguments, one way to turn them into `SphinxOptions` (a `--domain-text` model built into a
directory the caller's stack removes), so the two commands cannot drift apart.

A model directory may name the recognizer data of its domain in `recognizer.json` (the
committed fixtures do: a language model of their small grammar, which pocketsphinx's
general English one mishears); it is used when no recognizer option is given."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from engine.asr.domain import build_domain_model
from engine.asr.sphinx import SphinxOptions, check_recognizer_file
from engine.cli.args import positive_float
from engine.distribution import packaged_model

RECOGNIZER_OPTIONS = ("lm", "dict", "jsgf", "domain_text", "acoustic_model")
"""The recognizer options that have no default (given: the user asked for a recognizer)."""

MODEL_RECOGNIZER = "recognizer.json"
"""The file in a model directory that names its domain's recognizer data: an object of
`RECOGNIZER_OPTIONS` keys whose values are paths relative to the directory."""


RECOGNIZER_JSON_LIMIT = 64 * 1024
"""Largest `recognizer.json` read (it holds a few paths)."""


def model_recognizer(model: str | list[str] | None) -> dict[str, str]:
    """The recognizer options the model directory `model` (the first of several) names in
    its `recognizer.json`, as absolute paths; {} when it has none or is no directory.

    A model directory may come from anywhere (a hub download), so what it names is
    checked before anything reads it: `ValueError` for a `recognizer.json` that is not a
    regular file of JSON within `RECOGNIZER_JSON_LIMIT`, and for a path that resolves
    (symbolic links followed) outside the directory: such a file is used only when given
    on the command line (`--lm`, ...). The files themselves are checked like those given
    (`check_recognizer_file`) when the recognizer is made."""
    first = model[0] if isinstance(model, list) else model
    if not first:
        return {}
    folder = Path(first).expanduser()
    if not folder.is_dir():  # a fixture's name (`--model fixture`): the shipped directory
        folder = packaged_model(first) or folder
    if not folder.is_dir():
        return {}
    path = folder / MODEL_RECOGNIZER
    if not os.path.lexists(path):
        return {}
    try:
        found = path.stat()
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror}") from None
    if not stat.S_ISREG(found.st_mode):
        raise ValueError(f"{path}: not a regular file")
    if found.st_size > RECOGNIZER_JSON_LIMIT:
        raise ValueError(f"{path}: {found.st_size} bytes, more than {RECOGNIZER_JSON_LIMIT}")
    try:
        named = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(named, dict) or not all(
        key in RECOGNIZER_OPTIONS and isinstance(value, str) and value
        for key, value in named.items()
    ):
        keys = ", ".join(RECOGNIZER_OPTIONS)
        raise ValueError(f"{path}: expected an object of paths, with keys among {keys}")
    root = folder.resolve()
    out = {}
    for key, value in named.items():
        resolved = (folder / value).resolve()
        if not resolved.is_relative_to(root):
            flag = "--" + key.replace("_", "-")
            raise ValueError(
                f"{path}: {key} {value!r} is outside the model directory (a file there "
                f"is used only when given as {flag})"
            )
        out[key] = str(resolved)
    return out


def add_recognizer_arguments(group: argparse._ArgumentGroup) -> None:
    """pocketsphinx's model, grammar, dictionary and timing options."""
    group.add_argument(
        "--lm", metavar="FILE", help="language model (ARPA, .lm.gz or .lm.bin; default en-US)"
    )
    group.add_argument("--dict", metavar="FILE", help="pronunciation dictionary (default CMUdict)")
    group.add_argument("--jsgf", metavar="FILE", help="a JSGF grammar instead of a language model")
    group.add_argument(
        "--domain-text",
        metavar="FILE",
        help="sentences of the domain, one per line: a language model and dictionary are "
        "made from them at start (recognizes a closed domain far better)",
    )
    group.add_argument("--acoustic-model", metavar="DIR", help="acoustic model (default en-US)")
    group.add_argument(
        "--silence",
        type=positive_float,
        default=SphinxOptions().silence_s,
        metavar="SECONDS",
        help="the pause that ends an utterance (and the least delay of every final; "
        "default %(default)s)",
    )
    group.add_argument(
        "--max-utterance",
        type=positive_float,
        default=SphinxOptions().max_utterance_s,
        metavar="SECONDS",
        help="where noise hides the pauses, an utterance ends at a pause heard against the "
        "noise floor, and at this length wherever it is (default %(default)s)",
    )
    group.add_argument(
        "--partial-every",
        type=positive_float,
        default=SphinxOptions().partial_every_ms,
        metavar="MS",
        help="speech between partial hypotheses (default %(default)s)",
    )


def sphinx_options(
    args: argparse.Namespace,
    stack: contextlib.ExitStack,
    warn: Callable[[str], None],
) -> SphinxOptions:
    """The recognizer options the arguments ask for; raises `ValueError` for a
    contradiction. A `--domain-text` language model and dictionary are built into a
    temporary directory that `stack` removes; words without a pronunciation are reported
    through `warn`. With no recognizer option given, the model's own `recognizer.json`
    fills them in."""
    if not any(getattr(args, name, None) for name in RECOGNIZER_OPTIONS):
        named = model_recognizer(getattr(args, "model", None))
        if named:
            args = argparse.Namespace(**{**vars(args), **named})
    if args.domain_text and (args.lm or args.jsgf):
        raise ValueError("--domain-text makes the language model: give it without --lm/--jsgf")
    if args.lm and args.jsgf:
        raise ValueError("give --lm or --jsgf, not both")

    def path(value: str | None) -> Path | None:
        return Path(value) if value else None

    language_model, dictionary = path(args.lm), path(args.dict)
    if args.domain_text:
        check_recognizer_file(Path(args.domain_text), "domain_text")
        if args.dict:
            check_recognizer_file(Path(args.dict), "dict")
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="nmt-domain-"))
        with open(args.domain_text, encoding="utf-8") as f:
            domain = build_domain_model(f, folder, pronunciations=args.dict)
        if domain.unknown:
            shown = ", ".join(domain.unknown[:10])
            more = f" and {len(domain.unknown) - 10} more" if len(domain.unknown) > 10 else ""
            warn(
                f"--domain-text: no pronunciation for {shown}{more}; their sentences were left out"
            )
        language_model = domain.language_model
        dictionary = dictionary if args.dict else domain.dictionary
    return SphinxOptions(
        language_model=language_model,
        grammar=path(args.jsgf),
        dictionary=dictionary,
        acoustic_model=path(args.acoustic_model),
        silence_s=args.silence,
        max_utterance_s=args.max_utterance,
        partial_every_ms=args.partial_every,
    )
