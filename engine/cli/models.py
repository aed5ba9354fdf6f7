"""`nmt-incremental models ...`: pull, list, verify and export models.

A thin I/O layer: `add_models_parser` adds the subcommands to the main parser and
`run_models` runs them; the work is in `engine.hub.download`, `engine.cli.export` (the
`models export` stages) and `engine.conversion`.
Results go to stdout (the last line of `pull` is the model directory, for scripts);
progress and diagnostics go to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TextIO

from engine import distribution
from engine.cli.export import EXPORT_INSTALL, run_export
from engine.conversion.verify import sample_texts
from engine.decoding.translator import Translator
from engine.errors import EngineError, ModelLoadError
from engine.hub.cache import cache_status, cached_etag, file_digest
from engine.hub.catalog import ONNX_FILES, load_catalog
from engine.hub.download import fmt_size, pull, resolve_model
from engine.hub.errors import UnknownModelError
from engine.hub.repo import repo_entry
from engine.hub.settings import HubSettings
from engine.model.config import OPTIONAL_TOKENIZER_FILES, PROJECT_CONFIG, TOKENIZER_FILES
from engine.model.names import onnx_dir

__all__ = ["add_models_parser", "resolve_model", "run_models"]


def add_models_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `models {pull,list,verify,export}` to the main parser's subcommands."""
    models = subparsers.add_parser(
        "models",
        help="get, list, check and export models",
        description="Get OPUS-MT models from the Hugging Face hub, list and check them, "
        "or export a MarianMT checkpoint to ONNX.",
    )
    commands = models.add_subparsers(dest="models_command", required=True)

    pull_cmd = commands.add_parser(
        "pull",
        help="download a catalog model (e.g. en-zh) into the cache",
        description="Download a model named in models/catalog.json, or any hub repo that "
        "holds an ONNX export (ONNX files under onnx/ or at the top, or one folder per model: "
        "see --subfolder), into the Hugging Face cache and print the model directory. "
        "Honours HF_ENDPOINT, HF_HOME/HF_HUB_CACHE, HF_TOKEN and HF_HUB_OFFLINE; an "
        "interrupted download resumes when run again.",
    )
    pull_cmd.add_argument(
        "model",
        metavar="NAME_OR_REPO",
        help="a catalog name (en-zh, zh-en, en-de, de-en: see `models list`) or a hub repo id "
        "(owner/name)",
    )
    pull_cmd.add_argument(
        "--quantized", action="store_true", help="get the int8 ONNX files instead of fp32"
    )
    pull_cmd.add_argument(
        "--refresh", action="store_true", help="ask the hub for newer files even when cached"
    )
    pull_cmd.add_argument(
        "--revision",
        metavar="REV",
        help="branch, tag or commit of the ONNX repo instead of the catalog's pin "
        "(e.g. refs/pr/21)",
    )
    pull_cmd.add_argument(
        "--tokenizer-revision",
        metavar="REV",
        help="the same for the tokenizer repo, when it is another repo",
    )
    pull_cmd.add_argument(
        "--subfolder",
        metavar="FOLDER",
        help="for a repo that is not in the catalog and holds one model per folder: which",
    )
    pull_cmd.add_argument(
        "--source-prefix",
        metavar="TOKEN",
        default="",
        help="for a repo that is not in the catalog: the target-language token multi-target "
        "models need at the start of every source, e.g. '>>cmn_Hans<<'",
    )

    commands.add_parser(
        "list",
        help="list catalog models and what is cached",
        description="List the catalog's models, which variants are cached and their sizes.",
    )

    verify = commands.add_parser(
        "verify",
        help="check a model directory: files, checksums, signatures, a test translation",
        description="Check a model directory (or a cached catalog model): its files, the "
        "checksums of files linked from the hub cache, the ONNX signatures (by loading it) "
        "and a test translation of each ONNX variant present.",
    )
    verify.add_argument(
        "model",
        metavar="DIR_OR_NAME",
        help="a model directory, or a catalog name (en-zh) or repo id (owner/name) already "
        "pulled: verify downloads nothing",
    )
    verify.add_argument("--text", default=None, help="sentence to translate (default: a sample)")

    fp16 = commands.add_parser(
        "fp16",
        help="write fp16 copies of a model's ONNX files (for --fp16 on a GPU)",
        description="Write an *_fp16.onnx file beside each fp32 ONNX file of a model "
        "directory (ONNX Runtime's float16 conversion; the ops that need fp32 stay so), "
        "which --fp16 then loads.",
    )
    fp16.add_argument(
        "model",
        metavar="MODEL_DIR",
        type=Path,
        help="a model directory with fp32 ONNX files (a pulled model's: `models pull`)",
    )

    export = commands.add_parser(
        "export",
        help="export a MarianMT checkpoint to ONNX and check it (needs the export extra)",
        description="Export a PyTorch MarianMT checkpoint to an Optimum-layout ONNX model "
        "directory, optionally quantize it to int8, copy the tokenizer files, and compare "
        "ONNX greedy output and first-step logits with PyTorch. Needs the `export` extra, "
        f"installed with: {EXPORT_INSTALL}.",
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT_DIR", type=Path)
    export.add_argument("out", metavar="OUT_DIR", type=Path)
    export.add_argument("--quantize", action="store_true", help="also write *_quantized int8")
    export.add_argument(
        "--check-text",
        action="append",
        default=None,
        metavar="TEXT",
        help="sentence for the PyTorch/ONNX comparison (repeatable; default: samples)",
    )
    export.add_argument(
        "--tolerance",
        type=float,
        default=1e-3,
        help="largest first-step logit difference accepted for fp32 (default 1e-3)",
    )


def _fp16(args: argparse.Namespace, out: TextIO) -> int:
    from engine.conversion.fp16 import convert_fp16

    model: Path = args.model
    if not model.is_dir():
        raise ModelLoadError(f"{model}: not a model directory")
    try:
        written = convert_fp16(model)
    except FileNotFoundError as exc:
        raise ModelLoadError(str(exc)) from exc
    for path in written:
        print(path, file=out)
    return 0


def run_models(args: argparse.Namespace) -> int:
    """Run a `models` subcommand; 0 on success, 1 when a check fails, 2 on errors."""
    try:
        if args.models_command == "pull":
            return _pull(args, sys.stdout)
        if args.models_command == "list":
            return _list(sys.stdout)
        if args.models_command == "verify":
            return _verify(args, sys.stdout)
        if args.models_command == "export":
            return run_export(args, sys.stdout)
        if args.models_command == "fp16":
            return _fp16(args, sys.stdout)
    except KeyboardInterrupt:
        print(
            "interrupted; finished files and partial downloads are kept in the cache, "
            "run the same command again to resume",
            file=sys.stderr,
        )
        return 130
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"error: unknown models command {args.models_command!r}", file=sys.stderr)
    return 2


