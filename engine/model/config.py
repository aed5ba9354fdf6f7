"""What a model directory says about generation: special ids, limits, languages.

Read from `config.json`, `generation_config.json` (newer exports move generation settings
there) and an optional `nmt-incremental.json` written by `models pull` / the fixture build
(target-language token to prepend, language codes, and for models trained on sentence
prefixes the marker that tells them a source is an unfinished partial).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError
from engine.languages import base_lang

# A model directory's files besides its ONNX files, in one table for everything that
# handles them: the loader reads them, `models pull` fetches them from the tokenizer repo,
# export copies them from a checkpoint, `models verify` checks them.
TOKENIZER_FILES = ("config.json", "source.spm", "target.spm", "vocab.json")
"""Required."""
OPTIONAL_TOKENIZER_FILES = ("generation_config.json", "tokenizer_config.json")
"""Used when present (generation settings of newer exports; MarianTokenizer's settings)."""
PROJECT_CONFIG = "nmt-incremental.json"
"""The engine's own settings (target-language token, partial marker, languages); optional."""


def _read_json(path: Path, model_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{model_dir}: cannot read {path.name}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{model_dir}: {path.name} is not a JSON object")
    return data


def _lang_code(code: object) -> str | None:
    """Map OPUS/ISO codes ('zho', 'cmn_Hans', 'eng') to the short codes used for units."""
    if not isinstance(code, str) or not code:
        return None
    return base_lang(code)


@dataclass(frozen=True)
class ModelConfig:
    """Generation-relevant facts about one MarianMT model."""

    decoder_start_token_id: int
    eos_token_id: int
    pad_token_id: int
    vocab_size: int
    d_model: int
    decoder_layers: int
    decoder_attention_heads: int
    max_position_embeddings: int
    max_length: int
    bad_token_ids: tuple[int, ...] = ()
    source_prefix: str = ""
    partial_suffix: str = ""
    source_lang: str | None = None
    target_lang: str | None = None

    @property
    def head_dim(self) -> int:
        return self.d_model // self.decoder_attention_heads

    @property
    def prefix_trained(self) -> bool:
        """Trained on partial sources marked with `partial_suffix`: such a model ends a
        partial's output where what the final keeps ends, so streaming may trust it more
        (the commit policy, committing through a finished hypothesis)."""
        return bool(self.partial_suffix)

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        """Merge config.json, generation_config.json and nmt-incremental.json."""
        config = _read_json(model_dir / "config.json", model_dir)
        if not config:
            raise ModelLoadError(f"{model_dir}: missing config.json")
        generation = _read_json(model_dir / "generation_config.json", model_dir)
        project = _read_json(model_dir / PROJECT_CONFIG, model_dir)
        tokenizer = _read_json(model_dir / "tokenizer_config.json", model_dir)

        def pick(key: str, default: Any = None) -> Any:
            for source in (generation, config):
                if source.get(key) is not None:
                    return source[key]
            return default

        def need_int(key: str, value: Any) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ModelLoadError(f"{model_dir}: config value {key!r} missing or not an integer")
            return value

        pad = need_int("pad_token_id", pick("pad_token_id"))
        eos = need_int("eos_token_id", pick("eos_token_id"))
        start = need_int("decoder_start_token_id", pick("decoder_start_token_id", pad))
        vocab = need_int("vocab_size", config.get("decoder_vocab_size") or config.get("vocab_size"))
        max_pos = need_int("max_position_embeddings", config.get("max_position_embeddings", 512))
        bad: list[int] = []
        for group in pick("bad_words_ids", []) or []:
            # Only single-token bans can be applied as a logit mask; Marian uses just [[pad]].
            if isinstance(group, list) and len(group) == 1 and isinstance(group[0], int):
                bad.append(group[0])
        if pad not in bad:
            bad.append(pad)
        max_length = pick("max_length") or max_pos
        return cls(
            decoder_start_token_id=start,
            eos_token_id=eos,
            pad_token_id=pad,
            vocab_size=vocab,
            d_model=need_int("d_model", config.get("d_model")),
            decoder_layers=need_int("decoder_layers", config.get("decoder_layers")),
            decoder_attention_heads=need_int(
                "decoder_attention_heads", config.get("decoder_attention_heads")
            ),
            max_position_embeddings=max_pos,
            max_length=min(int(max_length), max_pos),
            bad_token_ids=tuple(bad),
            source_prefix=str(project.get("source_prefix", "") or ""),
            partial_suffix=str(project.get("partial_suffix", "") or ""),
            source_lang=_lang_code(project.get("source_lang") or tokenizer.get("source_lang")),
            target_lang=_lang_code(project.get("target_lang") or tokenizer.get("target_lang")),
        )
