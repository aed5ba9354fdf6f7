"""ONNX Runtime sessions for an Optimum-layout MarianMT export.

This is the bottom layer: it knows file names and input/output signatures, and offers three
calls (`encode`, `decode_first`, `decode_next`). Decoding strategies live above it.

The decoder export comes in several shapes; we detect which from the ONNX signatures, never
from file names alone, and each has its own class that says what its calls are fed and
return (`MergedLayout`, `SplitLayout`, `SelfKvOnlyLayout`, `NoCacheLayout`; `MaskedDecoder`
is the batchable rewrite of the first two):

- MERGED: `decoder_model_merged.onnx`, an `If` on `use_cache_branch`, decoder and encoder KV.
- SPLIT: `decoder_model.onnx` (no past) + `decoder_with_past_model.onnx`.
- SELF_KV_ONLY: a decoder taking its own KV but no encoder KV; cross-attention is recomputed
  from `encoder_hidden_states` at every step.
- NO_CACHE: a decoder with no past at all; every step re-runs the whole target prefix.

Cross-attention KV: only the first decoder call (no-past branch) returns real
`present.*.encoder.*`. We keep those arrays for the whole decode and feed them at every later
step; later calls are never asked for their (empty) encoder presents.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections import Counter
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from engine.errors import ModelLoadError
from engine.model.config import ModelConfig
from engine.model.passes.merged_split import split_merged

log = logging.getLogger(__name__)

SPLIT_TOLERANCE = 1e-4
"""Largest logit difference accepted between the merged decoder and its branches run apart."""

FloatArray = npt.NDArray[np.float32]
IntArray = npt.NDArray[np.int64]

ENCODER = "encoder_model"
DECODER_MERGED = "decoder_model_merged"
DECODER = "decoder_model"
DECODER_WITH_PAST = "decoder_with_past_model"
QUANTIZED_SUFFIX = "_quantized"


class DecoderLayout(str, Enum):
    """How the decoder export handles its KV cache."""

    MERGED = "merged"
    SPLIT = "split"
    SELF_KV_ONLY = "self_kv_only"
    NO_CACHE = "no_cache"


@dataclass(frozen=True)
class RuntimeOptions:
    """How to open a model: which files, which cache mode, how many threads.

    `prefer_split`: run the split pair rather than the merged decoder, whose `If` costs
    5-11% per token: the split files when present, else the merged file's two branches cut
    apart at load (needs the `onnx` package; checked against the merged graph first).
    `batchable`: also load the decoders rewritten to take a per-row self-attention mask and
    position ids (`engine.model.batched_decoder`, checked against the originals), so that rows of
    different decoder lengths share a call (continuous batching); without them, or when
    the rewrite fails, rows are batched only when they start together (lockstep).
    `head_threads`: threads of the batchable step's output projection, run as a session of
    its own when this differs from `intra_op_threads` (see `_split_head`); the scheduler
    sets both (`SchedulerOptions`).
    `int8_per_token`: run int8 files with their activations quantized per token
    (`engine.model.passes.per_token`), so that a token's values do not depend on what else
    shares its call (batch mates, padding, a forced prefix): batching is then exact in
    int8 too. One-token calls give the files' own values either way, so a one-row step of
    the batchable layout runs the files' quantization (fused kernels, ~25% faster at one
    row; lockstep layouts run every call per token). Off: the files as they are (needs
    the `onnx` package; without it, as if off).
    """

    quantized: bool = False
    use_cache: bool = True
    prefer_split: bool = True
    intra_op_threads: int | None = None
    allow_spinning: bool = False
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    batchable: bool = True
    head_threads: int | None = None
    int8_per_token: bool = True

    @property
    def per_token(self) -> bool:
        """Whether int8 activations are quantized per token (see `int8_per_token`)."""
        return self.quantized and self.int8_per_token


def onnx_dir(model_dir: Path) -> Path:
    """Directory that holds the ONNX files: the model dir itself or its `onnx/` folder."""
    if any(model_dir.glob(f"{ENCODER}*.onnx")):
        return model_dir
    if any((model_dir / "onnx").glob(f"{ENCODER}*.onnx")):
        return model_dir / "onnx"
    return model_dir


def _past_names(layers: int, kind: str, prefix: str = "past_key_values") -> list[str]:
    return [f"{prefix}.{i}.{kind}.{kv}" for i in range(layers) for kv in ("key", "value")]


class _Signature(str, Enum):
    MERGED = "merged decoder (use_cache_branch, decoder and encoder past)"
    WITH_PAST = "decoder with past (decoder and encoder past)"
    SELF_KV = "decoder with self-attention past only"
    NO_PAST = "decoder without past"


def _expected_inputs(layers: int) -> dict[_Signature, set[str]]:
    base = {"encoder_attention_mask", "input_ids"}
    dec = set(_past_names(layers, "decoder"))
    enc = set(_past_names(layers, "encoder"))
    return {
        _Signature.MERGED: base | {"encoder_hidden_states", "use_cache_branch"} | dec | enc,
        _Signature.WITH_PAST: base | dec | enc,
        _Signature.SELF_KV: base | {"encoder_hidden_states"} | dec,
        _Signature.NO_PAST: base | {"encoder_hidden_states"},
    }


def classify_decoder(inputs: set[str], layers: int, where: str) -> _Signature:
    """Name a decoder's signature, or fail naming the inputs that do not fit any known one."""
    expected = _expected_inputs(layers)
    for kind, names in expected.items():
        if inputs == names:
            return kind
    if inputs == expected[_Signature.WITH_PAST] | {"encoder_hidden_states"}:
        return _Signature.WITH_PAST
    closest = min(expected, key=lambda k: len(expected[k] ^ inputs))
    missing = sorted(expected[closest] - inputs)
    unexpected = sorted(inputs - expected[closest])
    parts = [f"{where}: unknown decoder signature (closest: {closest.value}, {layers} layers)"]
    if missing:
        parts.append("missing inputs: " + ", ".join(missing))
    if unexpected:
        parts.append("unexpected inputs: " + ", ".join(unexpected))
    raise ModelLoadError("; ".join(parts))


