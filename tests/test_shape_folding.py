"""Shape plumbing folded (`engine.model.passes.shapes`): the encoder's and the rewritten
decoder's `Reshape` targets, `Expand` shapes and mask `Slice` bounds made constant where
they are provably the computed ones.

- On the fixture's fp32 and int8 graphs the folded graphs give the unfolded ones' outputs
  exactly, over several batch, past and token counts, and ONNX Runtime runs fewer nodes.
- The masks rewrite builds its causal mask from the two lengths (about ten nodes): the
  export's own (`Trilu`, `ScatterND`, ...) is gone, and the logits are the files' over
  new tokens after a cache too.
- A mask's `Expand` goes where elementwise ops broadcast it anyway, and stays where
  anything else reads the expanded shape.
- A graph it does not know (subgraphs, nothing provable, a target read from another
  tensor's shape) gives None and a logged reason.
- A model load folds by default and translates as the unfolded load does.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from engine import Translator
from engine.model.checks import check_encoder_rewrite, check_rewrite
from engine.model.load import load_batched_decoder
from engine.model.passes.shapes import fold_shapes
from tests.conftest import FIXTURE_MODEL, needs_fixture

SOURCES = ["Lucy wants to play tennis", "my brother on Sunday", "Lucy"]


def optimized_nodes(data: bytes, tmp_path: Path, name: str) -> Counter[str]:
    """Op counts of the graph ONNX Runtime runs for `data` (after its own optimisation)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(tmp_path / f"{name}.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    graph = onnx.load(str(tmp_path / f"{name}.onnx"), load_external_data=False).graph
    return Counter(n.op_type for n in graph.node)


def session(data: bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "int8"])
def test_folded_decoders_give_the_same_outputs_with_fewer_nodes(
    quantized: bool, tmp_path: Path
) -> None:
    needs_fixture()
    plain = load_batched_decoder(FIXTURE_MODEL, quantized=quantized, check=False, fold=False)
    folded = load_batched_decoder(FIXTURE_MODEL, quantized=quantized, check=False)
    assert plain is not None and folded is not None
    pairs = {
        "no past": (plain.no_past, folded.no_past),
        "with past": (plain.with_past, folded.with_past),
    }
    for label, (before, after) in pairs.items():
        first, second = session(before), session(after)
        shapes = (
            [(0, 3, 2), (0, 1, 1), (0, 6, 3)]
            if label == "no past"
            else [(4, 1, 2), (4, 1, 1), (7, 3, 1), (2, 2, 3)]
        )
        for past_len, cur_len, batch in shapes:
            worst = check_rewrite(first, second, past_len=past_len, cur_len=cur_len, batch=batch)
            assert worst == 0.0, (label, past_len, cur_len, batch)
        ran_before = optimized_nodes(before, tmp_path, f"{label}-before")
        ran_after = optimized_nodes(after, tmp_path, f"{label}-after")
        assert sum(ran_after.values()) < 0.9 * sum(ran_before.values()), label
        assert (
            ran_after["Shape"] < ran_before["Shape"] and ran_after["Concat"] < ran_before["Concat"]
        )


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "int8"])
def test_the_masks_rewrite_has_its_own_causal_mask(quantized: bool) -> None:
    needs_fixture()
    graphs = load_batched_decoder(FIXTURE_MODEL, quantized=quantized, check=False, fold=False)
    assert graphs is not None
    suffix = "_quantized" if quantized else ""
    files = {
        "no past": (FIXTURE_MODEL / f"decoder_model{suffix}.onnx", graphs.no_past),
        "with past": (FIXTURE_MODEL / f"decoder_with_past_model{suffix}.onnx", graphs.with_past),
    }
    for label, (path, rewritten) in files.items():
        ops = {n.op_type for n in onnx.load_from_string(rewritten).graph.node}
        assert not ops & {"Trilu", "ScatterND"}, label
        assert "ScatterND" in {n.op_type for n in onnx.load(str(path)).graph.node}
        probes = [(0, 1, 1), (0, 6, 3)] if label == "no past" else [(1, 1, 2), (4, 3, 1)]
        for past_len, cur_len, batch in probes:
            worst = check_rewrite(path, rewritten, past_len=past_len, cur_len=cur_len, batch=batch)
            assert worst <= (1e-4 if not quantized or cur_len == 1 else 0.05), (label, past_len)


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "int8"])
def test_folded_encoder_gives_the_same_states_with_fewer_nodes(
    quantized: bool, tmp_path: Path
) -> None:
    needs_fixture()
    path = FIXTURE_MODEL / ("encoder_model_quantized.onnx" if quantized else "encoder_model.onnx")
    original = onnx.load(str(path))
    folded = fold_shapes(original, "encoder")
    assert folded is not None
    assert len(original.graph.node) > len(folded.graph.node)  # the original is not changed
    data = folded.SerializeToString()
    assert check_encoder_rewrite(path, data) == 0.0
    for seed in (1, 2):
        assert check_encoder_rewrite(path, data, seed=seed) == 0.0
    before = optimized_nodes(original.SerializeToString(), tmp_path, "before")
    after = optimized_nodes(data, tmp_path, "after")
    assert sum(after.values()) < 0.85 * sum(before.values())


