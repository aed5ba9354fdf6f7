"""nmt-incremental engine: OPUS-MT / MarianMT ONNX translation for live, incremental input.

The folders are the layers, each importing only those below it (tests/test_layers.py):
`model` (ONNX files, graph passes, sessions) <- `decoding` (searches, batches, the scheduler,
`Translator`) <- `streaming` (one lifecycle and session per stream, policies, subscriptions)
<- the I/O adapters (`server`, `cli`, `replay`, `subtitles`). `hub`, `conversion` and
`evaluation` are tools beside them; `errors` and `languages` are facts every layer reads.
"""

from engine import _moved
from engine.decoding.search import DecodeOptions, DecodingCancelled, Hypothesis
from engine.decoding.targets import Targets
from engine.decoding.translator import TranslationResult, Translator
from engine.errors import EngineError, InputTooLongError, ModelLoadError
from engine.model import DecoderLayout, MarianOnnx, MarianTokenizer, ModelConfig, RuntimeOptions

_moved.install()

__all__ = [
    "DecodeOptions",
    "DecoderLayout",
    "DecodingCancelled",
    "EngineError",
    "Hypothesis",
    "InputTooLongError",
    "MarianOnnx",
    "MarianTokenizer",
    "ModelConfig",
    "ModelLoadError",
    "RuntimeOptions",
    "Targets",
    "TranslationResult",
    "Translator",
]
