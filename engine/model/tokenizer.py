"""MarianMT tokenization with sentencepiece, id-for-id identical to `MarianTokenizer`.

OPUS-MT models ship two sentencepiece models (source and target) and one joint
`vocab.json`; ids come from the vocab, not from the sentencepiece models. We reimplement the
few rules of `transformers.MarianTokenizer` so the runtime needs no torch/transformers:
special tokens written in the text are kept whole, a leading `>>lang<<` code is kept whole,
unknown pieces map to `<unk>`, `</s>` is appended; decoding joins pieces with the target
model and turns the piece marker into spaces.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import sentencepiece as spm

from engine.errors import ModelLoadError

PIECE_MARKER = "\u2581"

WORD_MEMO = 1 << 16
"""Words whose source pieces a tokenizer keeps (`MarianTokenizer.source_pieces`); past it the
memo starts afresh. A live stream's partials repeat the same words again and again."""

_PROBES = ("a b", "Hello  world, it's 3pm!", " x-ray  ok. ", "1 22 333")
"""Texts on which a sentencepiece model must tokenize word by word as it does whole for
the word memo to be used with it."""


_NORMALIZER_SPEC = 3  # ModelProto field every trained sentencepiece model writes, after its pieces


def _top_level_fields(data: bytes) -> set[int] | None:
    """The field numbers of a serialized protobuf message's top-level fields, or None when
    its records do not add up to its length (a cut or corrupt file)."""

    def varint(pos: int) -> tuple[int, int] | None:
        value, shift = 0, 0
        while pos < len(data) and shift < 64:
            byte = data[pos]
            value |= (byte & 0x7F) << shift
            pos, shift = pos + 1, shift + 7
            if not byte & 0x80:
                return value, pos
        return None

    fields: set[int] = set()
    pos = 0
    while pos < len(data):
        tag = varint(pos)
        if tag is None:
            return None
        key, pos = tag
        wire = key & 7
        if wire == 0:
            skip = varint(pos)
            if skip is None:
                return None
            pos = skip[1]
        elif wire == 1:
            pos += 8
        elif wire == 2:
            size = varint(pos)
            if size is None:
                return None
            pos = size[1] + size[0]
        elif wire == 5:
            pos += 4
        else:
            return None
        fields.add(key >> 3)
    return fields if pos == len(data) else None


def _by_words(processor: spm.SentencePieceProcessor) -> bool:
    """Whether `processor` tokenizes a text of printable ASCII as the concatenation of
    its words' pieces: no piece holds the word marker past its start (so none spans a
    space, as sentencepiece trains with `split_by_whitespace`), and on a few probes with
    spaces, repeated spaces and punctuation, word by word equals whole (the dummy prefix
    and whitespace rules as assumed)."""
    size = processor.GetPieceSize()
    if any(PIECE_MARKER in processor.IdToPiece(i)[1:] for i in range(size)):
        return False
    return all(
        list(processor.EncodeAsPieces(text))
        == [p for word in text.split() for p in processor.EncodeAsPieces(word)]
        for text in _PROBES
    )


def _load_spm(path: Path, model_dir: Path) -> spm.SentencePieceProcessor:
    if not path.is_file():
        raise ModelLoadError(f"{model_dir}: missing tokenizer file {path.name}")
    processor = spm.SentencePieceProcessor()
    try:
        processor.Load(str(path))
    except (OSError, RuntimeError) as exc:
        raise ModelLoadError(
            f"{model_dir}: corrupt sentencepiece model {path.name}: {exc}"
        ) from exc
    # sentencepiece loads a file cut between two of its pieces without complaint, with the
    # pieces after the cut missing (text would then tokenize to <unk>): a complete model
    # ends with its normalizer spec.
    fields = _top_level_fields(path.read_bytes())
    if fields is None or _NORMALIZER_SPEC not in fields:
        raise ModelLoadError(
            f"{model_dir}: corrupt sentencepiece model {path.name}: truncated "
            "(no normalizer spec after the pieces)"
        )
    return processor


