"""The names an Optimum export of Marian uses, and the ones the engine adds: the one table.

File names (the hub, the converter and the loader all read them from here), input and
output names, the inputs the masks rewrite adds, and the metadata keys the rewrites write.
Plain strings only: importing this pulls in no onnx or onnxruntime.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

# -- files --------------------------------------------------------------------------------

ENCODER = "encoder_model"
DECODER = "decoder_model"
"""The split pair's no-past decoder."""
DECODER_WITH_PAST = "decoder_with_past_model"
"""The split pair's with-past decoder."""
DECODER_MERGED = "decoder_model_merged"
"""Both in one graph: an `If` on `use_cache_branch`."""
QUANTIZED_SUFFIX = "_quantized"
FP16_SUFFIX = "_fp16"
ONNX_FOLDER = "onnx"
"""Hub repos keep the files in this folder; local exports at the top."""

DECODER_STEMS: Mapping[str, tuple[str, ...]] = {
    "merged": (DECODER_MERGED,),
    "split": (DECODER, DECODER_WITH_PAST),
}
"""Decoder files by layout, in the order the hub prefers them (the merged file is one
download instead of two)."""
VARIANT_SUFFIX: Mapping[str, str] = {"fp32": "", "int8": QUANTIZED_SUFFIX}
"""The variants a model directory or hub repo is pulled and verified in (fp16 copies are
made here, `engine.conversion.fp16`, for a GPU)."""


def onnx_file(stem: str, quantized: bool = False, fp16: bool = False) -> str:
    """`decoder_model` -> `decoder_model.onnx`, `decoder_model_quantized.onnx` (int8) or
    `decoder_model_fp16.onnx` (`engine.conversion.fp16`)."""
    if quantized and fp16:
        raise ValueError("a file is int8 or fp16, not both")
    return f"{stem}{QUANTIZED_SUFFIX if quantized else FP16_SUFFIX if fp16 else ''}.onnx"


def onnx_dir(model_dir: Path) -> Path:
    """Directory that holds the ONNX files: the model dir itself or its `onnx/` folder."""
    if any(model_dir.glob(f"{ENCODER}*.onnx")):
        return model_dir
    if any((model_dir / ONNX_FOLDER).glob(f"{ENCODER}*.onnx")):
        return model_dir / ONNX_FOLDER
    return model_dir


# -- inputs and outputs -------------------------------------------------------------------

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
"""The encoder's source mask."""
LAST_HIDDEN_STATE = "last_hidden_state"
ENCODER_ATTENTION_MASK = "encoder_attention_mask"
ENCODER_HIDDEN_STATES = "encoder_hidden_states"
USE_CACHE_BRANCH = "use_cache_branch"
LOGITS = "logits"
PAST = "past_key_values"
PRESENT = "present"


def kv_names(layers: int, side: str, prefix: str = PAST) -> list[str]:
    """`past_key_values.{i}.{side}.{key,value}` for every layer (`side`: "decoder" for the
    self-attention KV, "encoder" for the cross-attention KV; `prefix=PRESENT`: the outputs)."""
    return [f"{prefix}.{i}.{side}.{kv}" for i in range(layers) for kv in ("key", "value")]


def is_self_kv(name: str) -> bool:
    """Whether an input is a self-attention cache (`past_key_values.*.decoder.*`)."""
    return name.startswith(f"{PAST}.") and ".decoder." in name


# -- what the engine adds ------------------------------------------------------------------

MASK_INPUT = "decoder_attention_mask"
"""int64 [B, past + cur]: 1 on real positions, 0 on padding slots (the masks rewrite)."""
POSITIONS_INPUT = "decoder_position_ids"
"""int64 [B, cur]: each row's own positions (the masks rewrite)."""

CAUSAL_KEY = "nmt_incremental.causal_over_new_tokens"
"""Metadata of a rewritten decoder: "1" when its self-attention is causal among several
new tokens after a cache (so a step may verify lookahead tokens), "0" when not."""
PER_TOKEN_KEY = "nmt_incremental.int8_per_token"
"""Metadata of a rewritten graph: "1" when every activation quantization is per token."""


# -- KV slots (`engine.model.kv.slots.rewrite`) ------------------------------------------------

SLOT_ROWS = "kv_slot_ids"
"""[rows] int64: the KV slot of each row of a slot-graph call."""
SLOT_SOURCES = "kv_slot_sources"
"""[slots] int64: the prefill row whose keys and values each `SLOT_ROWS` slot gets."""
PREFILL_READS = "prefill_reads"
"""[K] int64: the prefill positions (flat over rows x positions) projected to logits."""
COPY_TARGETS = "kv_slot_targets"
"""[rows] int64: where the slot-copy graph copies each `SLOT_ROWS` slot's state."""
COPY_POSITIONS = "kv_slot_positions"
"""[positions] int64: the positions the slot-copy graph copies."""
BAN_EOS = "next_token_ban_eos"
"""[B, T] bool: rows and positions where eos may not be chosen (short of a minimum)."""
NEXT_IDS = "next_token_ids"
"""[B, T] int64: the argmax of each position's logits, banned tokens excluded."""
NEXT_SCORES = "next_token_scores"
"""[B, T] float32: the log-probability of `NEXT_IDS`."""


# -- self-attention in place (`engine.model.kv.inplace.rewrite`) -------------------------------

SEQLENS_INPUT = "self_kv_lengths"
"""[B] int32: each row's self-attention positions before the step's (where its new one is
written in the buffers of `past_key_values.*.decoder.*`)."""
TOTAL_INPUT = "self_kv_total_length"
"""int32 scalar: the longest row's positions after the step."""


def slot_names(layers: int, side: str, *, out: bool = False) -> list[str]:
    """The KV slot buffers of `side` ("decoder": self-attention, "encoder": cross), in
    `kv_names` order; `out`: the names under which a graph returns them updated."""
    prefix = "kv_slots_out" if out else "kv_slots"
    return [name.replace(PAST, prefix, 1) for name in kv_names(layers, side)]