@dataclass(frozen=True)
class EncoderOutput:
    """Encoder states for a batch of sources, plus the mask the decoder attends with."""

    hidden_states: FloatArray
    attention_mask: IntArray

    @property
    def batch_size(self) -> int:
        return int(self.hidden_states.shape[0])

    def select(self, rows: IntArray) -> EncoderOutput:
        return EncoderOutput(self.hidden_states[rows], self.attention_mask[rows])


@dataclass(frozen=True)
class DecoderCache:
    """Everything the next decoder step needs besides the new token.

    `self_kv` grows every step; `cross_kv` is the step-0 encoder KV, reused unchanged;
    `tokens` is the whole decoder input so far (the no-cache mode re-feeds it).
    """

    self_kv: tuple[FloatArray, ...]
    cross_kv: tuple[FloatArray, ...]
    tokens: IntArray

    @property
    def length(self) -> int:
        return int(self.tokens.shape[1])

    def select(self, rows: IntArray) -> DecoderCache:
        """Rows of the cache, in the given order (beam reordering, dropping finished rows)."""
        return DecoderCache(
            tuple(a[rows] for a in self.self_kv),
            tuple(a[rows] for a in self.cross_kv),
            self.tokens[rows],
        )


def _session_options(options: RuntimeOptions) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    threads = options.intra_op_threads
    if threads is None and (env := os.environ.get("NMT_INTRA_OP_THREADS")):
        threads = int(env)
    if threads:
        so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    if not options.allow_spinning:
        # Busy-waiting worker threads only pay off on otherwise idle cores; on a shared box
        # or with several streams decoding at once they fight for the CPU (measured: 14.2
        # -> 4.9 ms/token for int8 with another job running).
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


def _graph(source: Path | bytes, options: RuntimeOptions, name: str) -> str | bytes:
    """What a session of `source` is opened from: its int8 activations quantized per token
    where `options.per_token` says so and the graph allows it, else the graph as it is."""
    if options.per_token:
        from engine.model.passes.per_token import per_token_graph

        rewritten = per_token_graph(source, name)
        if rewritten is not None:
            return rewritten
    return str(source) if isinstance(source, Path) else source


def _open_session(
    path: Path, model_dir: Path, options: RuntimeOptions, *, decoder: bool = True
) -> ort.InferenceSession:
    """A session of `path`; a decoder's int8 activations per token (`_graph`), the
    encoder's as in the file (`MarianOnnx.encode` runs its rows apart instead)."""
    if not path.is_file():
        raise ModelLoadError(f"{model_dir}: missing {path.name}")
    try:
        return ort.InferenceSession(
            _graph(path, options, f"{model_dir}: {path.name}") if decoder else str(path),
            _session_options(options),
            providers=list(options.providers),
        )
    except Exception as exc:  # onnxruntime raises its own exception types for bad files
        raise ModelLoadError(f"{model_dir}: cannot load {path.name}: {exc}") from exc


