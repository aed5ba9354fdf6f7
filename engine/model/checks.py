"""Load-time checks: nothing the loader made runs before it is compared with what it came
from.

Signatures are checked against the known decoder inputs (`classify_decoder`), outputs
against what the layout reads. Every rewrite is then run beside its original on one probe
(`probe_feed`: random inputs shaped from the sessions' own declarations) and accepted only
when the logits agree: the merged file's branches against the merged file, the masks
rewrite against the decoder it came from, the output projection cut apart against the
whole step, and several new tokens after a cache against one no-past call.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from engine.errors import ModelLoadError
from engine.model.config import ModelConfig
from engine.model.names import (
    ATTENTION_MASK,
    CAUSAL_KEY,
    ENCODER_ATTENTION_MASK,
    ENCODER_HIDDEN_STATES,
    INPUT_IDS,
    LOGITS,
    MASK_INPUT,
    PAST,
    POSITIONS_INPUT,
    PRESENT,
    SEQLENS_INPUT,
    TOTAL_INPUT,
    USE_CACHE_BRANCH,
    kv_names,
)

REWRITE_TOLERANCE = 1e-4
"""Largest logit difference accepted between a rewritten decoder and the original."""
KERNEL_INT8_TOLERANCE = 1e-2
"""Largest logit difference, relative to the largest logit, accepted between an int8
graph and its rewrite onto another attention kernel (`passes.inplace`): the kernel's
float arithmetic differs by about 1e-6, which may move one activation across an int8
rounding step before the next quantized product (about 1e-2 of a logit of 5-10 on the
benchmark model); a rewrite wired wrong moves logits by their own size."""
SPLIT_TOLERANCE = 1e-4
"""Largest logit difference accepted between the merged decoder and its branches run apart."""

Probed: TypeAlias = Path | bytes | ort.InferenceSession
"""A graph to probe: a file, a serialised graph, or a session the caller already opened
(with its own options), so that the sessions checked are the ones that will run."""


# -- signatures ---------------------------------------------------------------------------


class Signature(str, Enum):
    """The decoder input sets the loader knows."""

    MERGED = "merged decoder (use_cache_branch, decoder and encoder past)"
    WITH_PAST = "decoder with past (decoder and encoder past)"
    SELF_KV = "decoder with self-attention past only"
    NO_PAST = "decoder without past"


def _expected_inputs(layers: int) -> dict[Signature, set[str]]:
    base = {ENCODER_ATTENTION_MASK, INPUT_IDS}
    dec = set(kv_names(layers, "decoder"))
    enc = set(kv_names(layers, "encoder"))
    return {
        Signature.MERGED: base | {ENCODER_HIDDEN_STATES, USE_CACHE_BRANCH} | dec | enc,
        Signature.WITH_PAST: base | dec | enc,
        Signature.SELF_KV: base | {ENCODER_HIDDEN_STATES} | dec,
        Signature.NO_PAST: base | {ENCODER_HIDDEN_STATES},
    }


def classify_decoder(inputs: set[str], layers: int, where: str) -> Signature:
    """Name a decoder's signature, or fail naming the inputs that do not fit any known one."""
    expected = _expected_inputs(layers)
    for kind, names in expected.items():
        if inputs == names:
            return kind
    if inputs == expected[Signature.WITH_PAST] | {ENCODER_HIDDEN_STATES}:
        return Signature.WITH_PAST
    closest = min(expected, key=lambda k: len(expected[k] ^ inputs))
    missing = sorted(expected[closest] - inputs)
    unexpected = sorted(inputs - expected[closest])
    parts = [f"{where}: unknown decoder signature (closest: {closest.value}, {layers} layers)"]
    if missing:
        parts.append("missing inputs: " + ", ".join(missing))
    if unexpected:
        parts.append("unexpected inputs: " + ", ".join(unexpected))
    raise ModelLoadError("; ".join(parts))


def signature(session: ort.InferenceSession, layers: int, where: str) -> Signature:
    """`classify_decoder` of a session's inputs."""
    return classify_decoder({i.name for i in session.get_inputs()}, layers, where)


def check_encoder(session: ort.InferenceSession, where: str) -> None:
    """Fail unless the encoder takes the source ids and mask, and nothing else."""
    inputs = {i.name for i in session.get_inputs()}
    if inputs != {INPUT_IDS, ATTENTION_MASK}:
        raise ModelLoadError(
            f"{where} must take {INPUT_IDS} and {ATTENTION_MASK}, takes {sorted(inputs)}"
        )


