"""Command-line pieces every `nmt-incremental` command shares, defined once.

`translate`, `replay` and `serve` load a model the same way and take the same model,
search and policy options; their value checks and help texts live here so that the
commands (and the README, which a test compares with them) cannot drift apart.
"""

from __future__ import annotations

import argparse
import errno
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.asr.audio import check_rate
from engine.cli.numbers import non_negative_float as non_negative_float  # re-exported
from engine.cli.numbers import number as parse_number
from engine.cli.numbers import positive_float as positive_float  # re-exported
from engine.decoding.policy import NotEnoughSlots
from engine.decoding.scheduler import SchedulerOptions
from engine.decoding.search import DecodeOptions
from engine.decoding.targets import Targets
from engine.decoding.translator import Translator
from engine.glossary import Glossary, GlossaryError
from engine.hub.download import resolve_model
from engine.model.sessions import parse_device
from engine.streaming.policies import parse_policy
from engine.streaming.session import StreamingOptions

POLICY_HELP = (
    "stability policy: local-agreement[:n] (la[:n]), mask[:k], biased[:beta] or "
    "first-word[:n] (default: local-agreement:2 for a model trained on marked prefixes, "
    "first-word:2 for an ordinary one)"
)


CHECKOUT_FIXTURE = Path(__file__).resolve().parents[2] / "models" / "fixture" / "model"
"""The committed fixture model of the checkout this package runs from (an editable
install); an installed wheel has none."""


def default_model() -> str | None:
    """`--model`'s default, the same for every command: the checkout's fixture where the
    package runs from a checkout that has it, else none (`--model` is then required)."""
    return str(CHECKOUT_FIXTURE) if (CHECKOUT_FIXTURE / "config.json").is_file() else None


class _Repeated(argparse.Action):
    """`append`, except that the first value given replaces the default instead of
    joining it (argparse's `append` keeps a default list's items)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest, None)
        items = [] if current is None or current is self.default else list(current)
        setattr(namespace, self.dest, [*items, values])


class _Once(argparse.Action):
    """A single-model command's `--model`: given twice, it refuses (argparse would keep
    the last one silently, where `serve` would translate into both languages)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest, None)
        if current is not None and current is not self.default:
            parser.error(
                f"{option_string} given twice ({current} and {values}): this command "
                "translates with one model (serve takes several, one per target language)"
            )
        setattr(namespace, self.dest, values)


def positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return number


def _checked(parse: Callable[[str], object], value: str) -> str:
    """`value` as given, once `parse` accepts it: its `ValueError` becomes argparse's
    error, so a typo fails while parsing, before a model loads."""
    try:
        parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def device_name(value: str) -> str:
    """cpu, cuda or cuda:N (whether it can run here is the model load's to say)."""
    return _checked(parse_device, value)


def non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return number


def probability(value: str) -> float:
    number = parse_number(value)
    if not 0.0 <= number <= 1.0:
        raise argparse.ArgumentTypeError("must be between 0 and 1")
    return number


def audio_rate(value: str) -> int:
    """A sample rate the audio sources take (`engine.asr.audio`), checked while parsing."""
    try:
        return check_rate(int(value))
    except ValueError as exc:  # AudioFormatError is one, and int("x") raises one
        raise argparse.ArgumentTypeError(str(exc)) from None


def policy_spec(value: str) -> str:
    """A commit policy spec (`engine.streaming.policies.parse_policy`)."""
    return _checked(parse_policy, value)


BIND_ERRNOS = frozenset({errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL})


def is_bind_error(exc: OSError) -> bool:
    """asyncio's failure to listen (`error while attempting to bind on address ...`)."""
    return exc.errno in BIND_ERRNOS and "bind" in str(exc)


def bind_error(exc: OSError, host: str, port: int, option: str) -> str:
    """One line for a server that cannot listen: a busy port names the option that picks
    another (the OS's own words, `[Errno 98] error while attempting to bind ...`, do not)."""
    if not is_bind_error(exc):
        return str(exc)
    if exc.errno == errno.EADDRINUSE:
        return (
            f"port {port} on {host} is already in use (another server running?): stop it, or "
            f"choose another port with {option} (0: any free one)"
        )
    if exc.errno == errno.EACCES:
        return f"not allowed to listen on port {port} (below 1024 needs root): {option} 8765"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {host}: no such address on this machine"
    return str(exc)


