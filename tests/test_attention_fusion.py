"""Attention cores fused (`engine.model.passes.attention`): each head-split attention of the
encoder and of the rewritten prefill as one ONNX `Attention`.

- On the fixture's fp32 and int8 graphs the fused encoder and prefill give the unfused
  graphs' outputs (the prefill's `present` keys and values too) within the rewrite
  check's tolerance, over batch sizes, lengths, padded rows and a source all padding,
  and ONNX Runtime runs fewer nodes: no `Softmax` left, one mask `Expand` per graph.
- Unfolded graphs (shapes computed from the cores' tensors) fuse too, with the same
  outputs.
- A graph it does not know (keys and values in heads only, probabilities read elsewhere,
  subgraphs, fused already) gives None and a logged reason.
- A load fuses by default where it measured (the CPU, not fp16), keeps a fused graph
  only where its check passes, and with the switch off loads the graphs it loaded before:
  no core fused, the same tokens as the fused load.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from engine import Translator
from engine.model.checks import REWRITE_TOLERANCE, check_encoder_rewrite, probe_feed
from engine.model.config import ModelConfig
from engine.model.fused import open_fused
from engine.model.load import load_batched_decoder
from engine.model.marian import MarianOnnx
from engine.model.names import MASK_INPUT, PRESENT
from engine.model.passes.attention import OPSET, fuse_attention
from engine.model.passes.graph import load_model
from engine.model.passes.shapes import fold_shapes
from engine.model.sessions import RuntimeOptions, fusions_off, open_session
from engine.model.tokenizer import MarianTokenizer
from tests.conftest import FIXTURE_MODEL, needs_fixture

SOURCES = ["Lucy wants to play tennis", "my brother on Sunday", "Lucy"]


def optimized_nodes(data: bytes, tmp_path: Path, name: str) -> Counter[str]:
    """Op counts of the graph ONNX Runtime runs for `data` as the engine opens it."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / f"{name}.onnx")
    options.log_severity_level = 3
    off = fusions_off(RuntimeOptions())
    ort.InferenceSession(data, options, providers=["CPUExecutionProvider"], disabled_optimizers=off)
    graph = onnx.load(str(tmp_path / f"{name}.onnx"), load_external_data=False).graph
    return Counter(n.op_type for n in graph.node)


def session(data: bytes) -> ort.InferenceSession:
    return open_session(data, RuntimeOptions(intra_op_threads=1))


def _encoder(quantized: bool) -> bytes:
    name = "encoder_model_quantized.onnx" if quantized else "encoder_model.onnx"
    folded = fold_shapes(load_model(FIXTURE_MODEL / name), "encoder")
    assert folded is not None
    data: bytes = folded.SerializeToString()
    return data


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "int8"])
def test_fused_encoder_gives_the_same_states_with_fewer_nodes(
    quantized: bool, tmp_path: Path
) -> None:
    needs_fixture()
    unfused = _encoder(quantized)
    model = fuse_attention(unfused, "encoder")
    assert model is not None
    fused = model.SerializeToString()
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["Attention"] == 3 and ops["Softmax"] == 0
    assert ops["Expand"] == 1  # the source mask, expanded once for every layer
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) == OPSET
    first, second = session(unfused), session(fused)
    for seed in (0, 1, 2):
        assert check_encoder_rewrite(first, second, seed=seed) <= REWRITE_TOLERANCE
    rng = np.random.default_rng(3)
    for rows, length in ((1, 1), (1, 30), (4, 2), (3, 7)):
        ids = rng.integers(1, 20, (rows, length), dtype=np.int64)
        mask = np.ones_like(ids)
        mask[-1, length // 2 :] = 0 if rows > 1 else 1  # a padded row
        feed = {"input_ids": ids, "attention_mask": mask}
        expected, got = first.run(None, feed)[0], second.run(None, feed)[0]
        np.testing.assert_allclose(got, expected, atol=REWRITE_TOLERANCE, rtol=0)
    before = optimized_nodes(unfused, tmp_path, "before")
    after = optimized_nodes(fused, tmp_path, "after")
    assert after["Softmax"] == 0 and after["Transpose"] == 0
    assert sum(after.values()) < 0.8 * sum(before.values())


def _prefill_feed(inputs: Any, rows: int, tokens: int, source: int, seed: int) -> dict[str, Any]:
    """A prefill of `rows` rows, the last one padded in both masks (and with one row, a
    source padded but for its first token)."""
    feed = probe_feed(
        inputs, past_len=0, cur_len=tokens, batch=rows, source_len=source, seed=seed, vocab=60
    )
    if rows > 1 and tokens > 1:
        feed[MASK_INPUT][-1, tokens // 2 :] = 0
    feed["encoder_attention_mask"][-1, 1:] = 0
    return feed


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "int8"])
def test_fused_prefill_gives_the_same_outputs_with_fewer_nodes(
    quantized: bool, tmp_path: Path
) -> None:
    """Every output, the `present` keys and values the operator now gives included."""
    needs_fixture()
    graphs = load_batched_decoder(FIXTURE_MODEL, quantized=quantized, check=False)
    assert graphs is not None
    model = fuse_attention(graphs.no_past, "prefill")
    assert model is not None
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["Attention"] == 6 and ops["Softmax"] == 0  # self and cross, three layers
    fused = model.SerializeToString()
    first, second = session(graphs.no_past), session(fused)
    names = [o.name for o in first.get_outputs()]
    assert any(n.startswith(PRESENT) for n in names)
    for rows, tokens, source, seed in ((1, 1, 1, 0), (2, 3, 5, 1), (3, 6, 9, 2), (1, 13, 14, 3)):
        feed = _prefill_feed(first.get_inputs(), rows, tokens, source, seed)
        for name, a, b in zip(names, first.run(names, feed), second.run(names, feed), strict=True):
            assert a.shape == b.shape, name
            np.testing.assert_allclose(b, a, atol=REWRITE_TOLERANCE, rtol=0, err_msg=name)
    before = optimized_nodes(graphs.no_past, tmp_path, "before")
    after = optimized_nodes(fused, tmp_path, "after")
    assert after["Softmax"] == 0
    assert sum(after.values()) < 0.8 * sum(before.values())


