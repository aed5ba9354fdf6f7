"""Conversion of MarianMT checkpoints into the ONNX files the engine runs.

Build-time only: torch, transformers and optimum are imported inside the functions that
need them, so importing this package (or the runtime) never pulls them in.
"""

from engine.conversion.export import (
    copy_tokenizer_files,
    export_decoder_without_encoder_kv,
    export_decoder_without_past,
    export_marian,
)
from engine.conversion.quantize import (
    QUANTIZED_SUFFIX,
    is_lm_head_quantized,
    lm_head_outputs,
    quantize_int8,
    quantized_op_counts,
    untie_lm_head,
)
from engine.model import TOKENIZER_FILES

__all__ = [
    "QUANTIZED_SUFFIX",
    "TOKENIZER_FILES",
    "copy_tokenizer_files",
    "export_decoder_without_encoder_kv",
    "export_decoder_without_past",
    "export_marian",
    "is_lm_head_quantized",
    "lm_head_outputs",
    "quantize_int8",
    "quantized_op_counts",
    "untie_lm_head",
]