def add_model_arguments(parser: argparse.ArgumentParser, *, several: bool = False) -> None:
    """The model options of every model-using command; `several`: `--model` may be
    repeated, one model per target language (fan-out; `args.model` is then a list)."""
    fixture = default_model()
    what = (
        "model directory, a catalog name such as en-zh, or a hub repo id (downloaded on first "
        "use), or a fixture the package ships (fixture, fixture_de, fixture_offline); "
        + (f"default: the checkout's fixture, {fixture}" if fixture else "required (no checkout)")
    )
    if several:
        parser.add_argument(
            "--model",
            required=fixture is None,
            default=[fixture] if fixture else None,
            action=_Repeated,
            metavar="MODEL",
            help=what + "; repeat it to translate into several languages at once, one model "
            "per target language, all from the same source language (the first is the "
            "default language)",
        )
    else:
        parser.add_argument(
            "--model", required=fixture is None, default=fixture, action=_Once, help=what
        )
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument(
        "--quantized", action="store_true", help="use the *_quantized ONNX files"
    )
    precision.add_argument(
        "--fp16",
        action="store_true",
        help="use the *_fp16 ONNX files (made by `models fp16`; for --device cuda)",
    )
    parser.add_argument(
        "--int8-per-call",
        action="store_true",
        help="with --quantized: quantize activations per call as the files do, not per "
        "token (faster under load, but a row's output then depends on its batch mates)",
    )
    parser.add_argument(
        "--no-cache", action="store_true", help="re-run the whole prefix every step (slow)"
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="ONNX Runtime threads per session (default: ONNX Runtime's, one per core)",
    )
    parser.add_argument(
        "--spin",
        action="store_true",
        help="let ONNX Runtime threads busy-wait: lower latency on a dedicated machine, "
        "worse when other work shares the cores",
    )
    parser.add_argument(
        "--max-batch-rows",
        type=positive_int,
        default=SchedulerOptions().max_rows,
        metavar="N",
        help="decoder rows per batched step, all streams together (default: %(default)s)",
    )
    parser.add_argument(
        "--batch-delay-ms",
        type=non_negative_float,
        default=SchedulerOptions().batch_delay_ms,
        metavar="MS",
        help="under load, an idle decode lane waits up to MS ms for more partials to share "
        "its model calls (less CPU per update, a little latency; never for finals or a lone "
        "stream; default: %(default)s)",
    )
    parser.add_argument(
        "--device",
        type=device_name,
        default="cpu",
        metavar="D",
        help="where the model runs: cpu, or cuda / cuda:N with the [gpu] extra "
        "(onnxruntime-gpu; default: %(default)s)",
    )
    parser.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="on a GPU, launch each step's kernels one by one rather than replay the CUDA "
        "graph captured for its shape (the default, with one lane)",
    )
    parser.add_argument(
        "--kv-slots",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="decoder rows whose keys and values are kept in place, allocated at start; "
        "requests wait for a free one (default: on a GPU one per row the batches may hold, "
        "on the CPU 0: copied at every step)",
    )
    parser.add_argument(
        "--no-inplace-attention",
        action="store_true",
        help="on the CPU, copy each row's self-attention keys and values at every step "
        "rather than extend them in place (the default where the decoder allows it)",
    )
    parser.add_argument(
        "--lockstep",
        action="store_true",
        help="do not rewrite the decoder for continuous batching: batch only requests that "
        "start together",
    )


