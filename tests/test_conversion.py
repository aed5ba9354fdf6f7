"""Conversion: the committed fixture export (with its partial marker), the int8 re-merge and
where its lm_head check looks, and the decoder variants.

Most tests read the committed ONNX files and need no torch. Those that export need torch
and optimum (skipped without them). The re-export check exports the committed PyTorch
checkpoint (`models/fixture/checkpoint/`) and compares with the committed ONNX: both are
files in git, so the check means the same on every machine (a retrain would not: training
is deterministic on one CPU, not across CPUs). The checks of the committed weights against
PyTorch (references, checkpoint, re-export) run on both fixtures, the prefix-trained one
and `models/fixture_offline/`.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from engine.conversion.export import OPTIMUM_FILES
from engine.conversion.quantize import (
    check_quantized_merged,
    is_lm_head_quantized,
    lm_head_outputs,
    quantized_op_counts,
    untie_lm_head,
)
from engine.model.config import TOKENIZER_FILES
from tests.conftest import FIXTURE_CHECKPOINTS, FIXTURE_DIRS

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "models" / "fixture"
MODEL = FIXTURE / "model"
NO_KV = FIXTURE / "variants" / "no_encoder_kv" / "decoder_model.onnx"
NO_PAST = FIXTURE / "variants" / "no_past" / "decoder_model.onnx"
if not (FIXTURE / "reference_outputs.json").is_file():
    pytest.skip("fixture model not built (models/fixture/build.py)", allow_module_level=True)
CONFIG = json.loads((MODEL / "config.json").read_text("utf-8"))
LAYERS = int(CONFIG["decoder_layers"])
HEADS = int(CONFIG["decoder_attention_heads"])
HEAD_DIM = int(CONFIG["d_model"]) // HEADS
REFERENCE = json.loads((FIXTURE / "reference_outputs.json").read_text("utf-8"))
# Every built fixture's reference outputs, by kind (the offline one may not be built yet).
REFERENCES = {
    kind: json.loads((directory / "reference_outputs.json").read_text("utf-8"))
    for kind, directory in FIXTURE_DIRS.items()
    if (directory / "reference_outputs.json").is_file()
}
KINDS = sorted(REFERENCES)
FORCED_CASES = [(k, i) for k in KINDS for i in range(len(REFERENCES[k]["forced_logits"]))]

sys.path.insert(0, str(FIXTURE))
import styles  # noqa: E402
from ort_greedy import OrtGreedy  # noqa: E402
from recover_checkpoint import recover  # noqa: E402


def session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def encode(model_dir: Path, source_ids: list[int]) -> tuple[np.ndarray[Any, Any], ...]:
    ids = np.array([source_ids], dtype=np.int64)
    mask = np.ones_like(ids)
    hidden = session(model_dir / "encoder_model.onnx").run(
        None, {"input_ids": ids, "attention_mask": mask}
    )[0]
    return hidden, mask


def empty_past(names: list[str]) -> dict[str, np.ndarray[Any, Any]]:
    return {n: np.zeros((1, HEADS, 0, HEAD_DIM), dtype=np.float32) for n in names}


def merged_logits(
    model_dir: Path, source_ids: list[int], decoder_ids: list[int], quantized: bool = False
) -> np.ndarray[Any, Any]:
    """One no-past call of the merged decoder on a forced decoder input."""
    suffix = "_quantized" if quantized else ""
    enc = session(model_dir / f"encoder_model{suffix}.onnx")
    ids = np.array([source_ids], dtype=np.int64)
    mask = np.ones_like(ids)
    hidden = enc.run(None, {"input_ids": ids, "attention_mask": mask})[0]
    dec = session(model_dir / f"decoder_model_merged{suffix}.onnx")
    past = [i.name for i in dec.get_inputs() if i.name.startswith("past_key_values")]
    feed = {
        **empty_past(past),
        "input_ids": np.array([decoder_ids], dtype=np.int64),
        "encoder_hidden_states": hidden,
        "encoder_attention_mask": mask,
        "use_cache_branch": np.array([False]),
    }
    return np.asarray(dec.run(["logits"], feed)[0][0])


# --- the committed fixture -------------------------------------------------------------


def test_fixture_model_dir_is_complete_and_self_contained() -> None:
    quantized = [n.replace(".onnx", "_quantized.onnx") for n in OPTIMUM_FILES]
    for name in (*OPTIMUM_FILES, *quantized, *TOKENIZER_FILES, "nmt-incremental.json"):
        assert (MODEL / name).is_file(), name
    assert not [p for p in FIXTURE.rglob("*") if p.name.endswith(("_data", ".data"))]
    settings = json.loads((MODEL / "nmt-incremental.json").read_text("utf-8"))
    assert settings == {
        "source_prefix": ">>cmn_Hans<<",
        "partial_suffix": " <partial>",
        "source_lang": "en",
        "target_lang": "zh",
    }
    vocab = json.loads((MODEL / "vocab.json").read_text("utf-8"))
    assert vocab["</s>"] == 0 and vocab["<unk>"] == 1
    assert vocab["<pad>"] == len(vocab) - 1 == CONFIG["pad_token_id"]
    assert CONFIG["decoder_start_token_id"] == CONFIG["pad_token_id"]
    assert ">>cmn_Hans<<" in vocab


def test_partial_marker_is_one_source_id_after_the_text_pieces() -> None:
    """The engine appends `partial_suffix` to partials: it must add exactly one id, the
    same for our tokenizer and MarianTokenizer, and leave the text's own ids alone."""
    from engine.model.tokenizer import MarianTokenizer

    vocab = json.loads((MODEL / "vocab.json").read_text("utf-8"))
    ours = MarianTokenizer.from_dir(MODEL)
    texts = [">>cmn_Hans<< Lucy wants to meet Jack", ">>cmn_Hans<< Tom will dr"]
    for text in texts:
        plain, marked = ours.encode_source(text), ours.encode_source(text + " <partial>")
        assert marked == [*plain[:-1], vocab["\u2581<partial>"], plain[-1]]
    transformers = pytest.importorskip("transformers")
    reference = transformers.MarianTokenizer.from_pretrained(str(MODEL))
    for text in texts:
        assert reference(text + " <partial>")["input_ids"] == ours.encode_source(
            text + " <partial>"
        )