def _pull(args: argparse.Namespace, out: TextIO) -> int:
    catalog = load_catalog()
    settings = HubSettings.from_env()
    entry = catalog.find(args.model)
    if entry is not None:
        entry = entry.at(args.revision, args.tokenizer_revision)
    elif "/" in args.model:
        entry = repo_entry(
            args.model,
            revision=args.revision or "main",
            subfolder=args.subfolder,
            quantized=args.quantized,
            source_prefix=args.source_prefix,
            settings=settings,
        )
    else:
        raise UnknownModelError(args.model, catalog.names())
    result = pull(entry, quantized=args.quantized, settings=settings, refresh=args.refresh)
    variant = "int8" if args.quantized else "fp32"
    if result.from_cache:
        how = "already cached, no download"
    else:
        how = f"downloaded {len(result.downloaded)} files"
    commits = ", ".join(f"{repo}@{commit[:10]}" for repo, commit in result.commits.items())
    print(
        f"{entry.name} ({entry.pair}, {variant}): {how}; {len(result.verified)} files "
        f"match their checksums; {commits}",
        file=sys.stderr,
    )
    print(result.model_dir, file=out)
    return 0


def _list(out: TextIO) -> int:
    catalog = load_catalog()
    settings = HubSettings.from_env()
    mode = " (offline)" if settings.offline else ""
    print(f"catalog: {catalog.source}", file=out)
    print(f"hub: {settings.endpoint}{mode}; cache: {settings.hub_cache}", file=out)
    print(f"model directories: {settings.models_root}", file=out)
    print(distribution.describe(), file=out)
    rows = [("NAME", "PAIR", "ONNX REPO", "TOKENIZER REPO", "CACHED")]
    for entry in catalog.entries:
        status = cache_status(entry, settings)
        cached = ", ".join(f"{v} {fmt_size(size)}" for v, size in status.variants.items())
        rows.append((entry.name, entry.pair, entry.onnx.repo, entry.tokenizer.repo, cached or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        print("  ".join([*cells, row[-1]]).rstrip(), file=out)
    return 0


def _verify(args: argparse.Namespace, out: TextIO) -> int:
    """Files and checksums, then per ONNX variant: what loads (the files the loader picked),
    a translation, and self-consistency: decoding with the KV cache must give the tokens
    decoding without it gives (a broken with-past graph or cache bookkeeping shows here),
    and int8 is compared with fp32 when both are present (reported, not judged: int8 may
    legitimately differ)."""
    model_dir = resolve_model(args.model, download=False)
    print(f"model directory: {model_dir}", file=out)
    problems = 0
    print("files:", file=out)
    for name in [*TOKENIZER_FILES, *OPTIONAL_TOKENIZER_FILES, PROJECT_CONFIG]:
        problems += _check_file(model_dir / name, name in TOKENIZER_FILES, model_dir, out)
    outputs: dict[str, list[tuple[int, ...]]] = {}
    for variant in ONNX_FILES:
        quantized = variant == "int8"
        try:
            translator = Translator.from_dir(model_dir, quantized=quantized)
        except EngineError as exc:
            if (onnx_dir(model_dir) / ONNX_FILES[variant][0]).is_file():  # there, yet broken
                print(f"{variant}: does not load: {exc}", file=out)
                problems += 1
            continue
        config = translator.config
        print(
            f"{variant}: loads; decoder {translator.model.layout.value}"
            f"{' (the merged file, split at load)' if translator.model.split_at_load else ''}, "
            f"{config.decoder_layers} decoder layers, d_model {config.d_model}, "
            f"vocab {config.vocab_size}, source prefix {config.source_prefix or '(none)'}",
            file=out,
        )
        for path in dict.fromkeys(translator.model.files.values()):
            problems += _check_file(path, True, model_dir, out)
        texts = [args.text] if args.text else sample_texts(config.source_lang)
        started = time.perf_counter()
        cached = translator.translate(texts)
        elapsed = time.perf_counter() - started
        for text, result in zip(texts, cached, strict=True):
            print(f"  {text!r} -> {result.text!r}", file=out)
        print(f"  {len(texts)} sentences in {elapsed:.2f} s", file=out)
        uncached = Translator.from_dir(model_dir, quantized=quantized, use_cache=False)
        plain = uncached.translate(texts)
        agree = sum(a.token_ids == b.token_ids for a, b in zip(cached, plain, strict=True))
        print(
            f"  with and without the KV cache: the same tokens on {agree}/{len(texts)} "
            "sentences" + ("" if agree == len(texts) else "  PROBLEM: they must agree"),
            file=out,
        )
        problems += agree < len(texts)
        outputs[variant] = [result.token_ids for result in cached]
    if not outputs:
        print("  no ONNX variant loads (an encoder + a decoder)", file=out)
        problems += 1
    if len(outputs) == 2:
        same = sum(a == b for a, b in zip(outputs["fp32"], outputs["int8"], strict=True))
        print(f"int8 vs fp32: the same tokens on {same}/{len(outputs['fp32'])} sentences", file=out)
    print("ok" if not problems else f"{problems} problem(s)", file=out)
    return 0 if not problems else 1


def _check_file(path: Path, required: bool, model_dir: Path, out: TextIO) -> int:
    """Print one file's state; 1 if it is a problem (missing, broken link, bad checksum)."""
    name = path.relative_to(model_dir).as_posix()
    if not path.is_file():
        if path.is_symlink():
            print(f"  BROKEN  {name}: link to {path.readlink()} that does not exist", file=out)
            return 1
        if required:
            print(f"  MISSING {name}", file=out)
            return 1
        print(f"  -       {name} (absent, optional)", file=out)
        return 0
    etag = cached_etag(path)
    check = ""
    if etag is not None:
        actual = file_digest(path, etag)
        if actual is not None and actual != etag:
            print(f"  CORRUPT {name}: hashes to {actual}, the hub's ETag is {etag}", file=out)
            return 1
        check = "  checksum ok" if actual is not None else ""
    print(f"  ok      {name} ({fmt_size(path.stat().st_size)}){check}", file=out)
    return 0