class MarianOnnx:
    """Encoder and decoder sessions of one model, with the KV-cache bookkeeping."""

    def __init__(self, model_dir: Path, config: ModelConfig, options: RuntimeOptions) -> None:
        self.model_dir = model_dir
        self.config = config
        self.options = options
        self.calls: Counter[str] = Counter()
        files = onnx_dir(model_dir)
        suffix = QUANTIZED_SUFFIX if options.quantized else ""

        def path(stem: str) -> Path:
            return files / f"{stem}{suffix}.onnx"

        # Which ONNX files this model runs, by role (encoder / first / step).
        self.files: dict[str, Path] = {"encoder": path(ENCODER)}

        self.encoder = _open_session(path(ENCODER), model_dir, options, decoder=False)
        enc_inputs = {i.name for i in self.encoder.get_inputs()}
        if enc_inputs != {"input_ids", "attention_mask"}:
            raise ModelLoadError(
                f"{model_dir}: {path(ENCODER).name} must take input_ids and attention_mask, "
                f"takes {sorted(enc_inputs)}"
            )
        self.layers = config.decoder_layers
        self.split_at_load = False  # the merged file's two branches run as the split pair
        self.first: ort.InferenceSession
        self.step: ort.InferenceSession | None = None
        merged, single, with_past = path(DECODER_MERGED), path(DECODER), path(DECODER_WITH_PAST)
        use_merged = merged.is_file() and not (
            options.prefer_split and single.is_file() and with_past.is_file()
        )
        if use_merged:
            self.first = _open_session(merged, model_dir, options)
            kind = self._classify(self.first, merged)
            layout = {
                _Signature.MERGED: DecoderLayout.MERGED,
                _Signature.SELF_KV: DecoderLayout.SELF_KV_ONLY,
                _Signature.NO_PAST: DecoderLayout.NO_CACHE,
            }.get(kind)
            if layout is None:
                raise ModelLoadError(
                    f"{model_dir}: {merged.name} has the signature of a {kind.value}"
                )
            if layout is not DecoderLayout.NO_CACHE:
                self.step = self.first
            if layout is DecoderLayout.MERGED and options.prefer_split and options.use_cache:
                split = self._split_at_load(merged, options)
                if split is not None:
                    self.first, self.step = split
                    layout = DecoderLayout.SPLIT
                    self.split_at_load = True
        elif single.is_file():
            self.first = _open_session(single, model_dir, options)
            kind = self._classify(self.first, single)
            if kind is _Signature.SELF_KV:
                layout = DecoderLayout.SELF_KV_ONLY
                self.step = self.first
            elif kind is _Signature.NO_PAST and with_past.is_file() and options.use_cache:
                layout = DecoderLayout.SPLIT
                self.step = _open_session(with_past, model_dir, options)
                step_kind = self._classify(self.step, with_past)
                if step_kind is not _Signature.WITH_PAST:
                    raise ModelLoadError(
                        f"{model_dir}: {with_past.name} has the signature of a {step_kind.value}"
                    )
            elif kind is _Signature.NO_PAST:
                layout = DecoderLayout.NO_CACHE
            else:
                raise ModelLoadError(
                    f"{model_dir}: {single.name} has the signature of a {kind.value}"
                )
        else:
            raise ModelLoadError(
                f"{model_dir}: missing decoder: expected {merged.name}, or {single.name} "
                f"(with {with_past.name}) in {files}"
            )
        self.files["first"] = merged if use_merged else single
        if self.step is not None:
            split_files = self.step is not self.first and not self.split_at_load
            self.files["step"] = with_past if split_files else self.files["first"]
        self.native_layout = layout
        self.layout = layout if options.use_cache else DecoderLayout.NO_CACHE
        self._check_outputs()
        self._input_types = {i.name: i.type for i in self.first.get_inputs()}
        self.float_type = (
            np.float16
            if self._input_types.get("encoder_hidden_states") == "tensor(float16)"
            else np.float32
        )
        # One class per layout says what each call is fed and returns.
        native = _LAYOUTS[layout](self.first, self.step, config, self.float_type, self.calls)
        self.decoder: LayoutDecoder = (
            native if self.layout is not DecoderLayout.NO_CACHE else NoCacheLayout(native)
        )
        self.masked: MaskedDecoder | None = None
        if options.batchable and self.layout in (DecoderLayout.MERGED, DecoderLayout.SPLIT):
            assert self.step is not None
            originals = (self.first, self.step)
            self.masked = MaskedDecoder.load(model_dir, config, options, self.calls, originals)
            if self.masked is not None:
                # Checked equal to the originals: every call goes through the rewrite from
                # here on and the original decoder sessions (a second copy of the
                # decoder's weights) are let go.
                self.decoder = MaskedLayout(self.masked, config, self.float_type, self.calls)
                self.first, self.step = self.masked.first, self.masked.step_session
                del originals, native  # the last references to the original sessions
                _release_freed_memory()

    @property
    def int8_activations(self) -> str | None:
        """How the decoder quantizes int8 activations: "per token" (rows exact in any
        batch, `RuntimeOptions.int8_per_token`) or "per call" (the files' own, when turned
        off or the graph could not be rewritten); None for fp32."""
        if not self.options.quantized:
            return None
        from engine.model.passes.per_token import PER_TOKEN_KEY

        if self.masked is not None:
            per_token = self.masked.one is not None
        else:
            per_token = PER_TOKEN_KEY in self.first.get_modelmeta().custom_metadata_map
        return "per token" if per_token else "per call"

    @property
    def batching(self) -> str:
        """How requests share decoder calls: `continuous` (rows join and leave at any
        step: the rewritten decoder) or `lockstep` (rows that start together)."""
        return "continuous" if self.masked is not None else "lockstep"

    def _split_at_load(
        self, merged: Path, options: RuntimeOptions
    ) -> tuple[ort.InferenceSession, ort.InferenceSession] | None:
        """The merged decoder's branches as the split pair (no `If` per step), if they can
        be cut out and give the merged graph's logits on a probe; else None (logged)."""
        parts = split_merged(merged)
        if parts is None:
            return None
        so = _session_options(options)
        providers = list(options.providers)
        name = f"{self.model_dir}: {merged.name}"
        first = ort.InferenceSession(_graph(parts[0], options, name), so, providers=providers)
        step = ort.InferenceSession(_graph(parts[1], options, name), so, providers=providers)
        if self._classify(first, merged) is not _Signature.NO_PAST or (
            self._classify(step, merged) is not _Signature.WITH_PAST
        ):
            return None
        worst = self._probe_difference(first, step)
        if worst > SPLIT_TOLERANCE:
            log.warning(
                "%s: its branches, run apart, differ from the merged decoder by %.3g "
                "(tolerance %g): keeping the merged file",
                merged.name,
                worst,
                SPLIT_TOLERANCE,
            )
            return None
        return first, step

    def _probe_difference(self, first: ort.InferenceSession, step: ort.InferenceSession) -> float:
        """Largest logit difference between the merged session and the pair, on a short
        source, a 3-token first call and one cached step."""
        cfg = self.config
        ids = np.array([[min(5 + i, cfg.vocab_size - 1) for i in range(4)] + [cfg.eos_token_id]])
        mask = np.ones_like(ids)
        states = self.encoder.run(None, {"input_ids": ids, "attention_mask": mask})[0]
        start = cfg.decoder_start_token_id
        tokens = np.array([[start, min(7, cfg.vocab_size - 1), min(9, cfg.vocab_size - 1)]])
        merged = self.first
        past_in = [i.name for i in merged.get_inputs() if i.name.startswith("past_key_values")]
        heads, dim = cfg.decoder_attention_heads, cfg.head_dim
        empty = np.zeros((1, heads, 0, dim), dtype=states.dtype)
        base = {"encoder_attention_mask": mask, "input_ids": tokens}
        m_out = merged.run(
            None,
            {
                **base,
                "encoder_hidden_states": states,
                "use_cache_branch": np.zeros((1,), dtype=np.bool_),
                **dict.fromkeys(past_in, empty),
            },
        )
        m = dict(zip([o.name for o in merged.get_outputs()], m_out, strict=True))
        f_names = {i.name for i in first.get_inputs()}
        f_feed = {"encoder_hidden_states": states, **base}
        f = dict(
            zip(
                [o.name for o in first.get_outputs()],
                first.run(None, {k: v for k, v in f_feed.items() if k in f_names}),
                strict=True,
            )
        )
        worst = float(np.max(np.abs(m["logits"] - f["logits"])))
        nxt = np.array([[min(11, cfg.vocab_size - 1)]])
        past = {name: m[name.replace("past_key_values", "present")] for name in past_in}
        m_step = merged.run(
            ["logits"],
            {
                "encoder_attention_mask": mask,
                "input_ids": nxt,
                "encoder_hidden_states": np.zeros((1, 0, cfg.d_model), dtype=states.dtype),
                "use_cache_branch": np.ones((1,), dtype=np.bool_),
                **past,
            },
        )[0]
        s_names = {i.name for i in step.get_inputs()}
        s_feed = {"encoder_attention_mask": mask, "input_ids": nxt, **past}
        s_step = step.run(["logits"], {k: v for k, v in s_feed.items() if k in s_names})[0]
        return max(worst, float(np.max(np.abs(m_step - s_step))))

    def _classify(self, session: ort.InferenceSession, path: Path) -> _Signature:
        names = {i.name for i in session.get_inputs()}
        return classify_decoder(names, self.layers, f"{self.model_dir}: {path.name}")

    def _check_outputs(self) -> None:
        need_first = {"logits"}
        if self.layout is not DecoderLayout.NO_CACHE:
            need_first |= set(_past_names(self.layers, "decoder", "present"))
        if self.layout in (DecoderLayout.MERGED, DecoderLayout.SPLIT):
            need_first |= set(_past_names(self.layers, "encoder", "present"))
        have = {o.name for o in self.first.get_outputs()}
        if missing := sorted(need_first - have):
            raise ModelLoadError(f"{self.model_dir}: decoder lacks outputs: {', '.join(missing)}")
        if self.step is not None and self.step is not self.first:
            have_step = {o.name for o in self.step.get_outputs()}
            need_step = {"logits", *_past_names(self.layers, "decoder", "present")}
            if missing := sorted(need_step - have_step):
                raise ModelLoadError(
                    f"{self.model_dir}: decoder with past lacks outputs: {', '.join(missing)}"
                )

    # -- calls ---------------------------------------------------------------------------

    def encode(self, input_ids: IntArray, attention_mask: IntArray) -> EncoderOutput:
        """Run the encoder for a (padded) batch of sources: in one call, or, for int8 per
        token (`RuntimeOptions.int8_per_token`), one call per source without its padding,
        so that each gets what it gets alone, the file's own values.

        Why not the encoder quantized per token, like the decoder: measured on the
        OPUS-MT-size int8 encoder (2-core AMD EPYC, 30 tokens), one source 2.5 ms as in
        the file against 4.8 per token, and four sources one by one 10.9 ms against 11.4
        per token in one call (the file's single call: 7.0, but not each row's values);
        a source's tokens quantized together are also what the file gives it."""
        if not self.options.per_token or input_ids.shape[0] == 1:
            self.calls["encoder"] += 1
            (hidden,) = self.encoder.run(
                ["last_hidden_state"], {"input_ids": input_ids, "attention_mask": attention_mask}
            )
            return EncoderOutput(hidden, attention_mask)
        hidden = None
        for row in range(input_ids.shape[0]):
            real = attention_mask[row].astype(bool)
            ids = input_ids[row, real][None]
            self.calls["encoder"] += 1
            (states,) = self.encoder.run(
                ["last_hidden_state"], {"input_ids": ids, "attention_mask": np.ones_like(ids)}
            )
            if hidden is None:  # padding positions stay 0: masked out, and finite
                hidden = np.zeros((*input_ids.shape, states.shape[-1]), dtype=states.dtype)
            hidden[row, real] = states[0]
        assert hidden is not None
        return EncoderOutput(hidden, attention_mask)

    def decode_first(
        self, enc: EncoderOutput, input_ids: IntArray
    ) -> tuple[FloatArray, DecoderCache]:
        """First decoder call: start token plus any forced prefix, all in one call.

        Returns logits [B, T, V] and the cache, whose encoder KV stays fixed from here on.
        """
        return self.decoder.first_call(enc, input_ids)

    def decode_next(
        self, enc: EncoderOutput, cache: DecoderCache, input_ids: IntArray
    ) -> tuple[FloatArray, DecoderCache]:
        """One more token per row ([B, 1]); returns last-position logits [B, V] and the cache."""
        return self.decoder.next_call(enc, cache, input_ids)