def check_outputs(
    no_past: ort.InferenceSession,
    with_past: ort.InferenceSession | None,
    layers: int,
    *,
    self_kv: bool,
    cross_kv: bool,
    where: str,
) -> None:
    """Fail unless the decoder returns what its layout reads: logits, and where it keeps a
    cache the self KV (`self_kv`) and the encoder KV of the first call (`cross_kv`)."""
    need = {LOGITS}
    if self_kv:
        need |= set(kv_names(layers, "decoder", PRESENT))
    if cross_kv:
        need |= set(kv_names(layers, "encoder", PRESENT))
    have = {o.name for o in no_past.get_outputs()}
    if missing := sorted(need - have):
        raise ModelLoadError(f"{where}: decoder lacks outputs: {', '.join(missing)}")
    if with_past is not None and with_past is not no_past:
        have = {o.name for o in with_past.get_outputs()}
        need = {LOGITS, *kv_names(layers, "decoder", PRESENT)}
        if missing := sorted(need - have):
            raise ModelLoadError(f"{where}: decoder with past lacks outputs: {', '.join(missing)}")


# -- probes -------------------------------------------------------------------------------


def _session(model: Probed) -> ort.InferenceSession:
    if not isinstance(model, Path | bytes):
        return model  # a session already
    so = ort.SessionOptions()
    so.log_severity_level = 3
    source = str(model) if isinstance(model, Path) else model
    return ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])


def _dim(value: Any, default: int) -> int:
    return value if isinstance(value, int) else default


def _float_type(arg: Any) -> type[np.floating[Any]]:
    return np.float16 if arg.type == "tensor(float16)" else np.float32


def probe_feed(
    inputs: Iterable[Any],
    *,
    past_len: int,
    cur_len: int,
    batch: int = 1,
    source_len: int = 5,
    seed: int = 0,
    vocab: int = 8,
) -> dict[str, npt.NDArray[Any]]:
    """Random decoder inputs for ONNX Runtime input descriptions (`NodeArg`s), with an
    all-ones decoder mask and positions `arange(past_len, past_len + cur_len)`; the encoder
    KV has `source_len` positions in a with-past call and none in a no-past one."""
    rng = np.random.default_rng(seed)
    feed: dict[str, npt.NDArray[Any]] = {}
    for arg in inputs:
        name, shape = arg.name, list(arg.shape)
        if name == INPUT_IDS:
            feed[name] = rng.integers(1, max(vocab, 2), (batch, cur_len), dtype=np.int64)
        elif name == ENCODER_ATTENTION_MASK:
            feed[name] = np.ones((batch, source_len), dtype=np.int64)
        elif name == USE_CACHE_BRANCH:
            feed[name] = np.array([past_len > 0])
        elif name == MASK_INPUT:
            feed[name] = np.ones((batch, past_len + cur_len), dtype=np.int64)
        elif name == POSITIONS_INPUT:
            row = np.arange(past_len, past_len + cur_len, dtype=np.int64)
            feed[name] = np.tile(row, (batch, 1))
        elif name == SEQLENS_INPUT:  # every row has the same past (`passes.inplace`)
            feed[name] = np.full(batch, past_len + cur_len - 1, dtype=np.int32)
        elif name == TOTAL_INPUT:
            feed[name] = np.array(past_len + cur_len, dtype=np.int32)
        elif name == ENCODER_HIDDEN_STATES:
            states = (batch, source_len, _dim(shape[-1], 1))
            feed[name] = rng.standard_normal(states).astype(_float_type(arg))
        elif name.startswith(f"{PAST}."):
            length = past_len if ".decoder." in name else (source_len if past_len else 0)
            size = (batch, _dim(shape[1], 1), length, _dim(shape[3], 1))
            feed[name] = rng.standard_normal(size).astype(_float_type(arg))
        else:
            raise ValueError(f"no probe value for decoder input {name!r}")
    return feed


def _run(session: ort.InferenceSession, outputs: list[str], feed: dict[str, Any]) -> list[Any]:
    """Run with the inputs of `feed` the session declares."""
    names = {i.name for i in session.get_inputs()}
    return list(session.run(outputs, {k: v for k, v in feed.items() if k in names}))


