"""`models export`: a MarianMT checkpoint -> an ONNX model directory, checked against PyTorch.

The export itself is `engine.conversion` (Optimum plus the int8 re-merge); this module adds
the check that makes an export trustworthy before it is used: on a few sentences, the ONNX
model run through the engine (`Translator`, KV cache and all) must produce the same greedy
tokens as PyTorch `generate`, and its first decoder step logits must match PyTorch's.
torch / transformers / optimum are imported only here, and only when the command runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from engine.config import ModelConfig
from engine.decoding import DecodeOptions
from engine.errors import EngineError
from engine.translator import Translator

EXPORT_MODULES = ("torch", "transformers", "optimum.exporters.onnx", "onnx")
EXPORT_EXTRA_HELP = (
    "`models export` needs the `export` extra (torch, transformers, optimum-onnx, onnx), "
    "missing here: {missing}; install it with: pip install 'nmt-incremental[export]' "
    "(on CPU-only machines install torch first from the CPU wheel index)"
)
CHECKPOINT_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
# Sentences for the PyTorch/ONNX comparison when none are given, by source language.
CHECK_TEXTS = {
    "en": ["I will meet Tom at three", "Tom reads a book", "The weather is nice today."],
    "zh": ["我三点见汤姆。", "汤姆在看书。", "今天天气很好。"],
    "de": ["Ich treffe Tom um drei.", "Tom liest ein Buch.", "Das Wetter ist heute schön."],
}
MAX_CHECK_TOKENS = 200


class ExportError(EngineError):
    """The export extra is missing, or the checkpoint cannot be exported."""


@dataclass(frozen=True)
class SentenceCheck:
    """PyTorch vs ONNX on one source sentence."""

    text: str
    torch_ids: tuple[int, ...]
    onnx_ids: tuple[int, ...]
    onnx_text: str
    max_logit_diff: float

    @property
    def same_tokens(self) -> bool:
        return self.torch_ids == self.onnx_ids


@dataclass(frozen=True)
class ExportCheck:
    """The comparison for one ONNX variant ('fp32' or 'int8')."""

    variant: str
    sentences: tuple[SentenceCheck, ...]

    @property
    def max_logit_diff(self) -> float:
        return max((s.max_logit_diff for s in self.sentences), default=0.0)

    @property
    def matching(self) -> int:
        return sum(s.same_tokens for s in self.sentences)


def missing_export_modules() -> list[str]:
    """Modules of the `export` extra that cannot be imported here."""
    missing = []
    for name in EXPORT_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:
            found = False
        if not found:
            missing.append(name)
    return missing


def check_checkpoint(checkpoint: Path) -> None:
    """Fail before a long export when the checkpoint directory lacks something."""
    from engine.conversion import TOKENIZER_FILES

    if not checkpoint.is_dir():
        raise ExportError(f"{checkpoint}: not a checkpoint directory")
    missing = [name for name in TOKENIZER_FILES if not (checkpoint / name).is_file()]
    if not any((checkpoint / name).is_file() for name in CHECKPOINT_WEIGHTS):
        missing.append(" or ".join(CHECKPOINT_WEIGHTS))
    if missing:
        raise ExportError(f"{checkpoint}: checkpoint lacks {', '.join(missing)}")


def _generation_limit(config: ModelConfig) -> int:
    """Tokens both sides may generate; the same count for PyTorch and the engine."""
    return min(min(config.max_length, config.max_position_embeddings) - 1, MAX_CHECK_TOKENS)


def _strip(ids: Sequence[int], config: ModelConfig) -> tuple[int, ...]:
    """PyTorch output without the start token and from eos on."""
    out = list(ids)
    if out and out[0] == config.decoder_start_token_id:
        out = out[1:]
    if config.eos_token_id in out:
        out = out[: out.index(config.eos_token_id)]
    return tuple(out)


def check_export(
    checkpoint: Path, model_dir: Path, texts: Sequence[str], *, quantized: bool = False
) -> ExportCheck:
    """Compare greedy tokens and first-step logits of PyTorch and the exported ONNX."""
    import torch
    import transformers

    marian: Any = transformers.MarianMTModel  # untyped library: keep it behind Any
    model = marian.from_pretrained(str(checkpoint), local_files_only=True)
    model.eval()
    translator = Translator.from_dir(model_dir, quantized=quantized)
    config = translator.config
    limit = _generation_limit(config)
    # Greedy, no forced eos at the length limit (the engine stops there without one).
    generation = {
        "num_beams": 1,
        "do_sample": False,
        "max_new_tokens": limit,
        "decoder_start_token_id": config.decoder_start_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "bad_words_ids": [[token] for token in config.bad_token_ids],
        "forced_eos_token_id": None,
    }
    start = np.array([[config.decoder_start_token_id]], dtype=np.int64)
    results = []
    for text in texts:
        ids = translator.source_ids(text)
        onnx_logits, _ = translator.model.decode_first(translator.encode([ids]), start)
        source = torch.tensor([ids], dtype=torch.long)
        with torch.no_grad():
            torch_logits = model(
                input_ids=source,
                attention_mask=torch.ones_like(source),
                decoder_input_ids=torch.from_numpy(start),
            ).logits
            generated = model.generate(
                input_ids=source,
                attention_mask=torch.ones_like(source),
                **generation,
            )
        diff = float(np.max(np.abs(onnx_logits[0, -1] - torch_logits[0, -1].numpy())))
        hyp = translator.translate([text], DecodeOptions(max_new_tokens=limit))[0]
        results.append(
            SentenceCheck(
                text, _strip(generated[0].tolist(), config), hyp.token_ids, hyp.text, diff
            )
        )
    return ExportCheck("int8" if quantized else "fp32", tuple(results))


def run_export(args: argparse.Namespace, out: TextIO) -> int:
    """`models export CHECKPOINT_DIR OUT_DIR [--quantize]`: export, quantize, check."""
    from huggingface_hub.utils.tqdm import tqdm as hf_tqdm

    progress: Any = hf_tqdm  # honours HF_HUB_DISABLE_PROGRESS_BARS; untyped constructor

    missing = missing_export_modules()
    if missing:
        raise ExportError(EXPORT_EXTRA_HELP.format(missing=", ".join(missing)))
    from engine.conversion import export_marian, quantize_int8

    checkpoint: Path = args.checkpoint
    out_dir: Path = args.out
    check_checkpoint(checkpoint)
    stages = ["export to ONNX", *(["quantize to int8"] if args.quantize else [])]
    stages += ["check fp32 against PyTorch", *(["check int8"] if args.quantize else [])]
    checks: list[ExportCheck] = []
    with progress(total=len(stages), desc="models export", unit="step") as bar:
        for stage in stages:
            bar.set_postfix_str(stage)
            started = time.perf_counter()
            try:
                if stage == "export to ONNX":
                    export_marian(checkpoint, out_dir, validate=False)
                elif stage == "quantize to int8":
                    quantize_int8(out_dir)
                else:
                    texts = args.check_text or _default_texts(out_dir)
                    quantized = stage == "check int8"
                    checks.append(check_export(checkpoint, out_dir, texts, quantized=quantized))
            except EngineError:
                raise
            except (RuntimeError, ValueError, OSError) as exc:
                raise ExportError(f"{stage} failed for {checkpoint}: {exc}") from exc
            bar.write(f"{stage}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
            bar.update(1)
    return _report(checks, out_dir, args.tolerance, out)


def _default_texts(model_dir: Path) -> list[str]:
    config = ModelConfig.from_dir(model_dir)
    return CHECK_TEXTS.get(config.source_lang or "", CHECK_TEXTS["en"])


def _report(checks: Sequence[ExportCheck], out_dir: Path, tolerance: float, out: TextIO) -> int:
    """Print the comparison; fp32 must match PyTorch (int8 is reported, not judged)."""
    print(f"model directory: {out_dir}", file=out)
    status = 0
    for check in checks:
        print(
            f"{check.variant}: greedy tokens equal to PyTorch on {check.matching}/"
            f"{len(check.sentences)} sentences; largest first-step logit difference "
            f"{check.max_logit_diff:.3g}",
            file=out,
        )
        for sentence in check.sentences:
            mark = "=" if sentence.same_tokens else "!="
            print(f"  {sentence.text!r} -> {sentence.onnx_text!r} ({mark} PyTorch)", file=out)
        if check.variant == "fp32" and (
            check.matching < len(check.sentences) or check.max_logit_diff > tolerance
        ):
            print(f"fp32 export does not match PyTorch (tolerance {tolerance:g})", file=out)
            status = 1
    return status