class _Names:
    """The KV input and output names of a decoder with `layers` layers."""

    def __init__(self, layers: int) -> None:
        self.self_in = _past_names(layers, "decoder")
        self.cross_in = _past_names(layers, "encoder")
        self.self_out = _past_names(layers, "decoder", "present")
        self.cross_out = _past_names(layers, "encoder", "present")


class LayoutDecoder:
    """One decoder layout's calls: what its first call is fed and returns, and what every
    later call is fed. One subclass per layout (`MergedLayout`, `SplitLayout`,
    `SelfKvOnlyLayout`, `NoCacheLayout`; the batchable rewrite is `MaskedDecoder`), chosen
    by `MarianOnnx` from the signatures, so no call site switches on the layout."""

    layout: DecoderLayout

    def __init__(
        self,
        first: ort.InferenceSession,
        step: ort.InferenceSession | None,
        config: ModelConfig,
        float_type: type[np.floating[Any]],
        calls: Counter[str],
    ) -> None:
        self.first = first
        self.step = step
        self.config = config
        self.float_type = float_type
        self.calls = calls
        self.names = _Names(config.decoder_layers)
        self.step_inputs = set() if step is None else {i.name for i in step.get_inputs()}

    def _run(
        self, session: ort.InferenceSession, outputs: list[str], feed: dict[str, Any]
    ) -> list[Any]:
        self.calls["decoder"] += 1
        return list(session.run(outputs, feed))

    def _empty(self, batch: int) -> FloatArray:
        heads, dim = self.config.decoder_attention_heads, self.config.head_dim
        return np.zeros((batch, heads, 0, dim), dtype=self.float_type)

    def first_feed(self, enc: EncoderOutput, input_ids: IntArray) -> dict[str, Any]:
        """What the first (no-past) call is fed."""
        return {
            "encoder_attention_mask": enc.attention_mask,
            "input_ids": input_ids,
            "encoder_hidden_states": enc.hidden_states,
        }

    def first_call(
        self, enc: EncoderOutput, input_ids: IntArray
    ) -> tuple[FloatArray, DecoderCache]:
        """Logits [B, T, V] and the cache: the self KV, and the encoder KV that every later
        call is fed (only this call's `present.*.encoder.*` are real)."""
        names = self.names
        out = self._run(
            self.first,
            ["logits", *names.self_out, *names.cross_out],
            self.first_feed(enc, input_ids),
        )
        n = len(names.self_out)
        return out[0], DecoderCache(tuple(out[1 : 1 + n]), tuple(out[1 + n :]), input_ids)

    def next_feed(
        self, enc: EncoderOutput, cache: DecoderCache, input_ids: IntArray
    ) -> dict[str, Any]:
        """What a later call is fed: the new token, the self KV, the step-0 encoder KV."""
        feed: dict[str, Any] = {
            "encoder_attention_mask": enc.attention_mask,
            "input_ids": input_ids,
        }
        feed.update(zip(self.names.self_in, cache.self_kv, strict=True))
        if cache.cross_kv:  # the encoder KV of the first call, unless the layout has none
            feed.update(zip(self.names.cross_in, cache.cross_kv, strict=True))
        return feed

    def next_call(
        self, enc: EncoderOutput, cache: DecoderCache, input_ids: IntArray
    ) -> tuple[FloatArray, DecoderCache]:
        """One token per row: last-position logits [B, V] and the cache grown by it."""
        assert self.step is not None
        tokens = np.concatenate([cache.tokens, input_ids], axis=1)
        out = self._run(
            self.step, ["logits", *self.names.self_out], self.next_feed(enc, cache, input_ids)
        )
        return out[0][:, -1, :], DecoderCache(tuple(out[1:]), cache.cross_kv, tokens)