class MarianTokenizer:
    """Source encoding and target decoding for one OPUS-MT model."""

    def __init__(
        self,
        source: spm.SentencePieceProcessor,
        target: spm.SentencePieceProcessor,
        vocab: dict[str, int],
        *,
        unk_token: str = "<unk>",
        eos_token: str = "</s>",
        pad_token: str = "<pad>",
    ) -> None:
        for token in (unk_token, eos_token, pad_token):
            if token not in vocab:
                raise ValueError(f"vocab has no {token!r}")
        self.source = source
        self.target = target
        self.vocab = vocab
        self.pieces: dict[int, str] = {i: piece for piece, i in vocab.items()}
        self.unk_token = unk_token
        self.unk_id = vocab[unk_token]
        self.eos_id = vocab[eos_token]
        self.pad_id = vocab[pad_token]
        self.special_tokens = (eos_token, unk_token, pad_token)
        self.special_ids = frozenset(vocab[t] for t in self.special_tokens)
        # MarianTokenizer splits the text on its special tokens before sentencepiece runs.
        ordered = sorted(self.special_tokens, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(re.escape(t) for t in ordered) + ")")
        self._words: dict[str, list[str]] | None = {} if _by_words(source) else None

    @classmethod
    def from_dir(cls, model_dir: Path) -> MarianTokenizer:
        """Load `source.spm`, `target.spm` and `vocab.json` from a model directory."""
        source = _load_spm(model_dir / "source.spm", model_dir)
        target = _load_spm(model_dir / "target.spm", model_dir)
        vocab_path = model_dir / "vocab.json"
        try:
            vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ModelLoadError(f"{model_dir}: missing tokenizer file vocab.json") from exc
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{model_dir}: corrupt vocab.json: {exc}") from exc
        if not isinstance(vocab, dict) or not all(
            isinstance(k, str) and isinstance(v, int) for k, v in vocab.items()
        ):
            raise ModelLoadError(f"{model_dir}: vocab.json is not a piece -> id mapping")
        try:
            return cls(source, target, vocab)
        except ValueError as exc:
            raise ModelLoadError(f"{model_dir}: vocab.json: {exc}") from exc

    def __len__(self) -> int:
        return len(self.vocab)

    def source_pieces(self, text: str) -> list[str]:
        """Pieces of a source text as MarianTokenizer.tokenize gives them (without eos).

        Printable ASCII text is tokenized word by word from a memo when the model's
        pieces never span a space (`_by_words`): the same pieces, without running
        sentencepiece on the whole text again for every partial of a growing sentence."""
        words = self._words
        if (
            words is None
            or not (text.isascii() and text.isprintable())
            or self._special_re.search(text) is not None
        ):
            return self._pieces(text, self.source)
        pieces: list[str] = []
        if text.startswith(">>") and (end := text.find("<<")) != -1:  # a language code
            pieces.append(text[: end + 2])
            text = text[end + 2 :]
        for word in text.split():
            found = words.get(word)
            if found is None:
                if len(words) >= WORD_MEMO:
                    words.clear()
                found = words[word] = list(self.source.EncodeAsPieces(word))
            pieces.extend(found)
        return pieces

    def _pieces(self, text: str, processor: spm.SentencePieceProcessor) -> list[str]:
        pieces: list[str] = []
        for chunk in self._special_re.split(text):
            if not chunk:
                continue
            if chunk in self.special_tokens:
                pieces.append(chunk)
                continue
            if chunk.startswith(">>") and (end := chunk.find("<<")) != -1:
                pieces.append(chunk[: end + 2])
                chunk = chunk[end + 2 :]
            pieces.extend(processor.EncodeAsPieces(chunk))
        return pieces

    def encode_source(self, text: str) -> list[int]:
        """Token ids of a source text, eos appended, unknown pieces as `<unk>`."""
        ids = [self.vocab.get(piece, self.unk_id) for piece in self.source_pieces(text)]
        ids.append(self.eos_id)
        return ids

    def target_pieces(self, text: str) -> list[str]:
        """Target-side pieces of `text` (a glossary names the ones the vocabulary lacks)."""
        return self._pieces(text, self.target)

    def encode_target(self, text: str) -> list[int]:
        """Target-side ids (no eos), e.g. to force a known translation prefix."""
        return [self.vocab.get(p, self.unk_id) for p in self._pieces(text, self.target)]

    def id_to_piece(self, token_id: int) -> str:
        return self.pieces.get(token_id, self.unk_token)

    def detokenize(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of target ids, as MarianTokenizer.decode gives it."""
        out = ""
        run: list[str] = []
        for token_id in ids:
            if skip_special_tokens and int(token_id) in self.special_ids:
                continue
            piece = self.id_to_piece(int(token_id))
            if piece in self.special_tokens:
                out += str(self.target.DecodePieces(run)) + piece + " "
                run = []
            else:
                run.append(piece)
        out += str(self.target.DecodePieces(run))
        return out.replace(PIECE_MARKER, " ").strip()
