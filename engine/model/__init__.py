"""The ONNX layer: model files, graph passes (onnx -> onnx), load-time checks and sessions.

Imports nothing above it. The layers above import the names below from `engine.model`,
never its modules, so that the layer can be rearranged inside without touching them.

    names.py     the one table of file, input and output names
    passes/      graph rewrites, no onnxruntime: merged split, masks, per token, head
    checks.py    load-time checks: signatures, and every rewrite probed against its original
    sessions.py  `RuntimeOptions` and how a session is opened
    layouts.py   one class per decoder layout, and what the calls exchange
    load.py      choose the files once -> passes -> checks -> sessions
    marian.py    `MarianOnnx`: encode, prefill, step
    config.py  tokenizer.py
"""

from engine.model.config import (
    OPTIONAL_TOKENIZER_FILES,
    PROJECT_CONFIG,
    TOKENIZER_FILES,
    ModelConfig,
)
from engine.model.layouts import (
    DecoderCache,
    DecoderLayout,
    EncoderOutput,
    FloatArray,
    IntArray,
    MaskedDecoder,
)
from engine.model.marian import MarianOnnx
from engine.model.names import (
    DECODER,
    DECODER_MERGED,
    DECODER_STEMS,
    DECODER_WITH_PAST,
    ENCODER,
    ONNX_FOLDER,
    QUANTIZED_SUFFIX,
    VARIANT_SUFFIX,
    onnx_dir,
    onnx_file,
)
from engine.model.sessions import RuntimeOptions, threads_from_env
from engine.model.tokenizer import MarianTokenizer

__all__ = [
    "DECODER",
    "DECODER_MERGED",
    "DECODER_STEMS",
    "DECODER_WITH_PAST",
    "ENCODER",
    "ONNX_FOLDER",
    "OPTIONAL_TOKENIZER_FILES",
    "PROJECT_CONFIG",
    "QUANTIZED_SUFFIX",
    "TOKENIZER_FILES",
    "VARIANT_SUFFIX",
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
    "onnx_file",
    "threads_from_env",
]