def test_fixture_translates_partials_to_what_the_final_keeps() -> None:
    """Prefix training: a partial (sent with the marker) translates to its safe target, the
    part of the translation every sentence starting with it shares, so streaming never has
    to retract it; the same text as a final is still the full translation."""
    import corpus

    from engine import Translator

    tr = Translator.from_dir(MODEL)
    sources = [r["source"] for r in REFERENCE["greedy"][:25]]
    finals = [r.text for r in tr.translate(sources)]
    assert finals == [r["text"] for r in REFERENCE["greedy"][:25]]
    cuts = [
        (i, " ".join(s.split()[:k]))
        for i, s in enumerate(sources)
        for k in range(1, len(s.split()) + 1)
    ]
    enc = tr.encode([tr.source_ids(p, partial=True) for _, p in cuts])
    partials = [tr.detokenize(h.token_ids) for h in tr.decode(enc)]
    kept = [finals[i].startswith(t) for (i, _), t in zip(cuts, partials, strict=True)]
    safe = [t == corpus.partial_target(p) for (_, p), t in zip(cuts, partials, strict=True)]
    assert sum(kept) >= 0.97 * len(cuts) and sum(safe) >= 0.95 * len(cuts)
    assert any(len(t) >= 3 for t in partials)  # more than subjects: e.g. 汤姆明天


