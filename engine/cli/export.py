"""`models export`: a MarianMT checkpoint -> an ONNX model directory, checked against PyTorch.

The I/O half of the command: stages with a progress bar, then the report. The export is
`engine.conversion` (Optimum plus the int8 re-merge), the check `engine.conversion.verify`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from engine.conversion import verify
from engine.conversion.verify import ExportCheck, ExportError, check_export, sample_texts
from engine.distribution import install_hint
from engine.errors import EngineError
from engine.model.config import ModelConfig

EXPORT_INSTALL = install_hint("export")
"""How to get the `export` extra, as the package was installed: from its checkout, or the
extra's requirements for a wheel (it is not published on PyPI, so
`pip install 'nmt-incremental[export]'` finds nothing)."""
EXPORT_EXTRA_HINT = (
    "`models export` needs the `export` extra (torch, transformers, optimum-onnx, onnx), "
    "missing here: {missing}; install it with: "
    f"{EXPORT_INSTALL} (on CPU-only machines install torch first, alone, from the CPU "
    "wheel index)"
)


def run_export(args: argparse.Namespace, out: TextIO) -> int:
    """`models export CHECKPOINT_DIR OUT_DIR [--quantize]`: export, quantize, check."""
    from huggingface_hub.utils.tqdm import tqdm as hf_tqdm

    progress: Any = hf_tqdm  # honours HF_HUB_DISABLE_PROGRESS_BARS; untyped constructor

    missing = verify.missing_export_modules()
    if missing:
        raise ExportError(EXPORT_EXTRA_HINT.format(missing=", ".join(missing)))
    from engine.conversion.export import export_marian
    from engine.conversion.quantize import quantize_int8

    checkpoint: Path = args.checkpoint
    out_dir: Path = args.out
    verify.check_checkpoint(checkpoint)
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
    return sample_texts(config.source_lang)


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