def check_rewrite(
    original: Probed,
    rewritten: Probed,
    *,
    past_len: int,
    cur_len: int,
    batch: int = 2,
    seed: int = 0,
    relative: bool = False,
) -> float:
    """Largest logit difference between the original decoder and its rewrite on random
    inputs, the rewrite fed an all-ones mask and consecutive positions; with `relative`,
    divided by the original's largest logit (at least 1).

    `original` may be the merged file (`use_cache_branch` is set from `past_len`) and
    `rewritten` one of its split branches: each session gets the inputs it declares.
    """
    first, second = _session(original), _session(rewritten)
    vocab = second.get_outputs()[0].shape[-1]
    args = {a.name: a for s in (first, second) for a in s.get_inputs()}
    if INPUT_IDS not in args:
        raise ValueError(f"not a decoder: no {INPUT_IDS}")
    feed = probe_feed(
        args.values(),
        past_len=past_len,
        cur_len=cur_len,
        batch=batch,
        seed=seed,
        vocab=min(_dim(vocab, 8), 1000),
    )
    results = [_run(session, [LOGITS], feed)[0] for session in (first, second)]
    worst = float(np.max(np.abs(results[0] - results[1])))
    return worst / max(1.0, float(np.max(np.abs(results[0])))) if relative else worst


def check_encoder_rewrite(original: Probed, rewritten: Probed, seed: int = 0) -> float:
    """Largest difference of the encoder's hidden states between `original` and its
    rewrite, on two rows of random source ids, one of them padded."""
    first, second = _session(original), _session(rewritten)
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 8, (2, 5), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, 3:] = 0
    feed = {INPUT_IDS: ids, ATTENTION_MASK: mask}
    out = first.get_outputs()[0].name
    results = [session.run([out], feed)[0] for session in (first, second)]
    return float(np.max(np.abs(results[0].astype(np.float64) - results[1])))


def check_merged_split(merged: Probed, no_past: Probed, with_past: Probed) -> float:
    """Largest logit difference between the merged decoder and its two branches run apart,
    on a 3-token first call and a cached step."""
    return max(
        check_rewrite(merged, no_past, past_len=0, cur_len=3),
        check_rewrite(merged, with_past, past_len=4, cur_len=1),
    )


def check_cut(
    whole: ort.InferenceSession,
    body: ort.InferenceSession,
    head: ort.InferenceSession,
    hidden: str,
    head_input: str | None = None,
    *,
    past_len: int,
    cur_len: int,
    batch: int = 2,
) -> float:
    """Largest difference over every output between a decoder graph and its two parts (the
    body, then the head on the body's `hidden`, which the head takes as `head_input`:
    default the same name), on a probe of `batch` rows."""
    feed = probe_feed(whole.get_inputs(), past_len=past_len, cur_len=cur_len, batch=batch)
    names = [o.name for o in whole.get_outputs()]
    expected = dict(zip(names, whole.run(names, feed), strict=True))
    rest = [n for n in names if n != LOGITS]
    out = _run(body, [hidden, *rest], feed)
    got = dict(zip(rest, out[1:], strict=True))
    got[LOGITS] = head.run([LOGITS], {head_input or hidden: out[0]})[0]
    return max(float(np.max(np.abs(expected[n] - got[n]), initial=0.0)) for n in names)


def causal_over_new_tokens(
    no_past: ort.InferenceSession,
    with_past: ort.InferenceSession,
    config: ModelConfig,
    quantized: bool,
) -> bool:
    """Whether the rewritten with-past decoder may take several tokens per row after a
    cache: its rewrite found a causal self-attention mask (`CAUSAL_KEY`; a with-past graph
    traced with one token has none) and, in fp32, the logits of three tokens fed after a
    cache equal those of one no-past call over the whole sequence. int8 is not compared
    that way (per call, tokens share a scale; per token, fp32 rounding between the two call
    shapes may still flip an int8 rounding) and rests on the structure."""
    if with_past.get_modelmeta().custom_metadata_map.get(CAUSAL_KEY) != "1":
        return False
    if quantized:
        return True
    layers, total, past = config.decoder_layers, 7, 4
    vocab = min(config.vocab_size, 1000)
    feed = probe_feed(no_past.get_inputs(), past_len=0, cur_len=total, vocab=vocab)
    self_out = kv_names(layers, "decoder", PRESENT)
    cross_out = kv_names(layers, "encoder", PRESENT)
    out = _run(no_past, [LOGITS, *self_out, *cross_out], feed)
    whole, mine, cross = out[0], out[1 : 1 + len(self_out)], out[1 + len(self_out) :]
    feed[INPUT_IDS] = feed[INPUT_IDS][:, past:]
    feed[USE_CACHE_BRANCH] = np.array([True])
    feed[POSITIONS_INPUT] = np.arange(past, total, dtype=np.int64)[None]
    feed.update(zip(kv_names(layers, "decoder"), (a[:, :, :past] for a in mine), strict=True))
    feed.update(zip(kv_names(layers, "encoder"), cross, strict=True))
    cached = _run(with_past, [LOGITS], feed)[0]
    return float(np.max(np.abs(cached - whole[:, past:]))) <= REWRITE_TOLERANCE
