"""Checking an export against PyTorch, before it is trusted.

On a few sentences, the ONNX model run through the engine (`Translator`, KV cache and all)
must produce the same greedy tokens as PyTorch `generate`, and its first decoder step
logits must match PyTorch's. `models export` runs it after `export_marian` (and
`quantize_int8`); torch / transformers are imported only when a check runs.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.decoding.search import DecodeOptions
from engine.decoding.translator import Translator
from engine.distribution import install_hint
from engine.errors import EngineError
from engine.model.config import TOKENIZER_FILES, ModelConfig

EXPORT_MODULES = ("torch", "transformers", "optimum.exporters.onnx", "onnx")
EXPORT_EXTRA_HELP = (
    "`models export` needs the `export` extra (torch, transformers, optimum-onnx, onnx), "
    "missing here: {missing}; install it with: " + install_hint("export") + " "
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


def sample_texts(lang: str | None) -> list[str]:
    """The sample sentences for a model's source language (short code), English when there
    are none for it."""
    return CHECK_TEXTS.get(lang or "", CHECK_TEXTS["en"])


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
    # As PyTorch's generate decodes: without the serving guards against endless output
    # (`DecodeOptions.source_cap`, `repeat_limit`), which would end a loop it goes on with.
    unguarded = DecodeOptions(max_new_tokens=limit, max_length_factor=None, repeat_limit=None)
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
        onnx_logits, _ = translator.model.prefill(translator.encode([ids]), start)
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
        hyp = translator.translate([text], unguarded)[0]
        results.append(
            SentenceCheck(
                text, _strip(generated[0].tolist(), config), hyp.token_ids, hyp.text, diff
            )
        )
    return ExportCheck("int8" if quantized else "fp32", tuple(results))