def test_one_source_row_of_any_length_matches(tmp_path: Path) -> None:
    """Lengths the probe does not use: one token, one row, long rows."""
    needs_fixture()
    path = FIXTURE_MODEL / "encoder_model.onnx"
    first = session(path.read_bytes())
    folded = fold_shapes(onnx.load(str(path)), "encoder")
    assert folded is not None
    second = session(folded.SerializeToString())
    rng = np.random.default_rng(3)
    for rows, length in ((1, 1), (1, 30), (4, 2)):
        ids = rng.integers(1, 20, (rows, length), dtype=np.int64)
        feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        np.testing.assert_array_equal(first.run(None, feed)[0], second.run(None, feed)[0])


def _reshape_graph(target_from: str, other: str | None = "c") -> onnx.ModelProto:
    """x [a, b, 8] reshaped to [Shape(<target_from>)[0], -1, 4]; the input `input_ids`
    is [<other>, 8] (None: an unnamed size)."""
    nodes = [
        helper.make_node("Shape", [target_from], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["first"], axis=0),
        helper.make_node("Unsqueeze", ["first", "axes"], ["first_1d"]),
        helper.make_node("Concat", ["first_1d", "rest"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["a", "b", 8]),
            helper.make_tensor_value_info("input_ids", TensorProto.FLOAT, [other, 8]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            helper.make_tensor("zero", TensorProto.INT64, [], [0]),
            helper.make_tensor("axes", TensorProto.INT64, [1], [0]),
            helper.make_tensor("rest", TensorProto.INT64, [2], [-1, 4]),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_target_read_from_the_input_folds() -> None:
    model = _reshape_graph("x")
    folded = fold_shapes(model, "toy")
    assert folded is not None
    assert [n.op_type for n in folded.graph.node] == ["Reshape"]
    x = np.arange(2 * 3 * 8, dtype=np.float32).reshape(2, 3, 8)
    feed = {"x": x, "input_ids": np.zeros((5, 8), dtype=np.float32)}
    before = session(model.SerializeToString()).run(None, feed)[0]
    after = session(folded.SerializeToString()).run(None, feed)[0]
    np.testing.assert_array_equal(before, after)


def test_a_target_read_from_an_inputs_named_size_is_read_from_the_input() -> None:
    """`c`, the ids' size, which need not be `a`: read from the ids at the head of the
    graph, once (what `passes.per_token`'s [B, T, N] targets get)."""
    model = _reshape_graph("input_ids")
    folded = fold_shapes(model, "toy")
    assert folded is not None
    ops = [n.op_type for n in folded.graph.node]
    assert ops == ["Shape", "Gather", "Concat", "Reshape"]
    assert folded.graph.node[0].input[0] == "input_ids"
    x = np.arange(2 * 3 * 8, dtype=np.float32).reshape(2, 3, 8)
    feed = {"x": x, "input_ids": np.zeros((4, 8), dtype=np.float32)}
    before = session(model.SerializeToString()).run(None, feed)[0]
    after = session(folded.SerializeToString()).run(None, feed)[0]
    assert before.shape == (4, 3, 4)
    np.testing.assert_array_equal(before, after)


def test_refuses_what_it_cannot_prove(caplog: pytest.LogCaptureFixture) -> None:
    """A target read from a size no input names (an unnamed dimension, which need not be
    `a`) stays computed; with nothing else to fold, the pass gives None and says why."""
    caplog.set_level(logging.INFO, logger="engine.model.passes.shapes")
    assert fold_shapes(_reshape_graph("input_ids", None), "toy") is None
    assert "toy: shape computations kept (no shape computation it can prove)" in caplog.text


def _mask_graph(reader: str) -> onnx.ModelProto:
    """mask [b, 1, 1, s] expanded to scores' [b, h, t, s] (computed from their shape),
    cast, then added to the scores (`reader` "Add") or read by a Softmax first."""
    nodes = [
        helper.make_node("Shape", ["scores"], ["shape"]),
        helper.make_node("Expand", ["mask", "shape"], ["wide"]),
        helper.make_node("Cast", ["wide"], ["wide_f"], to=TensorProto.FLOAT),
    ]
    if reader == "Add":
        nodes.append(helper.make_node("Add", ["scores", "wide_f"], ["out"]))
    else:
        nodes.append(helper.make_node("Softmax", ["wide_f"], ["soft"], axis=-1))
        nodes.append(helper.make_node("Add", ["scores", "soft"], ["out"]))
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("mask", TensorProto.INT64, ["b", 1, 1, "s"]),
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["b", 4, "t", "s"]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_mask_expand_goes_where_the_add_broadcasts_it() -> None:
    model = _mask_graph("Add")
    folded = fold_shapes(model, "toy")
    assert folded is not None
    assert [n.op_type for n in folded.graph.node] == ["Identity", "Cast", "Add"]
    rng = np.random.default_rng(0)
    feed = {
        "mask": rng.integers(0, 2, (2, 1, 1, 5)),
        "scores": rng.standard_normal((2, 4, 3, 5)).astype(np.float32),
    }
    before = session(model.SerializeToString()).run(None, feed)[0]
    after = session(folded.SerializeToString()).run(None, feed)[0]
    np.testing.assert_array_equal(before, after)


def test_an_expand_read_by_more_than_elementwise_ops_stays() -> None:
    """A Softmax over the expanded axis gives other values over fewer elements: the
    Expand is kept (and with nothing else to fold, the pass gives None)."""
    assert fold_shapes(_mask_graph("Softmax"), "toy") is None


def test_refuses_a_graph_with_subgraphs(caplog: pytest.LogCaptureFixture) -> None:
    needs_fixture()
    caplog.set_level(logging.INFO, logger="engine.model.passes.shapes")
    merged = onnx.load(str(FIXTURE_MODEL / "decoder_model_merged.onnx"))
    assert fold_shapes(merged, "merged") is None
    assert "merged: shape computations kept (a graph with subgraphs)" in caplog.text


def test_a_load_folds_and_translates_as_the_unfolded_load(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The encoder and both rewritten decoder graphs are folded by default (and checked:
    the load keeps them), and the tokens and scores are the unfolded load's."""
    needs_fixture()
    caplog.set_level(logging.INFO, logger="engine.model.passes.shapes")
    for quantized in (False, True):
        caplog.clear()
        folded = Translator.from_dir(FIXTURE_MODEL, quantized=quantized)
        folds = [r.getMessage() for r in caplog.records if "folded" in r.getMessage()]
        plain = Translator.from_dir(FIXTURE_MODEL, quantized=quantized, fold_shapes=False)
        try:
            # encoder, no past, with past; int8: both again once quantized per token
            assert len(folds) == (5 if quantized else 3), folds
            assert any("encoder_model" in m for m in folds)
            got, expected = folded.translate(SOURCES), plain.translate(SOURCES)
            assert [(r.token_ids, r.score) for r in got] == [
                (r.token_ids, r.score) for r in expected
            ]
        finally:
            folded.close()
            plain.close()
