"""Projections of one input packed into one product (`engine.model.passes.pack`): which
are packed, the values unchanged, and the fixture's graphs packed at load."""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from engine import Translator
from engine.decoding.scheduler import SchedulerOptions
from engine.model.names import SEQLENS_INPUT, TOTAL_INPUT
from engine.model.passes.pack import pack_projections
from engine.model.sessions import RuntimeOptions
from tests.conftest import FIXTURE_MODEL, needs_fixture


def _graph(opset: int) -> onnx.ModelProto:
    """x [B, T, 8] read by three projections with biases (4, 4 and 6 wide, one bias
    before its product in the `Add`), by a product without a bias and by a projection
    whose product is read twice; y by one projection."""
    rng = np.random.default_rng(0)

    def const(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    inits = [const(f"w{i}", 8, n) for i, n in enumerate((4, 4, 6, 5, 3, 2))]
    inits += [const(f"b{i}", n) for i, n in enumerate((4, 4, 6, 5, 3, 2))]
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["m0"]),
        helper.make_node("Add", ["m0", "b0"], ["q"]),
        helper.make_node("MatMul", ["x", "w1"], ["m1"]),
        helper.make_node("Add", ["b1", "m1"], ["k"]),
        helper.make_node("MatMul", ["x", "w2"], ["m2"]),
        helper.make_node("Add", ["m2", "b2"], ["v"]),
        helper.make_node("MatMul", ["x", "w3"], ["plain"]),  # no bias
        helper.make_node("MatMul", ["x", "w4"], ["m4"]),
        helper.make_node("Add", ["m4", "b4"], ["twice"]),
        helper.make_node("Relu", ["m4"], ["read_again"]),  # its product read twice
        helper.make_node("MatMul", ["y", "w5"], ["m5"]),
        helper.make_node("Add", ["m5", "b5"], ["other"]),
    ]
    outputs = ["q", "k", "v", "plain", "twice", "read_again", "other"]
    graph = helper.make_graph(
        nodes,
        "projections",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", 8]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "T", 8]),
        ],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["B", "T", None]) for o in outputs],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return list(session.run(None, feed))