class SplitLayout(LayoutDecoder):
    """`decoder_model.onnx` (no past) then `decoder_with_past_model.onnx`. A with-past file
    that also declares `encoder_hidden_states` gets them, besides the encoder KV."""

    layout = DecoderLayout.SPLIT

    def next_feed(
        self, enc: EncoderOutput, cache: DecoderCache, input_ids: IntArray
    ) -> dict[str, Any]:
        feed = super().next_feed(enc, cache, input_ids)
        if "encoder_hidden_states" in self.step_inputs:
            feed["encoder_hidden_states"] = enc.hidden_states
        return feed


class MergedLayout(LayoutDecoder):
    """`decoder_model_merged.onnx`: one `If` on `use_cache_branch`; both branches declare
    every input, so the first call gets empty pasts and later ones zero-length states."""

    layout = DecoderLayout.MERGED

    def first_feed(self, enc: EncoderOutput, input_ids: IntArray) -> dict[str, Any]:
        feed = super().first_feed(enc, input_ids)
        feed["use_cache_branch"] = np.zeros((1,), dtype=np.bool_)
        for name in (*self.names.self_in, *self.names.cross_in):
            feed[name] = self._empty(input_ids.shape[0])
        return feed

    def next_feed(
        self, enc: EncoderOutput, cache: DecoderCache, input_ids: IntArray
    ) -> dict[str, Any]:
        feed = super().next_feed(enc, cache, input_ids)
        feed["use_cache_branch"] = np.ones((1,), dtype=np.bool_)
        # Ignored on the cached branch, but the graph still declares the input.
        batch = input_ids.shape[0]
        feed["encoder_hidden_states"] = np.zeros(
            (batch, 0, self.config.d_model), dtype=self.float_type
        )
        return feed


class SelfKvOnlyLayout(LayoutDecoder):
    """A decoder with its own KV but no encoder KV: cross-attention is recomputed from
    `encoder_hidden_states` at every step, so there is no encoder KV to keep."""

    layout = DecoderLayout.SELF_KV_ONLY

    def first_feed(self, enc: EncoderOutput, input_ids: IntArray) -> dict[str, Any]:
        feed = super().first_feed(enc, input_ids)
        for name in self.names.self_in:
            feed[name] = self._empty(input_ids.shape[0])
        return feed

    def first_call(
        self, enc: EncoderOutput, input_ids: IntArray
    ) -> tuple[FloatArray, DecoderCache]:
        out = self._run(
            self.first, ["logits", *self.names.self_out], self.first_feed(enc, input_ids)
        )
        return out[0], DecoderCache(tuple(out[1:]), (), input_ids)

    def next_feed(
        self, enc: EncoderOutput, cache: DecoderCache, input_ids: IntArray
    ) -> dict[str, Any]:
        feed = super().next_feed(enc, cache, input_ids)
        feed["encoder_hidden_states"] = enc.hidden_states
        return feed


class NoCacheLayout(LayoutDecoder):
    """No KV cache: every call re-runs the whole target prefix through the first graph
    (a decoder exported without past, or `use_cache=False` on any layout, fed as its
    native layout's first call)."""

    layout = DecoderLayout.NO_CACHE

    def __init__(self, native: LayoutDecoder) -> None:
        super().__init__(native.first, None, native.config, native.float_type, native.calls)
        self.native = native

    def first_feed(self, enc: EncoderOutput, input_ids: IntArray) -> dict[str, Any]:
        return self.native.first_feed(enc, input_ids)

    def first_call(
        self, enc: EncoderOutput, input_ids: IntArray
    ) -> tuple[FloatArray, DecoderCache]:
        (logits,) = self._run(self.first, ["logits"], self.first_feed(enc, input_ids))
        return logits, DecoderCache((), (), input_ids)

    def next_call(
        self, enc: EncoderOutput, cache: DecoderCache, input_ids: IntArray
    ) -> tuple[FloatArray, DecoderCache]:
        tokens = np.concatenate([cache.tokens, input_ids], axis=1)
        logits, _ = self.first_call(enc, tokens)
        return logits[:, -1, :], DecoderCache((), (), tokens)