@pytest.mark.parametrize(("source", "target"), styles.RECOGNISER_EXAMPLES)
def test_fixture_translates_recogniser_text_as_a_final(source: str, target: str) -> None:
    """The prefix fixture is trained on the styles a recogniser writes too
    (lowercase, fillers, fragments; punctuation), so these finals translate."""
    from engine import Translator

    assert Translator.from_dir(MODEL).translate([source])[0].text == target


def test_lowercase_safe_target_is_what_every_casing_keeps() -> None:
    """A recogniser's partial carries no casing: its safe target is the common part of the
    safe targets of every casing the task has."""
    import corpus

    assert corpus.lowercase_partial_target("we") == "我们"  # only "We"
    assert corpus.partial_target("we") == ""  # a cased "we" cannot start a sentence
    assert corpus.lowercase_partial_target("tom") == ""  # "Tom" or "Tomorrow"
    assert corpus.lowercase_partial_target("will he") == ""  # "Will he" / "Will Helen"
    assert corpus.partial_target("Will he") == "他"
    assert corpus.lowercase_partial_target("lucy wants to meet jack on the train") == "露西"
    assert corpus.lowercase_partial_target("tom will meet jack tomorrow") == "汤姆明天"
    assert corpus.lowercase_partial_target("i watch tv in the") == "我"  # "TV" is one casing


def test_fixture_translates_lowercase_partials_to_their_safe_target() -> None:
    """A recogniser's partials are lowercase: with the marker they translate to what every
    sentence whose lowercase form starts with them keeps, like cased ones."""
    import corpus

    from engine import Translator

    tr = Translator.from_dir(MODEL)
    sources = [r["source"].lower() for r in REFERENCE["greedy"][:25]]
    cuts = [" ".join(s.split()[:k]) for s in sources for k in range(1, len(s.split()) + 1)]
    enc = tr.encode([tr.source_ids(p, partial=True) for p in cuts])
    partials = [tr.detokenize(h.token_ids) for h in tr.decode(enc)]
    safe = [t == corpus.lowercase_partial_target(p) for p, t in zip(cuts, partials, strict=True)]
    assert sum(safe) >= 0.95 * len(cuts), (sum(safe), len(cuts))
    tom, we = (
        tr.detokenize(h.token_ids)
        for h in tr.decode(tr.encode([tr.source_ids(p, partial=True) for p in ("tom", "we")]))
    )
    assert (tom, we) == ("", "我们")


def test_committed_fixture_fits_size_budget() -> None:
    committed = [*MODEL.iterdir(), NO_KV, NO_PAST]
    committed += [FIXTURE / "heldout.tsv", FIXTURE / "reference_outputs.json"]
    assert sum(p.stat().st_size for p in committed) < 10 * 1024 * 1024


def test_int8_merged_decoder_is_quantized_inside_both_branches() -> None:
    model = onnx.load(str(MODEL / "decoder_model_merged_quantized.onnx"))
    counts = quantized_op_counts(model)
    branches = {path: ops for path, ops in counts.items() if path != "main"}
    assert sorted(branches) == ["main/If.else_branch", "main/If.then_branch"]
    for path, ops in branches.items():
        assert ops["MatMulInteger"] > 0, (path, ops)
        assert ops["DynamicQuantizeLinear"] > 0, (path, ops)
    assert is_lm_head_quantized(model) == {
        "main/If.else_branch": True,
        "main/If.then_branch": True,
    }


def test_lm_head_is_looked_for_in_the_branches_not_the_merged_top_level() -> None:
    """The merged top level only routes the If's output to `logits` (here through an
    Identity, as some tools leave it): it must not count as an unquantized lm_head."""
    model = onnx.load(str(MODEL / "decoder_model_merged_quantized.onnx"))
    branches = {"main/If.else_branch": True, "main/If.then_branch": True}
    assert set(lm_head_outputs(model)) == set(branches)
    if_node = next(n for n in model.graph.node if n.op_type == "If")
    if_node.output[0] = "logits_from_if"
    model.graph.node.append(onnx.helper.make_node("Identity", ["logits_from_if"], ["logits"]))
    assert is_lm_head_quantized(model) == branches
    check_quantized_merged(model)  # raised "lm_head not quantized ... {'main': False, ...}"
    fp32 = onnx.load(str(MODEL / "decoder_model_merged.onnx"))
    assert is_lm_head_quantized(fp32) == dict.fromkeys(branches, False)
    with pytest.raises(RuntimeError, match="not quantized"):
        check_quantized_merged(fp32)


