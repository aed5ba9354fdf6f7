"""Export MarianMT checkpoints to ONNX: the Optimum layout plus two other decoder variants.

The Optimum export (`export_marian`) is what OPUS-MT ONNX repositories on the hub contain.
The two extra variants exist because real-world exports differ, and the engine must detect
and run them from their signatures:

* no encoder KV (`export_decoder_without_encoder_kv`): the decoder takes only self-attention
  past and recomputes cross-attention from `encoder_hidden_states` at every step;
* no past at all (`export_decoder_without_past`): the slow fallback that re-runs the whole
  prefix every step.

torch, transformers and optimum are imported lazily: the runtime never needs them.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.model.config import OPTIONAL_TOKENIZER_FILES, PROJECT_CONFIG, TOKENIZER_FILES
from engine.model.names import DECODER, DECODER_MERGED, DECODER_WITH_PAST, ENCODER, onnx_file

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

OPTIMUM_FILES = tuple(onnx_file(s) for s in (ENCODER, DECODER, DECODER_WITH_PAST, DECODER_MERGED))

EXPORT_OPSET = 17
VERIFY_ATOL = 1e-4


class _DropMessages(logging.Filter):
    def __init__(self, *fragments: str) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


@contextlib.contextmanager
def known_export_noise() -> Iterator[None]:
    """Silence the warnings an export always prints that say nothing about this export.

    - torch 2.13 deprecates the TorchScript ONNX exporter. Optimum 2.1 exports Marian with
      it, and so do our variant exporters: they need its `dynamic_axes` and exact input
      names. The dynamo exporter is the plan once Optimum's Marian config supports it.
    - TracerWarnings: transformers' Marian code branches on tensor shapes in Python. A
      trace that took a wrong branch would give wrong numbers, which the numeric checks
      after every export (`verify`, `models export`, the fixture tests) catch.
    - transformers' "`torch_dtype` is deprecated", triggered inside Optimum, and ONNX
      Runtime's quantizer advice to pre-process the model, which we deliberately skip: it
      would change the committed int8 files for no measured gain.
    Anything else still shows.
    """
    drop = _DropMessages("`torch_dtype` is deprecated", "consider to run pre-processing")
    loggers = [logging.getLogger(), logging.getLogger("transformers.configuration_utils")]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*TorchScript-based ONNX export.*")
        warnings.filterwarnings(
            "ignore", message="The feature will be removed", category=DeprecationWarning
        )
        # torch.jit.TracerWarning's two messages (matched by text: quantizing needs no torch).
        warnings.filterwarnings("ignore", message="Converting a tensor to a Python")
        warnings.filterwarnings("ignore", message="torch.tensor results are registered")
        # MarianTokenizer (Optimum loads it) suggests sacremoses, for a normaliser the
        # engine's tokenizer, like OPUS-MT's, does not apply.
        warnings.filterwarnings("ignore", message="Recommended: pip install sacremoses")
        for logger in loggers:
            logger.addFilter(drop)
        try:
            yield
        finally:
            for logger in loggers:
                logger.removeFilter(drop)


def copy_tokenizer_files(checkpoint_dir: str | Path, out_dir: str | Path) -> None:
    """Copy tokenizer and config files so that `out_dir` is a complete model directory."""
    src, dst = Path(checkpoint_dir), Path(out_dir)
    missing = [name for name in TOKENIZER_FILES if not (src / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{src} lacks {', '.join(missing)}")
    dst.mkdir(parents=True, exist_ok=True)
    for name in (*TOKENIZER_FILES, *OPTIONAL_TOKENIZER_FILES, PROJECT_CONFIG):
        if (src / name).is_file() and (src / name).resolve() != (dst / name).resolve():
            shutil.copyfile(src / name, dst / name)


def inline_external_data(onnx_path: str | Path) -> None:
    """Rewrite an ONNX file with its weights inline, removing its external data file.

    One self-contained file per model is simpler to ship and load; only models over the
    2 GB protobuf limit need external data, and those are left alone.
    """
    import onnx
    from onnx.external_data_helper import uses_external_data

    path = Path(onnx_path)
    model = onnx.load(str(path), load_external_data=False)
    locations = {
        entry.value
        for tensor in _all_initializers(model.graph)
        if uses_external_data(tensor)
        for entry in tensor.external_data
        if entry.key == "location"
    }
    if not locations:
        return
    model = onnx.load(str(path))
    if model.ByteSize() >= onnx.checker.MAXIMUM_PROTOBUF:
        return
    onnx.save(model, str(path))
    for location in locations:
        (path.parent / location).unlink(missing_ok=True)


def _all_initializers(graph: Any) -> list[Any]:
    """Initializers of a graph and of every subgraph (the branches of a merged `If`)."""
    import onnx

    found = list(graph.initializer)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                found.extend(_all_initializers(attr.g))
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    found.extend(_all_initializers(sub))
    return found


def export_marian(
    checkpoint_dir: str | Path, out_dir: str | Path, *, validate: bool = True
) -> None:
    """Optimum export with past: encoder, decoder, decoder-with-past and the merged decoder.

    `validate` lets Optimum compare ONNX Runtime against PyTorch outputs (slower, but it
    catches a broken export at build time instead of as wrong translations).
    """
    from optimum.exporters.onnx import main_export

    checkpoint, out = Path(checkpoint_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with known_export_noise():
        main_export(
            str(checkpoint),
            output=str(out),
            task="text2text-generation-with-past",
            library_name="transformers",
            local_files_only=True,
            do_validation=validate,
        )
    missing = [name for name in OPTIMUM_FILES if not (out / name).is_file()]
    if missing:
        raise RuntimeError(f"Optimum export into {out} did not produce {', '.join(missing)}")
    for name in OPTIMUM_FILES:
        inline_external_data(out / name)
    copy_tokenizer_files(checkpoint, out)


def _load_marian(checkpoint_dir: str | Path) -> Any:
    from transformers import MarianMTModel

    model = MarianMTModel.from_pretrained(str(checkpoint_dir), local_files_only=True)
    model.eval()
    return model


def _decoder_step_module(model: Any, with_past: bool) -> Any:
    """A torch module running Marian's decoder with explicit tensors in and out.

    Written out layer by layer (instead of calling the Hugging Face decoder with a cache
    object) so that tracing sees plain tensor ops whose shapes stay dynamic: the past length
    comes from the past tensors, the causal mask from shapes, and cross-attention is always
    recomputed from `encoder_hidden_states`. `verify_decoder` checks it against the model.
    """
    import torch

    n_heads = model.config.decoder_attention_heads

    def split_heads(x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        return x.view(b, t, n_heads, d // n_heads).transpose(1, 2)

    def attend(
        attn: Any, q_in: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        q = split_heads(attn.q_proj(q_in)) * attn.scaling
        w = torch.softmax(torch.matmul(q, k.transpose(2, 3)) + bias, dim=-1)
        out = torch.matmul(w, v).transpose(1, 2)
        projected: torch.Tensor = attn.out_proj(out.reshape(q_in.shape[0], q_in.shape[1], -1))
        return projected

    class DecoderStep(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # Registered as submodules so that tracing sees the weights as parameters.
            self.decoder = model.model.decoder
            self.lm_head = model.lm_head
            self.register_buffer("final_logits_bias", model.final_logits_bias)

        def forward(
            self,
            encoder_attention_mask: torch.Tensor,
            input_ids: torch.Tensor,
            encoder_hidden_states: torch.Tensor,
            *past: torch.Tensor,
        ) -> tuple[torch.Tensor, ...]:
            decoder = self.decoder
            dtype = encoder_hidden_states.dtype
            neg = torch.finfo(dtype).min
            length = input_ids.shape[1]
            past_len = past[0].shape[2] if with_past else 0
            positions = torch.arange(length, device=input_ids.device) + past_len
            hidden = decoder.embed_tokens(input_ids) * decoder.embed_scale
            hidden = hidden + decoder.embed_positions.weight[positions]

            keys = torch.arange(length + past_len, device=input_ids.device)
            causal = (keys[None, :] > positions[:, None]).to(dtype) * neg
            self_bias = causal[None, None, :, :]
            cross_bias = (1.0 - encoder_attention_mask.to(dtype))[:, None, None, :] * neg

            presents: list[torch.Tensor] = []
            for i, layer in enumerate(decoder.layers):
                sa = layer.self_attn
                k = split_heads(sa.k_proj(hidden))
                v = split_heads(sa.v_proj(hidden))
                if with_past:
                    k = torch.cat([past[2 * i], k], dim=2)
                    v = torch.cat([past[2 * i + 1], v], dim=2)
                    presents += [k, v]
                hidden = layer.self_attn_layer_norm(hidden + attend(sa, hidden, k, v, self_bias))

                ca = layer.encoder_attn
                ck = split_heads(ca.k_proj(encoder_hidden_states))
                cv = split_heads(ca.v_proj(encoder_hidden_states))
                hidden = layer.encoder_attn_layer_norm(
                    hidden + attend(ca, hidden, ck, cv, cross_bias)
                )

                ffn = layer.fc2(layer.activation_fn(layer.fc1(hidden)))
                hidden = layer.final_layer_norm(hidden + ffn)
            logits = self.lm_head(hidden) + self.final_logits_bias
            return (logits, *presents)

    return DecoderStep().eval()


def _past_names(n_layers: int, prefix: str) -> list[str]:
    return [f"{prefix}.{i}.decoder.{kv}" for i in range(n_layers) for kv in ("key", "value")]


def _export_decoder(checkpoint_dir: str | Path, out_path: str | Path, with_past: bool) -> None:
    import torch

    model = _load_marian(checkpoint_dir)
    cfg = model.config
    n_layers, n_heads = cfg.decoder_layers, cfg.decoder_attention_heads
    head_dim = cfg.d_model // n_heads
    module = _decoder_step_module(model, with_past)

    batch, src_len, tgt_len, past_len = 2, 5, 3, 4
    args: list[torch.Tensor] = [
        torch.ones(batch, src_len, dtype=torch.long),
        torch.full((batch, tgt_len), cfg.decoder_start_token_id, dtype=torch.long),
        torch.randn(batch, src_len, cfg.d_model),
    ]
    input_names = ["encoder_attention_mask", "input_ids", "encoder_hidden_states"]
    output_names = ["logits"]
    dynamic_axes: dict[str, dict[int, str]] = {
        "encoder_attention_mask": {0: "batch_size", 1: "encoder_sequence_length"},
        "input_ids": {0: "batch_size", 1: "decoder_sequence_length"},
        "encoder_hidden_states": {0: "batch_size", 1: "encoder_sequence_length"},
        "logits": {0: "batch_size", 1: "decoder_sequence_length"},
    }
    if with_past:
        args += [torch.randn(batch, n_heads, past_len, head_dim) for _ in range(2 * n_layers)]
        input_names += _past_names(n_layers, "past_key_values")
        output_names += _past_names(n_layers, "present")
        for name in _past_names(n_layers, "past_key_values"):
            dynamic_axes[name] = {0: "batch_size", 2: "past_sequence_length"}
        for name in _past_names(n_layers, "present"):
            dynamic_axes[name] = {0: "batch_size", 2: "past_sequence_length + sequence_length"}

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), known_export_noise():
        torch.onnx.export(
            module,
            tuple(args),
            str(out),
            input_names=input_names,
            output_names=output_names,
            dynamic_axes=dynamic_axes,
            opset_version=EXPORT_OPSET,
            dynamo=False,
            external_data=False,
            # Folding would store the tied lm_head twice (embedding + transposed copy);
            # ONNX Runtime folds the Transposes when it loads the model anyway.
            do_constant_folding=False,
        )
    verify_decoder(model, out, with_past)


def export_decoder_without_encoder_kv(checkpoint_dir: str | Path, out_path: str | Path) -> None:
    """Decoder taking self-attention past only (no encoder KV inputs, no `use_cache_branch`).

    Inputs: `encoder_attention_mask`, `input_ids`, `encoder_hidden_states`,
    `past_key_values.{i}.decoder.{key,value}`; outputs `logits`, `present.{i}.decoder.*`.
    Step 0 is fed zero-length past (B, H, 0, Dh). Verified against PyTorch before returning.
    """
    _export_decoder(checkpoint_dir, out_path, with_past=True)


def export_decoder_without_past(checkpoint_dir: str | Path, out_path: str | Path) -> None:
    """Decoder with no cache at all: `encoder_attention_mask`, `input_ids`,
    `encoder_hidden_states` -> `logits`. Verified against PyTorch before returning."""
    _export_decoder(checkpoint_dir, out_path, with_past=False)


def verify_decoder(model: Any, onnx_path: str | Path, with_past: bool) -> None:
    """Check the exported decoder's logits against the PyTorch model, step by step.

    A multi-token first call (a forced prefix) and then single-token calls fed with the
    returned past, on a batch with source padding; raises if any logit is off by more
    than `VERIFY_ATOL`.
    """
    import numpy as np
    import onnxruntime as ort
    import torch

    cfg = model.config
    n_heads = cfg.decoder_attention_heads
    head_dim = cfg.d_model // n_heads
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(2, cfg.vocab_size - 1, (2, 7), generator=gen)
    src_mask = torch.ones_like(src)
    src_mask[1, 5:] = 0
    src[1, 5:] = cfg.pad_token_id
    tgt = torch.randint(2, cfg.vocab_size - 1, (2, 6), generator=gen)
    tgt[:, 0] = cfg.decoder_start_token_id
    with torch.no_grad():
        enc = model.get_encoder()(input_ids=src, attention_mask=src_mask).last_hidden_state
        expected = model(
            encoder_outputs=(enc,), attention_mask=src_mask, decoder_input_ids=tgt
        ).logits.numpy()

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    feed: dict[str, npt.NDArray[Any]] = {
        "encoder_attention_mask": src_mask.numpy(),
        "encoder_hidden_states": enc.numpy(),
    }
    past_names = _past_names(cfg.decoder_layers, "past_key_values")
    if not with_past:
        for end in (3, 6):
            logits = session.run(["logits"], {**feed, "input_ids": tgt[:, :end].numpy()})[0]
            _check_close(logits, expected[:, :end], f"{onnx_path} (no past, {end} tokens)")
        return
    past = {name: np.zeros((2, n_heads, 0, head_dim), dtype=np.float32) for name in past_names}
    start = 0
    for end in (3, 4, 5, 6):
        outputs = session.run(None, {**feed, **past, "input_ids": tgt[:, start:end].numpy()})
        _check_close(outputs[0], expected[:, start:end], f"{onnx_path} (tokens {start}:{end})")
        past = dict(zip(past_names, outputs[1:], strict=True))
        start = end


def _check_close(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any], what: str) -> None:
    import numpy as np

    err = float(np.max(np.abs(got - want)))
    if got.shape != want.shape or err > VERIFY_ATOL:
        raise RuntimeError(f"{what}: logits differ from PyTorch (shape {got.shape}, max {err:g})")
