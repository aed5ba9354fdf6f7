"""`MarianOnnx`: one model's sessions as the layers above run them.

Three calls: `encode`, `prefill` (the first decoder call: start token plus any forced
prefix) and `step` (one more token per row, with the cache). Decoding strategies live
above; how the files were chosen, rewritten and checked is `engine.model.load`.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from engine.model.config import ModelConfig
from engine.model.layouts import DecoderCache, EncoderOutput, FloatArray, IntArray
from engine.model.load import load
from engine.model.names import ATTENTION_MASK, INPUT_IDS, LAST_HIDDEN_STATE, PER_TOKEN_KEY
from engine.model.sessions import RuntimeOptions


class MarianOnnx:
    """Encoder and decoder sessions of one model, with the KV-cache bookkeeping.

    `decoder` holds the decoder's calls (one class per layout, `engine.model.layouts`);
    `masked` is the rewritten decoder whose rows each have their own length (continuous
    batching), None when the model batches in lockstep; `backend` the KV backend chosen
    at load (`engine.model.backend`), `kv` its own graphs.
    """

    def __init__(self, model_dir: Path, config: ModelConfig, options: RuntimeOptions) -> None:
        self.model_dir = model_dir
        self.config = config
        self.options = options
        self.calls: Counter[str] = Counter()
        loaded = load(model_dir, config, options, self.calls)
        self.encoder = loaded.encoder
        self.decoder = loaded.decoder
        self.masked = loaded.masked
        self.layout = loaded.layout
        self.files = loaded.files  # by role: encoder, no_past, with_past
        self.split_at_load = loaded.split_at_load  # the merged file's branches run apart
        self.float_type = loaded.float_type
        # The KV backend chosen at load, and why (`engine.model.backend`), with its graphs.
        self.backend = loaded.backend
        self.kv = loaded.kv

    @property
    def int8_activations(self) -> str | None:
        """How the decoder quantizes int8 activations: "per token" (rows exact in any
        batch, `RuntimeOptions.int8_per_token`) or "per call" (the files' own, when turned
        off or the graph could not be rewritten); None for fp32."""
        if not self.options.quantized:
            return None
        if self.masked is not None:
            per_token = self.masked.one_token is not None
        else:
            metadata = self.decoder.no_past.get_modelmeta().custom_metadata_map
            per_token = PER_TOKEN_KEY in metadata
        return "per token" if per_token else "per call"

    @property
    def batching(self) -> str:
        """How requests share decoder calls: `continuous` (rows join and leave at any
        step: the rewritten decoder) or `lockstep` (rows that start together)."""
        return self.backend.batching

    def encode(self, input_ids: IntArray, attention_mask: IntArray) -> EncoderOutput:
        """Run the encoder for a (padded) batch of sources: in one call, or, for int8 per
        token (`RuntimeOptions.int8_per_token`), one call per source without its padding,
        so that each gets what it gets alone, the file's own values.

        Why not the encoder quantized per token, like the decoder: a source alone runs
        faster with the file's fused kernels than per token, and a batch of sources run one
        by one costs about what the per-token graph costs for them in one call; a source's
        tokens quantized together are also what the file gives it."""
        if not self.options.per_token or input_ids.shape[0] == 1:
            self.calls["encoder"] += 1
            (hidden,) = self.encoder.run(
                [LAST_HIDDEN_STATE], {INPUT_IDS: input_ids, ATTENTION_MASK: attention_mask}
            )
            return EncoderOutput(hidden, attention_mask)
        hidden = None
        for row in range(input_ids.shape[0]):
            real = attention_mask[row].astype(bool)
            ids = input_ids[row, real][None]
            self.calls["encoder"] += 1
            (states,) = self.encoder.run(
                [LAST_HIDDEN_STATE], {INPUT_IDS: ids, ATTENTION_MASK: np.ones_like(ids)}
            )
            if hidden is None:  # padding positions stay 0: masked out, and finite
                hidden = np.zeros((*input_ids.shape, states.shape[-1]), dtype=states.dtype)
            hidden[row, real] = states[0]
        assert hidden is not None
        return EncoderOutput(hidden, attention_mask)

    def prefill(self, enc: EncoderOutput, input_ids: IntArray) -> tuple[FloatArray, DecoderCache]:
        """The first decoder call: start token plus any forced prefix, all in one call.

        Returns logits [B, T, V] and the cache, whose encoder KV stays fixed from here on.
        """
        return self.decoder.prefill(enc, input_ids)

    def step(
        self, enc: EncoderOutput, cache: DecoderCache, input_ids: IntArray
    ) -> tuple[FloatArray, DecoderCache]:
        """One more token per row ([B, 1]); returns last-position logits [B, V] and the cache."""
        return self.decoder.step(enc, cache, input_ids)