def test_unfolded_graphs_fuse_too() -> None:
    """Without `passes.shapes` the masks' `Slice` bounds and the `Reshape` targets are
    computed from `Shape`s of the cores' tensors (the cross-attention mask from the present
    keys' shape): those stay where a shape reads them, the rest fuses, the outputs agree."""
    needs_fixture()
    graphs = load_batched_decoder(FIXTURE_MODEL, check=False, fold=False)
    assert graphs is not None
    model = fuse_attention(graphs.no_past, "unfolded prefill")
    assert model is not None
    assert Counter(n.op_type for n in model.graph.node)["Attention"] == 6
    first, second = session(graphs.no_past), session(model.SerializeToString())
    names = [o.name for o in first.get_outputs()]
    feed = _prefill_feed(first.get_inputs(), 2, 4, 6, 0)
    for name, a, b in zip(names, first.run(names, feed), second.run(names, feed), strict=True):
        np.testing.assert_allclose(b, a, atol=REWRITE_TOLERANCE, rtol=0, err_msg=name)
    encoder = FIXTURE_MODEL / "encoder_model.onnx"
    fused = fuse_attention(encoder, "unfolded encoder")
    assert fused is not None
    assert check_encoder_rewrite(encoder, fused.SerializeToString()) <= REWRITE_TOLERANCE


def test_keys_and_values_in_heads_only_stay(caplog: pytest.LogCaptureFixture) -> None:
    """The with-past step reads its keys and values in heads (the past `Concat` and the
    encoder's keys fed to it): nothing to fuse, and the pass says why."""
    needs_fixture()
    caplog.set_level(logging.INFO, logger="engine.model.passes.attention")
    graphs = load_batched_decoder(FIXTURE_MODEL, check=False)
    assert graphs is not None
    assert fuse_attention(graphs.with_past, "step") is None
    assert "step: attention kept as exported" in caplog.text
    assert "in heads only" in caplog.text


