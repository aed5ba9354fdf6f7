"""nmt-incremental engine: OPUS-MT / MarianMT ONNX translation for live, incremental input."""

from engine.config import ModelConfig
from engine.decoding import DecodeOptions, DecodingCancelled, Hypothesis
from engine.errors import EngineError, InputTooLongError, ModelLoadError
from engine.runtime import DecoderLayout, MarianOnnx, RuntimeOptions
from engine.targets import Targets
from engine.tokenizer import MarianTokenizer
from engine.translator import TranslationResult, Translator

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
