"""The ONNX layer: model files, graph passes (onnx -> onnx), load-time checks and sessions.

Imports nothing above it. The layers above import the names below from `engine.model`,
never its modules, so that the layer can be rearranged inside without touching them.
"""

from engine.model.config import (
    OPTIONAL_TOKENIZER_FILES,
    PROJECT_CONFIG,
    TOKENIZER_FILES,
    ModelConfig,
)
from engine.model.runtime import (
    DecoderCache,
    DecoderLayout,
    EncoderOutput,
    FloatArray,
    IntArray,
    MarianOnnx,
    MaskedDecoder,
    RuntimeOptions,
    onnx_dir,
)
from engine.model.tokenizer import MarianTokenizer

__all__ = [
    "OPTIONAL_TOKENIZER_FILES",
    "PROJECT_CONFIG",
    "TOKENIZER_FILES",
    "DecoderCache",
    "DecoderLayout",
    "EncoderOutput",
    "FloatArray",
    "IntArray",
    "MarianOnnx",
    "MarianTokenizer",
    "MaskedDecoder",
    "ModelConfig",
    "RuntimeOptions",
    "onnx_dir",
]