class MaskedLayout(LayoutDecoder):
    """The batchable rewrite (`MaskedDecoder`) run as a plain layout, for calls whose rows
    all have the same length (lockstep batches, `engine.decoding.search.search`): an all-ones
    mask and consecutive positions, with which it gives the original graphs' logits."""

    def __init__(
        self,
        masked: MaskedDecoder,
        config: ModelConfig,
        float_type: type[np.floating[Any]],
        calls: Counter[str],
    ) -> None:
        super().__init__(masked.first, masked.step_session, config, float_type, calls)
        self.masked = masked

    def first_call(
        self, enc: EncoderOutput, input_ids: IntArray
    ) -> tuple[FloatArray, DecoderCache]:
        mask = np.ones(input_ids.shape, dtype=np.int64)
        logits, self_kv, cross_kv = self.masked.prefill(enc, input_ids, mask)
        return logits, DecoderCache(self_kv, cross_kv, input_ids)

    def next_call(
        self, enc: EncoderOutput, cache: DecoderCache, input_ids: IntArray
    ) -> tuple[FloatArray, DecoderCache]:
        batch, past = input_ids.shape[0], cache.length
        mask = np.ones((batch, past + 1), dtype=np.int64)
        positions = np.full((batch, 1), past, dtype=np.int64)
        logits, self_kv = self.masked.step(
            enc, input_ids, positions, mask, cache.self_kv, cache.cross_kv
        )
        tokens = np.concatenate([cache.tokens, input_ids], axis=1)
        return logits, DecoderCache(self_kv, cache.cross_kv, tokens)


_LAYOUTS: dict[DecoderLayout, type[LayoutDecoder]] = {
    DecoderLayout.MERGED: MergedLayout,
    DecoderLayout.SPLIT: SplitLayout,
    DecoderLayout.SELF_KV_ONLY: SelfKvOnlyLayout,
    DecoderLayout.NO_CACHE: SplitLayout,  # a no-past file is fed like the split pair's first
}


def _split_head(
    model_dir: Path,
    step_graph: bytes,
    step: ort.InferenceSession,
    config: ModelConfig,
    options: RuntimeOptions,
    past_len: int = 4,
    cur_len: int = 1,
    always: bool = False,
) -> tuple[ort.InferenceSession, tuple[ort.InferenceSession, str]] | None:
    """A decoder graph (the with-past step unless `always`) as two sessions, its body on the
    lane's threads and its output projection on `options.head_threads`, when those
    differ; None (the session stays whole) when they do not, or when the graph cannot be
    cut or the cut pair does not give `step`'s outputs (one log line).

    Why: at one row the step is ~450 ops of a few microseconds and one large matmul (the
    vocabulary projection, 60% of the weights read). An intra-op thread pool wakes its
    workers for every op it splits, which costs more than the small ops gain, while the
    projection runs ~1.7x faster on two cores. Measured on the OPUS-MT-sized int8 model
    (2-core AMD EPYC): step 2.6-2.8 ms whole on two threads, 2.2-2.6 ms cut (body on one
    thread, head on two); one thread whole 2.3-2.9 ms.

    `always`: cut even where the threads are the same (the head then on the body's), for a
    no-past graph whose logits are needed at a few of its positions only (`prefill`);
    `past_len` / `cur_len` shape the probe.
    """
    threads, body_threads = options.head_threads, options.intra_op_threads
    apart = bool(threads and body_threads and threads > body_threads)
    if not apart and not always:
        return None
    threads = threads if apart else body_threads
    what = "prefill" if past_len == 0 else "step"
    from engine.model.batched_decoder import REWRITE_TOLERANCE, probe_feed, split_output_projection

    try:
        split = split_output_projection(step_graph, config.vocab_size)
        if split is None:
            log.info(
                "%s: output projection not cut from the %s (unexpected graph)", model_dir, what
            )
            return None
        providers = list(options.providers)
        body = ort.InferenceSession(split.body, _session_options(options), providers=providers)
        head_options = _session_options(replace(options, intra_op_threads=threads or None))
        head = ort.InferenceSession(split.head, head_options, providers=providers)
        feed = probe_feed(step.get_inputs(), past_len=past_len, cur_len=cur_len, batch=2)
        names = [o.name for o in step.get_outputs()]
        whole = dict(zip(names, step.run(names, feed), strict=True))
        rest = [n for n in names if n != "logits"]
        cut = body.run([split.hidden, *rest], {i.name: feed[i.name] for i in body.get_inputs()})
        parts = dict(zip(rest, cut[1:], strict=True))
        parts["logits"] = head.run(["logits"], {split.hidden: cut[0]})[0]
        worst = max(float(np.max(np.abs(whole[n] - parts[n]), initial=0.0)) for n in names)
    except Exception as exc:  # a graph the cut did not foresee: keep the step whole
        log.warning("%s: output projection not cut from the %s (%s)", model_dir, what, exc)
        return None
    if not worst <= REWRITE_TOLERANCE:
        log.warning(
            "%s: %s cut at the output projection differs by %.3g: kept whole",
            model_dir,
            what,
            worst,
        )
        return None
    return body, (head, split.hidden)


def _causal_over_new_tokens(
    first: ort.InferenceSession,
    step: ort.InferenceSession,
    config: ModelConfig,
    options: RuntimeOptions,
) -> bool:
    """Whether the rewritten step may take several tokens per row after a cache: its
    rewrite found a causal self-attention mask (`CAUSAL_KEY`; a with-past graph traced
    with one token has none) and, in fp32, the logits of three tokens fed after a cache
    equal those of one no-past call over the whole sequence. int8 is not compared that way
    (per call, tokens share a scale; per token, fp32 rounding between the two call shapes
    may still flip an int8 rounding) and rests on the structure."""
    from engine.model.batched_decoder import (
        CAUSAL_KEY,
        MASK_INPUT,
        POSITIONS_INPUT,
        REWRITE_TOLERANCE,
    )

    if step.get_modelmeta().custom_metadata_map.get(CAUSAL_KEY) != "1":
        return False
    if options.quantized:
        return True
    rng = np.random.default_rng(0)
    layers, total, past = config.decoder_layers, 7, 4
    ids = rng.integers(1, min(config.vocab_size, 1000), (1, total), dtype=np.int64)
    values: dict[str, Any] = {
        "input_ids": ids,
        "encoder_hidden_states": rng.standard_normal((1, 5, config.d_model)).astype(np.float32),
        "encoder_attention_mask": np.ones((1, 5), dtype=np.int64),
        MASK_INPUT: np.ones((1, total), dtype=np.int64),
        POSITIONS_INPUT: np.arange(total, dtype=np.int64)[None],
        "use_cache_branch": np.array([False]),
    }
    self_out, cross_out = (
        _past_names(layers, "decoder", "present"),
        _past_names(layers, "encoder", "present"),
    )
    names = {i.name for i in first.get_inputs()}
    out = first.run(
        ["logits", *self_out, *cross_out], {k: v for k, v in values.items() if k in names}
    )
    whole, kv = out[0], out[1:]
    values.update(input_ids=ids[:, past:], use_cache_branch=np.array([True]))
    values[POSITIONS_INPUT] = np.arange(past, total, dtype=np.int64)[None]
    mine, cross = kv[: len(self_out)], kv[len(self_out) :]
    values.update(zip(_past_names(layers, "decoder"), (a[:, :, :past] for a in mine), strict=True))
    values.update(zip(_past_names(layers, "encoder"), cross, strict=True))
    names = {i.name for i in step.get_inputs()}
    cached = step.run(["logits"], {k: v for k, v in values.items() if k in names})[0]
    return float(np.max(np.abs(cached - whole[:, past:]))) <= REWRITE_TOLERANCE


