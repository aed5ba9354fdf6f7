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
    returns the files written. Raises `FileNotFoundError` when there is no fp32 encoder."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    folder = onnx_dir(model_dir)
    if not (folder / onnx_file(ENCODER)).is_file():
        raise FileNotFoundError(f"{model_dir}: no fp32 {onnx_file(ENCODER)} to convert")
    written = []
    for stem in FP16_STEMS:
        source = folder / onnx_file(stem)
        if not source.is_file():
            continue
        model = onnx.load(str(source))
        half = convert_float_to_float16(model, keep_io_types=False, disable_shape_infer=True)
        target = folder / onnx_file(stem, fp16=True)
        onnx.save(half, str(target))
        written.append(target)
    return written