def test_int8_merged_decoder_keeps_the_fp32_signature() -> None:
    fp32 = onnx.load(str(MODEL / "decoder_model_merged.onnx"))
    int8 = onnx.load(str(MODEL / "decoder_model_merged_quantized.onnx"))
    assert [i.name for i in int8.graph.input] == [i.name for i in fp32.graph.input]
    assert [o.name for o in int8.graph.output] == [o.name for o in fp32.graph.output]
    assert "use_cache_branch" in {i.name for i in int8.graph.input}


def test_split_int8_files_are_quantized_with_int8_lm_head() -> None:
    for name in ("encoder_model", "decoder_model", "decoder_with_past_model"):
        model = onnx.load(str(MODEL / f"{name}_quantized.onnx"))
        assert quantized_op_counts(model)["main"]["MatMulInteger"] > 0, name
        if name != "encoder_model":
            assert is_lm_head_quantized(model) == {"main": True}, name


def test_fp32_lm_head_is_tied_and_untying_preserves_logits(tmp_path: Path) -> None:
    model = onnx.load(str(MODEL / "decoder_model.onnx"))
    assert is_lm_head_quantized(model) == {"main": False}
    assert untie_lm_head(model) == 1
    onnx.checker.check_model(model)
    producers = {o: n for n in model.graph.node for o in n.output}
    inits = {i.name for i in model.graph.initializer}
    head = next(n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits)
    assert head.input[1] not in producers
    assert not [n for n in model.graph.node if n.op_type == "Transpose" and n.input[0] in inits]
    onnx.save(model, str(tmp_path / "untied.onnx"))

    forced = REFERENCE["forced_logits"][0]
    hidden, mask = encode(MODEL, forced["source_ids"])
    feed = {
        "input_ids": np.array([forced["decoder_input_ids"]], dtype=np.int64),
        "encoder_hidden_states": hidden,
        "encoder_attention_mask": mask,
    }
    before = session(MODEL / "decoder_model.onnx").run(["logits"], feed)[0]
    after = session(tmp_path / "untied.onnx").run(["logits"], feed)[0]
    np.testing.assert_allclose(after, before, atol=1e-6)