def _toy_core(probabilities_out: bool = False) -> onnx.ModelProto:
    """x [b, t, 8] -> one two-head self-attention core, as the export writes it (no mask);
    with `probabilities_out`, the probabilities are a graph output too."""
    split = helper.make_tensor("split", TensorProto.INT64, [4], [0, 0, 2, 4])
    merge = helper.make_tensor("merge", TensorProto.INT64, [3], [0, 0, 8])
    half = helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])
    nodes = []
    for x in ("q", "k", "v"):
        nodes.append(helper.make_node("MatMul", ["x", f"w{x}"], [x]))
        nodes.append(helper.make_node("Reshape", [x, "split"], [f"{x}_split"]))
    nodes += [
        helper.make_node("Transpose", ["q_split"], ["qh"], perm=[0, 2, 1, 3]),
        helper.make_node("Transpose", ["k_split"], ["kt"], perm=[0, 2, 3, 1]),
        helper.make_node("Transpose", ["v_split"], ["vh"], perm=[0, 2, 1, 3]),
        helper.make_node("Mul", ["qh", "half"], ["qs"]),
        helper.make_node("MatMul", ["qs", "kt"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "vh"], ["o"]),
        helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["ot", "merge"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if probabilities_out:
        outputs.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, None))
    rng = np.random.default_rng(1)
    weights = [
        helper.make_tensor(f"w{x}", TensorProto.FLOAT, [8, 8], rng.standard_normal(64))
        for x in "qkv"
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t", 8])],
        outputs,
        [split, merge, half, *weights],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_toy_core_fuses_and_keeps_its_values() -> None:
    model = _toy_core()
    fused = fuse_attention(model, "toy")
    assert fused is not None
    assert [n.op_type for n in fused.graph.node] == ["MatMul"] * 3 + ["Attention"]
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    before = session(model.SerializeToString()).run(None, {"x": x})[0]
    after = session(fused.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(after, before, atol=1e-6, rtol=0)


def test_refuses_what_it_does_not_know(caplog: pytest.LogCaptureFixture) -> None:
    """Probabilities read outside the core; a graph fused already; one with subgraphs."""
    needs_fixture()
    caplog.set_level(logging.INFO, logger="engine.model.passes.attention")
    assert fuse_attention(_toy_core(probabilities_out=True), "read") is None
    assert "read: attention kept as exported (p: read outside the attention core)" in caplog.text
    fused = fuse_attention(_toy_core(), "once")
    assert fused is not None
    assert fuse_attention(fused, "twice") is None
    assert "twice: attention kept as exported (fused already)" in caplog.text
    merged = onnx.load(str(FIXTURE_MODEL / "decoder_model_merged.onnx"))
    assert fuse_attention(merged, "merged") is None
    assert "merged: attention kept as exported (a graph with subgraphs)" in caplog.text


def test_a_fused_graph_that_differs_is_not_used(caplog: pytest.LogCaptureFixture) -> None:
    needs_fixture()
    caplog.set_level(logging.WARNING, logger="engine.model.fused")
    options = RuntimeOptions(intra_op_threads=1)
    source = _encoder(False)
    assert open_fused(source, "far", options, lambda s: 1.0, REWRITE_TOLERANCE) is None
    assert "far: attention fused differs by 1 (tolerance 0.0001): not used" in caplog.text
    kept = open_fused(source, "near", options, lambda s: 0.0, REWRITE_TOLERANCE)
    assert kept is not None and b"Attention" in kept[0]


def test_fused_where_measured_only() -> None:
    """The CPU; not with the switch off, not on a GPU, not in the fp16 files."""
    assert RuntimeOptions().fuses
    assert not RuntimeOptions(fuse_attention=False).fuses
    assert not RuntimeOptions(fp16=True).fuses
    assert not RuntimeOptions(providers=("CUDAExecutionProvider", "CPUExecutionProvider")).fuses
    needs_fixture()
    off = RuntimeOptions(fuse_attention=False, intra_op_threads=1)
    assert open_fused(_encoder(False), "off", off, lambda s: 0.0, REWRITE_TOLERANCE) is None


def _translator(quantized: bool, fuse: bool) -> Translator:
    options = RuntimeOptions(quantized=quantized, fuse_attention=fuse, intra_op_threads=1)
    config = ModelConfig.from_dir(FIXTURE_MODEL)
    model = MarianOnnx(FIXTURE_MODEL, config, options)
    return Translator(model, MarianTokenizer.from_dir(FIXTURE_MODEL))


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "int8"])
def test_a_load_fuses_and_translates_as_the_unfused_load(
    quantized: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The encoder and the prefill fused by default (and kept: their checks pass); with
    the switch off nothing is fused; the tokens are the same, the scores within the
    rewrite tolerance."""
    needs_fixture()
    caplog.set_level(logging.INFO, logger="engine.model")
    fused = _translator(quantized, True)
    messages = [r.getMessage() for r in caplog.records]
    caplog.clear()
    plain = _translator(quantized, False)
    try:
        assert [m for m in messages if "attention cores fused" in m] == [
            f"{FIXTURE_MODEL}: {'encoder_model_quantized' if quantized else 'encoder_model'}"
            ".onnx: 3 attention cores fused",
            f"{FIXTURE_MODEL} (prefill): 6 attention cores fused",
        ]
        assert not any("attention fused" in m and "not used" in m for m in messages)
        assert not any("attention cores fused" in r.getMessage() for r in caplog.records)
        got, expected = fused.translate(SOURCES), plain.translate(SOURCES)
        assert [r.token_ids for r in got] == [r.token_ids for r in expected]
        for a, b in zip(got, expected, strict=True):
            assert a.score == pytest.approx(b.score, abs=REWRITE_TOLERANCE)
    finally:
        fused.close()
        plain.close()