def add_decode_arguments(parser: argparse.ArgumentParser) -> None:
    """The search options of `translate` and `replay`."""
    parser.add_argument(
        "--beam", type=positive_int, default=1, metavar="N", help="beam size (default 1: greedy)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="stop every decode after N tokens (default: the model's length limit)",
    )
    parser.add_argument(
        "--glossary",
        metavar="FILE",
        default=None,
        help="terms to translate one way: TSV, a first line naming the languages "
        "(en<TAB>de), then source<TAB>target, or one term alone to keep untranslated "
        "(docs/glossaries.md)",
    )
    add_length_arguments(parser)


def repeat_limit(value: str) -> int:
    number = non_negative_int(value)
    if number == 1:
        raise argparse.ArgumentTypeError("must be 0 (off) or at least 2")
    return number


def add_length_arguments(parser: argparse.ArgumentParser) -> None:
    """The guards against a translation that never ends (`DecodeOptions.source_cap`,
    `DecodeOptions.repeat_limit`): every command that decodes takes them."""
    defaults = DecodeOptions()
    parser.add_argument(
        "--max-length-factor",
        type=non_negative_float,
        default=defaults.max_length_factor,
        metavar="F",
        help="end a translation at F x its source's tokens + --max-length-extra tokens "
        f"(default {defaults.max_length_factor}; 0: only the model's limit)",
    )
    parser.add_argument(
        "--max-length-extra",
        type=non_negative_int,
        default=defaults.max_length_extra,
        metavar="N",
        help=f"tokens allowed beyond the factor's (default {defaults.max_length_extra})",
    )
    parser.add_argument(
        "--repeat-limit",
        type=repeat_limit,
        default=defaults.repeat_limit,
        metavar="N",
        help="end a translation whose last words are one n-gram N times in a row, after "
        f"its first (default {defaults.repeat_limit}; 0: off)",
    )


def read_glossary(args: argparse.Namespace) -> Glossary | None:
    """The `--glossary` file (`add_decode_arguments`), read before the model is loaded so
    that a bad line fails fast (`GlossaryError`: the file, the line and what is wrong)."""
    path = getattr(args, "glossary", None)
    return None if path is None else Glossary.read(path)


def decode_options(args: argparse.Namespace) -> DecodeOptions:
    """`DecodeOptions` from `add_decode_arguments`' options, or `add_length_arguments'`
    alone (`serve` searches greedily)."""
    options = DecodeOptions()
    if "beam" in args:
        options = DecodeOptions(beam_size=args.beam, max_new_tokens=args.max_new_tokens)
        slots = getattr(args, "kv_slots", None)
        if slots and args.beam > slots:  # refused before the model loads, not per request
            raise NotEnoughSlots(
                f"--beam {args.beam} needs {args.beam} KV slots and --kv-slots {slots} "
                f"gives {slots}: give --kv-slots {args.beam} or more (or 0)"
            )
    if "max_length_factor" not in args:
        return options
    return replace(
        options,
        max_length_factor=args.max_length_factor or None,
        max_length_extra=args.max_length_extra,
        repeat_limit=args.repeat_limit or None,
    )


def add_policy_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", type=policy_spec, default=None, help=POLICY_HELP)
    parser.add_argument(
        "--source-agreement",
        type=positive_int,
        default=None,
        metavar="N",
        help="commit nothing new until N partials in a row only extended the words before "
        "them (for recognisers that rewrite shown words; default: off)",
    )
    parser.add_argument(
        "--no-drafts",
        dest="drafts",
        action="store_false",
        help="do not verify the previous hypothesis as a draft (same output, more decoder "
        "steps; for comparison)",
    )
    parser.add_argument(
        "--settled-source",
        type=positive_int,
        default=None,
        metavar="N",
        help="treat the words the last N partials share as settled and commit only what "
        "their own translation agrees with (a recogniser's stable_chars hint wins; "
        "default: off)",
    )
    parser.add_argument(
        "--forced-length-ratio",
        type=positive_float,
        default=None,
        metavar="R",
        help="benchmarking random-weight models only: every decode emits ceil(R * source tokens)",
    )


def streaming_options(args: argparse.Namespace) -> StreamingOptions:
    """`StreamingOptions` from `add_policy_argument`'s options, and `add_decode_arguments`'
    (or `add_length_arguments`') where the command has them."""
    return StreamingOptions(
        policy=parse_policy(args.policy) if args.policy else None,
        decode=decode_options(args),
        forced_length_ratio=args.forced_length_ratio,
        source_agreement=args.source_agreement,
        settled_source=args.settled_source,
        drafts=args.drafts,
    )


def load_translator(args: argparse.Namespace, glossary: Glossary | None = None) -> Translator:
    """The translator `add_model_arguments`' options ask for (a catalog name or repo id
    is resolved, and downloaded when missing), placing `glossary`'s terms (checked
    against the model: `GlossaryError`)."""
    translator = Translator.from_dir(
        resolve_model(args.model, quantized=args.quantized), **_load_options(args)
    )
    try:
        translator.glossary = glossary
    except GlossaryError:
        translator.close()
        raise
    return translator


def translation_cores(recognizers: int = 0, machine: int | None = None) -> int:
    """The cores the process's models may use: the machine's (`machine`, default all it
    has) less those speech recognition's worker processes take (`serve --asr-workers`),
    so recognition and translation together never run more calls than there are cores;
    at least one stays for the models."""
    if recognizers < 0:
        raise ValueError("recognizers must be >= 0")
    return max(1, (machine or os.cpu_count() or 1) - recognizers)


def _load_options(args: argparse.Namespace) -> dict[str, Any]:
    """`Translator.from_dir`'s keyword options from `add_model_arguments`' options."""
    return {
        "quantized": args.quantized,
        "fp16": args.fp16,
        "use_cache": not args.no_cache,
        "intra_op_threads": args.threads,
        "allow_spinning": args.spin,
        "batchable": not args.lockstep,
        "int8_per_token": not args.int8_per_call,
        "scheduler": SchedulerOptions(
            max_rows=args.max_batch_rows,
            batch_delay_ms=args.batch_delay_ms,
            kv_slots=args.kv_slots,
            inplace_attention=False if args.no_inplace_attention else None,
        ),
        "device": args.device,
        "cuda_graphs": False if args.no_cuda_graphs else None,
    }


def load_targets(
    args: argparse.Namespace, *, recognizers: int = 0, machine: int | None = None
) -> Targets:
    """Every model of a repeated `--model` (see `add_model_arguments(several=True)`),
    loaded once each with the cores split between them, after `recognizers` cores for
    speech recognition's processes (`serve --asr-workers`); `ModelLoadError` names the
    one that failed, or the two that conflict; `machine`: the cores this process has
    (a `serve --workers` worker's share), default all."""
    specs = args.model if isinstance(args.model, list) else [args.model]
    return Targets.load(
        specs,
        resolve=lambda spec: resolve_model(spec, quantized=args.quantized),
        cores=translation_cores(recognizers, machine),
        **_load_options(args),
    )