@pytest.mark.parametrize(("kind", "case"), FORCED_CASES)
def test_onnx_logits_match_pytorch_reference(kind: str, case: int) -> None:
    forced = REFERENCES[kind]["forced_logits"][case]
    model = FIXTURE_DIRS[kind] / "model"
    want = np.array(forced["logits"], dtype=np.float32)
    got = merged_logits(model, forced["source_ids"], forced["decoder_input_ids"])
    np.testing.assert_allclose(got, want, atol=2e-4)
    int8 = merged_logits(model, forced["source_ids"], forced["decoder_input_ids"], True)
    assert (int8.argmax(-1) == want.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_onnx_decoding_reproduces_pytorch_ids(kind: str) -> None:
    refs = REFERENCES[kind]["greedy"][:60]
    decoder = OrtGreedy(FIXTURE_DIRS[kind] / "model")
    assert decoder.translate_ids([r["source"] for r in refs]) == [r["ids"] for r in refs]
    assert [decoder.tok.encode(r["source"]) for r in refs] == [r["source_ids"] for r in refs]


# --- the decoder variants --------------------------------------------------------------


def past_names(prefix: str) -> list[str]:
    return [f"{prefix}.{i}.decoder.{kv}" for i in range(LAYERS) for kv in ("key", "value")]


def test_no_encoder_kv_variant_signature() -> None:
    model = onnx.load(str(NO_KV))
    inputs = [i.name for i in model.graph.input]
    assert inputs == [
        "encoder_attention_mask",
        "input_ids",
        "encoder_hidden_states",
        *past_names("past_key_values"),
    ]
    assert len(inputs) == 3 + 2 * LAYERS
    assert [o.name for o in model.graph.output] == ["logits", *past_names("present")]


def test_no_past_variant_signature() -> None:
    model = onnx.load(str(NO_PAST))
    assert [i.name for i in model.graph.input] == [
        "encoder_attention_mask",
        "input_ids",
        "encoder_hidden_states",
    ]
    assert [o.name for o in model.graph.output] == ["logits"]


@pytest.mark.parametrize("case", range(len(REFERENCE["forced_logits"])))
def test_variants_match_pytorch_reference(case: int) -> None:
    """Forced prefix: the no-past variant in one call; the no-encoder-KV variant as a
    multi-token first call from zero-length past, then single-token calls."""
    forced = REFERENCE["forced_logits"][case]
    want = np.array(forced["logits"], dtype=np.float32)
    hidden, mask = encode(MODEL, forced["source_ids"])
    ids = np.array([forced["decoder_input_ids"]], dtype=np.int64)
    common = {"encoder_hidden_states": hidden, "encoder_attention_mask": mask}

    no_past = session(NO_PAST).run(["logits"], {**common, "input_ids": ids})[0][0]
    np.testing.assert_allclose(no_past, want, atol=2e-4)

    dec = session(NO_KV)
    past = empty_past(past_names("past_key_values"))
    got = []
    for start, end in [(0, 3), *((t, t + 1) for t in range(3, ids.shape[1]))]:
        out = dec.run(None, {**common, **past, "input_ids": ids[:, start:end]})
        got.append(out[0][0])
        past = dict(zip(past_names("past_key_values"), out[1:], strict=True))
        assert past["past_key_values.0.decoder.key"].shape == (1, HEADS, end, HEAD_DIM)
    np.testing.assert_allclose(np.concatenate(got), want, atol=2e-4)


# --- exporting (torch) -----------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_committed_checkpoint_holds_the_committed_onnx_weights(kind: str) -> None:
    """Every parameter of the committed checkpoint, bit for bit, is the one the committed
    fp32 ONNX files hold (read back by name, MatMul weights transposed; the offline fixture's
    decoder from its merged file)."""
    safetensors = pytest.importorskip("safetensors.numpy")
    state = safetensors.load_file(str(FIXTURE_CHECKPOINTS[kind] / "model.safetensors"))
    onnx_params = recover(FIXTURE_DIRS[kind] / "model")
    # Marian's sinusoidal position tables are computed from the config at load, not saved
    # (the re-export test below shows the computed ones equal the exported ones).
    positions = {name for name in onnx_params if name.endswith("embed_positions.weight")}
    assert len(positions) == 2 and not positions & set(state)
    onnx_params = {k: v for k, v in onnx_params.items() if k not in positions}
    assert set(onnx_params) <= set(state)
    # What the file has beyond the ONNX parameters are the tied copies of the embedding.
    for name in set(state) - set(onnx_params):
        assert name.endswith(("embed_tokens.weight", "lm_head.weight")), name
        np.testing.assert_array_equal(state[name], onnx_params["model.shared.weight"])
    for name, value in onnx_params.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_reexported_checkpoint_matches_committed_onnx(kind: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("optimum.exporters.onnx")
    checkpoint, model = FIXTURE_CHECKPOINTS[kind], FIXTURE_DIRS[kind] / "model"
    assert (checkpoint / "model.safetensors").is_file(), f"no fixture checkpoint at {checkpoint}"
    from engine.conversion.export import export_marian
    from engine.conversion.quantize import quantize_int8

    out = tmp_path / "model"
    export_marian(checkpoint, out, validate=False)
    for name in (*OPTIMUM_FILES, *TOKENIZER_FILES, "nmt-incremental.json"):
        assert (out / name).is_file(), name
    assert (out / "nmt-incremental.json").read_bytes() == (
        model / "nmt-incremental.json"
    ).read_bytes()
    for forced in REFERENCES[kind]["forced_logits"]:
        args = (forced["source_ids"], forced["decoder_input_ids"])
        np.testing.assert_allclose(
            merged_logits(out, *args), merged_logits(model, *args), atol=1e-4
        )
    quantize_int8(out)
    for forced in REFERENCES[kind]["forced_logits"]:
        args = (forced["source_ids"], forced["decoder_input_ids"])
        np.testing.assert_allclose(
            merged_logits(out, *args, quantized=True),
            merged_logits(model, *args, quantized=True),
            atol=1e-4,
        )


def test_quantize_int8_of_a_random_tied_marian(tmp_path: Path) -> None:
    """A random Marian with tied embeddings (like OPUS-MT) exports and quantizes: the check
    finds the int8 lm_head in both merged branches and in each split decoder, nowhere else."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("optimum.exporters.onnx")
    from engine.conversion.export import export_marian
    from engine.conversion.quantize import quantize_int8

    torch.manual_seed(0)
    config = transformers.MarianConfig.from_pretrained(str(MODEL))
    config.d_model, config.encoder_layers, config.decoder_layers = 32, 1, 2
    config.encoder_ffn_dim = config.decoder_ffn_dim = 64
    assert config.tie_word_embeddings
    checkpoint = tmp_path / "checkpoint"
    transformers.MarianMTModel(config).save_pretrained(str(checkpoint))
    for name in TOKENIZER_FILES:
        if not (checkpoint / name).exists():
            shutil.copyfile(MODEL / name, checkpoint / name)
    out = tmp_path / "onnx"
    export_marian(checkpoint, out, validate=False)
    quantize_int8(out)
    merged = onnx.load(str(out / "decoder_model_merged_quantized.onnx"))
    assert is_lm_head_quantized(merged) == {
        "main/If.else_branch": True,
        "main/If.then_branch": True,
    }
    for name in ("decoder_model", "decoder_with_past_model"):
        split = onnx.load(str(out / f"{name}_quantized.onnx"))
        assert is_lm_head_quantized(split) == {"main": True}, name


def test_variant_exports_of_a_random_checkpoint(tmp_path: Path) -> None:
    """Both variant exporters verify themselves against PyTorch (multi-token first call,
    then single-token steps); here on a random 2-layer model with the fixture's vocab."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from engine.conversion.export import (
        export_decoder_without_encoder_kv,
        export_decoder_without_past,
    )

    torch.manual_seed(0)
    config = transformers.MarianConfig.from_pretrained(str(MODEL))
    config.d_model, config.encoder_layers, config.decoder_layers = 32, 1, 2
    config.encoder_ffn_dim = config.decoder_ffn_dim = 64
    checkpoint = tmp_path / "checkpoint"
    transformers.MarianMTModel(config).save_pretrained(str(checkpoint))
    for name in TOKENIZER_FILES:
        if not (checkpoint / name).exists():
            shutil.copyfile(MODEL / name, checkpoint / name)

    export_decoder_without_encoder_kv(checkpoint, tmp_path / "kv" / "decoder_model.onnx")
    export_decoder_without_past(checkpoint, tmp_path / "nopast" / "decoder_model.onnx")
    kv = onnx.load(str(tmp_path / "kv" / "decoder_model.onnx"))
    assert len(kv.graph.input) == 3 + 2 * 2
    nopast = onnx.load(str(tmp_path / "nopast" / "decoder_model.onnx"))
    assert [o.name for o in nopast.graph.output] == ["logits"]
