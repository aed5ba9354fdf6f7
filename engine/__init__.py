"""nmt-incremental engine: OPUS-MT / MarianMT ONNX translation for live, incremental input.

What a user imports (docs/embedding.md): the three translators, their options and results,
and the errors. Everything else is reachable from its module, not a stable API.

The names load on first use (PEP 562), so that `import engine.remote` (a client of a server)
does not load ONNX Runtime with the model behind `Translator`.

The folders are the layers, each importing only those below it (tests/test_layers.py):
`model` (ONNX files, graph passes, sessions) <- `decoding` (searches, batches, the scheduler,
`Translator`) <- `streaming` (one lifecycle and session per stream, policies, subscriptions)
<- the I/O adapters (`server`, `cli`, `replay`, `subtitles`, `remote`). `hub`, `conversion`
and `evaluation` are tools beside them; `errors` and `languages` are facts every layer reads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.decoding.search import DecodeOptions
    from engine.decoding.translator import TranslationResult, Translator
    from engine.errors import EngineError, InputTooLongError, ModelLoadError
    from engine.remote import RemoteTranslator
    from engine.streaming.controller import IncrementalTranslator
    from engine.streaming.session import StreamingOptions
    from engine.streaming.wakeups import coalescing_loop

_PUBLIC: dict[str, str] = {
    "Translator": "engine.decoding.translator",
    "TranslationResult": "engine.decoding.translator",
    "DecodeOptions": "engine.decoding.search",
    "IncrementalTranslator": "engine.streaming.controller",
    "StreamingOptions": "engine.streaming.session",
    "coalescing_loop": "engine.streaming.wakeups",
    "RemoteTranslator": "engine.remote",
    "EngineError": "engine.errors",
    "ModelLoadError": "engine.errors",
    "InputTooLongError": "engine.errors",
}
"""Each public name -> the module that defines it."""

__all__ = [
    "DecodeOptions",
    "EngineError",
    "IncrementalTranslator",
    "InputTooLongError",
    "ModelLoadError",
    "RemoteTranslator",
    "StreamingOptions",
    "TranslationResult",
    "Translator",
    "coalescing_loop",
]


def __getattr__(name: str) -> object:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