@pytest.mark.parametrize("opset", [11, 18])
def test_projections_of_one_input_become_one_product_with_the_same_values(opset: int) -> None:
    model = _graph(opset)
    packed = onnx.ModelProto()
    packed.CopyFrom(model)
    assert pack_projections(packed, "test") == 1
    onnx.checker.check_model(packed)
    kinds = Counter(n.op_type for n in packed.graph.node)
    # q, k and v: one MatMul, one Add and a Split; the rest as they were.
    assert kinds == Counter({"MatMul": 4, "Add": 3, "Split": 1, "Relu": 1})
    weights = {i.name for i in packed.graph.initializer}
    assert not {"w0", "w1", "w2", "b0", "b1", "b2"} & weights
    rng = np.random.default_rng(1)
    feed = {name: rng.standard_normal((2, 3, 8)).astype(np.float32) for name in ("x", "y")}
    for got, want in zip(_run(packed, feed), _run(model, feed), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_graph_without_two_projections_of_one_input_is_left_as_it_is() -> None:
    model = _graph(18)
    kept = [n for n in model.graph.node if n.output[0] not in ("m1", "k", "m2", "v")]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    del model.graph.output[1:3]
    before = model.SerializeToString()
    assert pack_projections(model, "test") == 0
    assert model.SerializeToString() == before


def test_the_fixture_loads_with_its_projections_packed_and_translates_alike(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The encoder's, the prefill's and the in-place step's query, key and value (and the
    prefill's cross-attention keys and values) are packed at load; without the pass the
    answers are the same tokens."""
    needs_fixture()
    text = "Lucy wants to play tennis with my brother on Sunday"
    with caplog.at_level(logging.INFO, logger="engine.model.passes.pack"):
        tr = Translator.from_dir(FIXTURE_MODEL, scheduler=SchedulerOptions(lanes=1))
    packed = [r.getMessage() for r in caplog.records if "packed" in r.getMessage()]
    assert any("encoder" in m and "9 projections packed into 3" in m for m in packed), packed
    assert any("(prefill)" in m and "15 projections packed into 4" in m for m in packed), packed
    assert any("(step)" in m and "9 projections packed into 3" in m for m in packed), packed
    got = tr.translate([text])[0]
    tr.close()
    monkeypatch.setattr(RuntimeOptions, "packs", property(lambda self: False))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.model.passes.pack"):
        plain = Translator.from_dir(FIXTURE_MODEL, scheduler=SchedulerOptions(lanes=1))
    assert not [r for r in caplog.records if "packed" in r.getMessage()]
    want = plain.translate([text])[0]
    plain.close()
    assert got.token_ids == want.token_ids
    assert got.score == pytest.approx(want.score, abs=1e-5)


def _inplace_step() -> bytes:
    """The fixture's in-place step graph as the load rewrites it, before packing."""
    needs_fixture()
    from engine.model.kv.inplace.rewrite import rewrite_inplace
    from engine.model.load import DecoderGraphs, choose_files, masked_graphs, rewrite_pair

    graphs = DecoderGraphs(choose_files(FIXTURE_MODEL, RuntimeOptions()))
    pair = rewrite_pair(graphs)
    assert pair is not None
    masked = masked_graphs(pair, graphs.sources, None, per_token=False)
    step = rewrite_inplace(masked.with_past, "test")
    assert step is not None
    return step


def test_the_in_place_steps_attention_takes_its_query_key_and_value_packed() -> None:
    """In the in-place step, `GroupQueryAttention` reads the packed projection itself (its
    key and value inputs empty): no `Split`; its logits equal the unpacked step's."""
    step = _inplace_step()
    model = onnx.load_from_string(step)
    assert pack_projections(model, "test") == 3
    kinds = Counter(n.op_type for n in model.graph.node)
    assert kinds["Split"] == 0 and kinds["GroupQueryAttention"] == 3
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            assert node.input[0].startswith("packed_projection") and node.input[1:3] == ["", ""]
    plain = ort.InferenceSession(step, providers=["CPUExecutionProvider"])
    packed = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(2)
    feed: dict[str, np.ndarray] = {}
    for value in plain.get_inputs():
        dims = [d if isinstance(d, int) else {"batch_size": 2}.get(d, 5) for d in value.shape]
        if value.type == "tensor(float)":
            feed[value.name] = rng.standard_normal(dims).astype(np.float32)
        elif value.name == SEQLENS_INPUT:  # 4 positions so far, the past buffers hold 5
            feed[value.name] = np.full(dims, 4, dtype=np.int32)
        elif value.name == TOTAL_INPUT:
            feed[value.name] = np.array(5, dtype=np.int32)
        elif value.name == "input_ids":
            feed[value.name] = rng.integers(5, 900, dims).astype(np.int64)
        else:
            feed[value.name] = np.ones(dims, dtype=np.int64)
    for got, want in zip(packed.run(None, feed), plain.run(None, feed), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_a_graph_the_pass_cannot_order_is_left_as_it_was(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the packed graph cannot be ordered, the pass raises before changing the model,
    and the load's hook logs it and keeps the graph as it was (then checked as ever)."""
    import engine.model.passes.pack as pack
    from engine.model.fused import packed
    from engine.model.passes.graph import UnsortableGraph

    def refuse(nodes: list[onnx.NodeProto], known: set[str]) -> list[onnx.NodeProto]:
        raise UnsortableGraph("refused by the test")

    monkeypatch.setattr(pack, "sorted_nodes", refuse)
    # The in-place step too, whose attention nodes the pass gives the packed input.
    for model in (_graph(18), onnx.load_from_string(_inplace_step())):
        before = model.SerializeToString()
        with pytest.raises(UnsortableGraph):
            pack_projections(model, "test")
        assert model.SerializeToString() == before
    with caplog.at_level(logging.WARNING):
        assert packed(model, "test").SerializeToString() == before
    assert "projections not packed (refused by the test)" in caplog.text
