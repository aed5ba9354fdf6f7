"""Half precision: fp16 copies of a model's fp32 ONNX files, for GPUs.

A GPU computes in fp16 at several times its fp32 rate and the model then takes half the
memory (weights, and the KV slots sized at start). Each fp32 file (`encoder_model.onnx`,
the split decoders, the merged one) gets an `*_fp16.onnx` beside it, which `--fp16` loads
(`RuntimeOptions.fp16`); its inputs and outputs are fp16 as well, so the engine keeps its
states in fp16 end to end.

The conversion is ONNX Runtime's (`onnxruntime.transformers.float16`), whose default
block list keeps in fp32 the ops that have no fp16 kernel or lose too much in it, with
casts around them. On the CPU provider fp16 runs (slowly: few CPU kernels are fp16), which
is how it is tested without a GPU; `examples/benchmarks/fp16_agreement.py` measures how
often greedy fp16 output equals fp32's.
"""

from __future__ import annotations

from pathlib import Path

from engine.errors import ModelLoadError
from engine.model.names import (
    DECODER,
    DECODER_MERGED,
    DECODER_WITH_PAST,
    ENCODER,
    onnx_dir,
    onnx_file,
)

FP16_STEMS = (ENCODER, DECODER, DECODER_WITH_PAST, DECODER_MERGED)


def convert_fp16(model_dir: Path) -> list[Path]:
    """Write `*_fp16.onnx` beside each fp32 file of `model_dir` (or its `onnx/` folder);
    returns the files written. Raises `FileNotFoundError` when there is no fp32 encoder,
    `ModelLoadError` (before writing anything) when a file is no valid ONNX model."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    folder = onnx_dir(model_dir)
    if not (folder / onnx_file(ENCODER)).is_file():
        raise FileNotFoundError(f"{model_dir}: no fp32 {onnx_file(ENCODER)} to convert")
    stems = [stem for stem in FP16_STEMS if (folder / onnx_file(stem)).is_file()]
    for stem in stems:  # every file checked before any is written
        _checked(folder / onnx_file(stem))
    written = []
    for stem in stems:
        source = folder / onnx_file(stem)
        model = onnx.load(str(source))
        half = convert_float_to_float16(model, keep_io_types=False, disable_shape_infer=True)
        target = folder / onnx_file(stem, fp16=True)
        onnx.save(half, str(target))
        written.append(target)
    return written


def _checked(path: Path) -> None:
    """Raise `ModelLoadError` naming `path` when it is no valid ONNX model: a corrupt or
    truncated file (protobuf cannot parse it) or one that parses to nothing usable (an
    empty file parses to an empty model, which would convert "successfully")."""
    import onnx
    from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

    try:
        model = onnx.load(str(path))
        onnx.checker.check_model(model)
    except (DecodeError, onnx.checker.ValidationError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"{path}: not a valid ONNX model ({reason})") from exc