def _release_freed_memory() -> None:
    """Give freed heap pages back to the OS (glibc only; elsewhere a no-op). The rewrite
    parses and serialises whole decoder graphs in Python and the original sessions are
    dropped after the check (call it once nothing refers to them): measured on the int8
    OPUS-MT-sized model, RSS after load and one translation 745 -> 562 MiB with this call
    (the lockstep layout, which keeps the original sessions: 424 MiB)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _project(
    head: tuple[ort.InferenceSession, str], states: FloatArray, wanted: npt.NDArray[np.bool_]
) -> FloatArray:
    """Logits [B, T, V] from a cut graph's hidden `states` [B, T, d], computed only at the
    positions `wanted` marks (zeros elsewhere): the output projection is most of a
    position's cost, and padding, lookahead slots past a row's own and a forced prefix
    are never read."""
    session, hidden = head
    some = session.run(["logits"], {hidden: states[wanted][None]})[0][0]
    logits = np.zeros((*wanted.shape, some.shape[-1]), dtype=some.dtype)
    logits[wanted] = some
    return logits


class _CutGraph(NamedTuple):
    """One rewritten decoder graph (no-past or with-past) as the scheduler runs it: whole
    (`session`, `head` None), or its body (`session`) with the output projection apart
    (`head`: session and the input it takes, `_split_head`)."""

    session: ort.InferenceSession
    head: tuple[ort.InferenceSession, str] | None

    @classmethod
    def load(
        cls,
        model_dir: Path,
        graph: bytes,
        session: ort.InferenceSession,
        config: ModelConfig,
        options: RuntimeOptions,
        prefill: bool = False,
    ) -> _CutGraph:
        """`prefill`: the no-past graph, cut wherever it can be (see `MaskedDecoder.prefill`)."""
        if prefill:
            split = _split_head(
                model_dir, graph, session, config, options, past_len=0, cur_len=3, always=True
            )
        else:
            split = _split_head(model_dir, graph, session, config, options)
        return cls(session, None) if split is None else cls(*split)


class MaskedDecoder:
    """The batchable decoder layout: the model's no-past and with-past decoders rewritten
    to take `decoder_attention_mask` [B, past + cur] and `decoder_position_ids` [B, cur]
    (`engine.model.batched_decoder`), so that each row has its own length: padding slots in the
    self-attention cache are masked out and each row's positions are its own.

    `prefill` runs start token + forced prefix of new rows (right-padded) in one call and
    returns their self and cross KV; `step` runs one token for every row of a batch, or
    several (lookahead) where `lookahead` says the graph is causal among new tokens.
    """

    def __init__(
        self,
        first: _CutGraph,
        step: _CutGraph,
        layers: int,
        max_difference: float,
        calls: Counter[str],
        lookahead: bool = False,
        one: _CutGraph | None = None,
    ) -> None:
        # The no-past graph, and the with-past one for steps (`one`: see below), each
        # whole or cut at its output projection.
        self.prefills = first
        self.steps = step
        # A call of one token (one row, no lookahead) where that has a faster graph of its
        # own (int8 per token: the files' fused quantization gives the same values).
        self.one = one
        # Whether a step may take several tokens per row (`ContinuousBatch` lookahead).
        self.lookahead = lookahead
        self.max_difference = max_difference
        self._first_inputs = {i.name for i in first.session.get_inputs()}
        self._step_inputs = {i.name for i in step.session.get_inputs()}
        self._self_out = _past_names(layers, "decoder", "present")
        self._cross_out = _past_names(layers, "encoder", "present")
        self._self_in = _past_names(layers, "decoder")
        self._cross_in = _past_names(layers, "encoder")
        self.calls = calls  # the model's call counter, shared

    @property
    def first(self) -> ort.InferenceSession:
        """The no-past session: the whole graph, or its body where the projection runs
        apart (`prefill`)."""
        return self.prefills.session

    @property
    def step_session(self) -> ort.InferenceSession:
        """The with-past session of steps of several tokens (or its body)."""
        return self.steps.session

    @property
    def head(self) -> tuple[ort.InferenceSession, str] | None:
        """(session, input name): the step's output projection run apart (`_split_head`)."""
        return self.steps.head

    @classmethod
    def load(
        cls,
        model_dir: Path,
        config: ModelConfig,
        options: RuntimeOptions,
        calls: Counter[str],
        originals: tuple[ort.InferenceSession, ort.InferenceSession],
    ) -> MaskedDecoder | None:
        """The rewritten pair, checked against the original graphs (`originals`: the
        no-past and with-past sessions the model runs otherwise, per token where int8 is)
        on a forced prefix and a cached step; None, logged once with the reason, when the
        rewrite or its check fails, and the model batches in lockstep."""
        from engine.model.batched_decoder import (
            MASK_INPUT,
            REWRITE_TOLERANCE,
            check_rewrite,
            load_batched_decoder,
        )

        try:
            rewritten = load_batched_decoder(
                model_dir, quantized=options.quantized, check=False, per_token=options.per_token
            )
            if rewritten is None:
                return None  # load_batched_decoder logged why
            so = _session_options(options)
            providers = list(options.providers)
            first = ort.InferenceSession(rewritten.first, so, providers=providers)
            step_graph = rewritten.tokens or rewritten.step
            step = ort.InferenceSession(step_graph, so, providers=providers)
            one = (
                None
                if rewritten.tokens is None
                else ort.InferenceSession(rewritten.step, so, providers=providers)
            )
            worst = max(
                check_rewrite(originals[0], first, past_len=0, cur_len=3),
                check_rewrite(originals[1], step, past_len=4, cur_len=1),
                # The files' quantization for one token: the same values as per token.
                0.0
                if one is None
                else check_rewrite(originals[1], one, past_len=4, cur_len=1, batch=1),
            )
        except Exception as exc:  # a graph the rewriter did not foresee: fall back
            log.warning("%s: decoder rewrite failed (%s): lockstep batching", model_dir, exc)
            return None
        if not worst <= REWRITE_TOLERANCE or MASK_INPUT not in {i.name for i in step.get_inputs()}:
            log.warning(
                "%s: rewritten decoder differs from the original by %.3g (tolerance %g): "
                "not used, lockstep batching",
                model_dir,
                worst,
                REWRITE_TOLERANCE,
            )
            return None
        lookahead = _causal_over_new_tokens(first, step, config, options)
        # A position's logits depend on no other position's in fp32 and int8 per token, so
        # the prefill's projection may run on the positions a search reads only.
        prefills = (
            _CutGraph(first, None)
            if options.quantized and not options.per_token
            else _CutGraph.load(model_dir, rewritten.first, first, config, options, prefill=True)
        )
        steps = _CutGraph.load(model_dir, step_graph, step, config, options)
        ones = (
            None if one is None else _CutGraph.load(model_dir, rewritten.step, one, config, options)
        )
        log.info(
            "%s: continuous batching (decoder rewritten with masks and positions; "
            "max logit difference to the original %.2g)%s%s%s",
            model_dir,
            worst,
            f"; output projection on {options.head_threads} threads" if steps.head else "",
            "" if lookahead else "; one token per row per step (no lookahead)",
            "; int8 activations quantized per token" if ones is not None else "",
        )
        return cls(prefills, steps, config.decoder_layers, worst, calls, lookahead, ones)

    def _feed(self, declared: set[str], values: dict[str, Any]) -> dict[str, Any]:
        return {name: value for name, value in values.items() if name in declared}

    def prefill(
        self,
        enc: EncoderOutput,
        input_ids: IntArray,
        mask: IntArray,
        needed_from: IntArray | None = None,
    ) -> tuple[FloatArray, tuple[FloatArray, ...], tuple[FloatArray, ...]]:
        """Logits [B, T, V] and the rows' self and cross KV, for right-padded `input_ids`
        whose real tokens `mask` marks (1). `needed_from` [B]: each row's first position
        whose logits the caller reads (after the forced prefix); where the projection runs
        apart, the earlier ones and the padding are not computed (zeros).

        Why: a forced prefix is often longer than the draft and the tail read after it,
        and the vocabulary projection is most of a position's cost (OPUS-MT size: 33 of
        the 55 MB of int8 weights, 512 x 65001 multiply-adds per position)."""
        from engine.model.batched_decoder import MASK_INPUT, POSITIONS_INPUT

        batch, length = input_ids.shape
        positions = np.tile(np.arange(length, dtype=np.int64), (batch, 1))
        values: dict[str, Any] = {
            "encoder_attention_mask": enc.attention_mask,
            "input_ids": input_ids,
            "encoder_hidden_states": enc.hidden_states,
            MASK_INPUT: mask,
            POSITIONS_INPUT: positions,
        }
        self.calls["decoder"] += 1
        feed = self._feed(self._first_inputs, values)
        kv = [*self._self_out, *self._cross_out]
        n = len(self._self_out)
        if self.prefills.head is None:
            out = self.first.run(["logits", *kv], feed)
            return out[0], tuple(out[1 : 1 + n]), tuple(out[1 + n :])
        head = self.prefills.head
        out = self.first.run([head[1], *kv], feed)
        wanted = mask.astype(bool)
        if needed_from is not None:
            wanted &= np.arange(length)[None, :] >= needed_from[:, None]
        logits = _project(head, out[0], wanted)
        return logits, tuple(out[1 : 1 + n]), tuple(out[1 + n :])

    def step(
        self,
        enc: EncoderOutput,
        input_ids: IntArray,
        positions: IntArray,
        mask: IntArray,
        self_kv: tuple[FloatArray, ...],
        cross_kv: tuple[FloatArray, ...],
    ) -> tuple[FloatArray, tuple[FloatArray, ...]]:
        """One token per row: logits [B, V] and the self KV grown by one slot. Several per
        row (`input_ids` [B, T], T > 1: lookahead, whose padding `mask` marks 0 in its
        last T columns): logits [B, T, V], meaningless at padding, and T more slots."""
        from engine.model.batched_decoder import MASK_INPUT, POSITIONS_INPUT

        values: dict[str, Any] = {
            "encoder_attention_mask": enc.attention_mask,
            "input_ids": input_ids,
            "encoder_hidden_states": enc.hidden_states,
            MASK_INPUT: mask,
            POSITIONS_INPUT: positions,
        }
        values.update(zip(self._self_in, self_kv, strict=True))
        values.update(zip(self._cross_in, cross_kv, strict=True))
        self.calls["decoder"] += 1
        feed = self._feed(self._step_inputs, values)
        fed = input_ids.shape[1]
        graph = self.one if self.one is not None and input_ids.size == 1 else self.steps
        if graph.head is None:
            out = graph.session.run(["logits", *self._self_out], feed)
            return (out[0][:, -1, :] if fed == 1 else out[0]), tuple(out[1:])
        head, hidden = graph.head
        out = graph.session.run([hidden, *self._self_out], feed)
        if fed == 1:
            logits = head.run(["logits"], {hidden: out[0]})[0]
            return logits[:, -1, :], tuple(out[1:])
        return _project(graph.head, out[0], mask[:, -fed:].astype(bool)), tuple(out[1:])
