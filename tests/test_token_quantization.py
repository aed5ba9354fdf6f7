"""int8 activations quantized per token: what a row gets does not depend on its batch.

The int8 files quantize each matmul input with one scale over the whole tensor, so
batching moves a row's values; `engine.model.passes.per_token.per_token` gives every token its
own scale with the files' arithmetic. Checked here against the files themselves: for one
token the values are the files' bit for bit, and each row of a batch gets exactly what it
gets alone (which the files' graphs do not).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from engine.model.checks import probe_feed
from engine.model.config import ModelConfig
from engine.model.kv.inplace.steps import InPlaceSteps
from engine.model.load import load_batched_decoder
from engine.model.names import PER_TOKEN_KEY
from engine.model.passes.graph import load_model
from engine.model.passes.head import split_output_projection
from engine.model.passes.per_token import (
    MAX_CORRECTION_ROWS,
    NotPerToken,
    _Emitter,
    correction_rows,
    per_token,
    per_token_graph,
)
from engine.model.sessions import RuntimeOptions, open_session
from tests.conftest import FIXTURE_MODEL, needs_fixture
from tests.test_batched_decoder import _session


def _tokens(model: bytes) -> Any:
    """A per-token graph's session, opened as the engine opens one."""
    return open_session(model, RuntimeOptions(intra_op_threads=1), per_token=True)


def _matmul_model(
    weights: np.ndarray, zero_point: Any, extra_user: bool = False, weight_scale: Any = 0.004
) -> Any:
    """x [B, T, K] -> DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul, as
    `quantize_dynamic` writes a matmul (uint8 weights with a zero point, or int8; a
    scalar weight scale, or one per output column)."""
    k = weights.shape[0]
    node = helper.make_node
    nodes = [
        node("DynamicQuantizeLinear", ["x"], ["q", "xs", "xz"]),
        node("MatMulInteger", ["q", "W", "xz", "wz"], ["y32"]),
        node("Cast", ["y32"], ["yf"], to=TensorProto.FLOAT),
        node("Mul", ["xs", "ws"], ["sc"]),
        node("Mul", ["yf", "sc"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if extra_user:  # a quantization read by something other than a matmul
        nodes.append(node("Cast", ["q"], ["leak"], to=TensorProto.FLOAT))
        outputs.append(helper.make_tensor_value_info("leak", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", k])],
        outputs,
        [
            numpy_helper.from_array(weights, "W"),
            numpy_helper.from_array(zero_point, "wz"),
            numpy_helper.from_array(np.asarray(weight_scale, np.float32), "ws"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _rows() -> np.ndarray:
    """Tokens that stress the range: mixed signs, all positive, all negative, all zero,
    one tiny value, and wide ones."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 2, 16)).astype(np.float32)
    x[1] = np.abs(x[1]) + 0.5
    x[2] = -np.abs(x[2]) - 0.5
    x[3] = 0.0
    x[4, 0] = 0.0
    x[4, 0, 5] = 1e-30
    x[5] *= 40.0
    return x


@pytest.mark.parametrize(
    ("weights", "zero_point", "weight_scale"),
    [
        (np.random.default_rng(0).integers(-127, 128, (16, 8)).astype(np.int8), np.int8(0), 0.004),
        (
            np.random.default_rng(1).integers(0, 256, (16, 8)).astype(np.uint8),
            np.uint8(131),
            0.004,
        ),
        (  # no correction rows fit: the column sums are subtracted after the matmul
            np.random.default_rng(2).integers(0, 256, (16, 8)).astype(np.uint8),
            np.uint8(0),
            0.004,
        ),
        (  # a scale per column: the files' Cast and Mul stay, fed the shapes they had
            np.random.default_rng(3).integers(-127, 128, (16, 8)).astype(np.int8),
            np.int8(0),
            np.linspace(0.001, 0.01, 8),
        ),
    ],
    ids=["int8 weights", "uint8 weights with a zero point", "uint8 zp 0", "per-column scale"],
)
def test_each_token_gets_what_it_gets_alone_and_one_token_the_files_value(
    weights: np.ndarray, zero_point: Any, weight_scale: Any
) -> None:
    model = _matmul_model(weights, zero_point, weight_scale=weight_scale)
    files = _session(model.SerializeToString())
    done = per_token(model)
    assert (done.quantizations, done.matmuls) == (1, 1)
    assert {p.key: p.value for p in model.metadata_props}[PER_TOKEN_KEY] == "1"
    ops = {node.op_type for node in model.graph.node}
    assert "QuantizeLinear" in ops
    assert ("DequantizeLinear" in ops) == (np.ndim(weight_scale) == 0)
    tokens = _tokens(model.SerializeToString())
    x = _rows()
    together = tokens.run(["y"], {"x": x})[0]
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            one = x[b : b + 1, t : t + 1]
            expected = files.run(["y"], {"x": one})[0]
            # Bit for bit: the files' own arithmetic on one token, and no dependence on the
            # other 11 tokens of the call.
            np.testing.assert_array_equal(tokens.run(["y"], {"x": one})[0], expected)
            np.testing.assert_array_equal(together[b : b + 1, t : t + 1], expected)
    assert np.all(together[3] == 0.0)  # an all-zero token: zeros, not 0 / 0
    # The files' graph itself is not per token: the same call moves rows.
    shared = files.run(["y"], {"x": x})[0]
    alone = np.concatenate([files.run(["y"], {"x": x[b : b + 1]})[0] for b in range(6)])
    assert float(np.abs(shared - alone).max()) > 1e-2


def _model(nodes: list[Any], inputs: list[Any], outputs: list[str], constants: list[Any]) -> Any:
    """A session of a small opset-18 graph (outputs of any type and shape)."""
    graph = helper.make_graph(
        nodes,
        "g",
        inputs,
        [helper.make_empty_tensor_value_info(name) for name in outputs],
        constants,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return _tokens(model.SerializeToString())


def _hard_tokens() -> list[np.ndarray]:
    """Activations [B, T, K] for the quantization's arithmetic: normal values over 60
    decades, one sign only, all-zero and subnormal tokens, and values exactly half a step
    from two levels (range 255 or 510: steps of exactly 1 or 2) that must round to even."""
    rng = np.random.default_rng(11)
    out = []
    for i in range(120):
        k = int(rng.choice([1, 2, 7, 16, 17, 64, 511, 512, 2048]))
        normal = rng.standard_normal((int(rng.integers(1, 4)), int(rng.integers(1, 9)), k))
        x = (normal * 10.0 ** rng.uniform(-30, 30, size=(*normal.shape[:2], 1))).astype(np.float32)
        if i % 5 == 1:
            x = np.abs(x)
        if i % 5 == 2:
            x = -np.abs(x)
        if i % 5 == 3:
            x[0, 0] = 0.0
            x[-1, -1, : k // 2] = rng.choice([1e-40, -3e-39, 1e-45], size=k // 2)
        if i % 5 == 4 and k > 2:
            half = rng.integers(-100, 155, size=x.shape).astype(np.float32) + 0.5
            half[..., 0], half[..., 1] = -100.0, 155.0  # range 255: a step of exactly 1
            x = half * np.float32(rng.choice([1.0, 2.0]))
        out.append(np.ascontiguousarray(x))
    return out


def test_the_per_token_quantize_linear_is_the_elementwise_arithmetic_bit_for_bit() -> None:
    """`_Emitter.quantize`'s one `QuantizeLinear` over the flattened tokens gives the
    values of the elementwise chain it stands for (divide by the step, round half to even,
    add the zero point, clip to 0..255, cast), in ONNX Runtime and in numpy; and for a
    token of normal range, what `DynamicQuantizeLinear` gives that token alone. With
    columns of zeros added for the correction rows (whose 0 then bounds the range in
    place of `Max` and `Min` with 0): the same step, zero point and values, and the added
    columns hold the zero point."""
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)
    tokens = {}
    for width in (0, 3):
        emit = _Emitter("q", "x", 18)
        outputs = [emit.quantize(width), emit.step, emit.point]
        tokens[width] = _model(emit.nodes, [x_info], outputs, emit.initializers)
    node = helper.make_node
    chain = _model(
        [
            node("Reshape", ["step", "column"], ["s"]),
            node("Reshape", ["zp", "column"], ["z"]),
            node("Div", ["flat", "s"], ["d"]),
            node("Round", ["d"], ["r"]),
            node("Add", ["r", "z"], ["a"]),
            node("Clip", ["a", "lo", "hi"], ["c"]),
            node("Cast", ["c"], ["q"], to=TensorProto.UINT8),
        ],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("flat", "step", "zp")],
        ["q"],
        [
            numpy_helper.from_array(np.array([-1, 1], np.int64), "column"),
            numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
            numpy_helper.from_array(np.array(255.0, np.float32), "hi"),
        ],
    )
    dynamic = _model(
        [node("DynamicQuantizeLinear", ["x"], ["dq", "ds", "dz"])],
        [x_info],
        ["dq", "ds", "dz"],
        [],
    )
    compared = 0
    for x in _hard_tokens():
        q, step, point = tokens[0].run(None, {"x": x})
        padded, padded_step, padded_point = tokens[3].run(None, {"x": x})
        np.testing.assert_array_equal(padded_step.view(np.int32), step.view(np.int32))
        np.testing.assert_array_equal(padded_point, point)
        np.testing.assert_array_equal(padded[:, : x.shape[-1]], q)
        np.testing.assert_array_equal(padded[:, x.shape[-1] :], np.repeat(point[:, None], 3, 1))
        flat = x.reshape(-1, x.shape[-1])
        assert q.shape == flat.shape and q.dtype == np.uint8 and step.shape == (len(flat),)
        (expected,) = chain.run(None, {"flat": flat, "step": step, "zp": point})
        np.testing.assert_array_equal(q, expected)
        by_hand = np.clip(np.round(flat / step[:, None]) + point[:, None], 0, 255)
        np.testing.assert_array_equal(q, by_hand.astype(np.uint8))
        for row, token in enumerate(flat):
            if not np.any(np.abs(token) >= np.finfo(np.float32).tiny):
                assert not q[row].any()  # no normal value: all zeros, as the files give
                continue
            dq, ds, dz = dynamic.run(None, {"x": token})
            np.testing.assert_array_equal(q[row], dq)
            assert (step[row], point[row]) == (ds, dz)
            compared += 1
    assert compared > 500


def test_dequantize_linear_is_cast_then_multiply_bit_for_bit() -> None:
    """A per-axis `DequantizeLinear` of int32 without a zero point gives
    `Mul(Cast(x), scale)` (either operand order) bit for bit, int32 values past 2**24
    (rounded to float) and scales from subnormal to huge included: what lets one pass
    stand for the matmul's Cast and Mul."""
    rng = np.random.default_rng(13)
    node = helper.make_node
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.INT32, None),
        helper.make_tensor_value_info("scale", TensorProto.FLOAT, None),
    ]
    one_pass = _model([node("DequantizeLinear", ["x", "scale"], ["y"], axis=0)], inputs, ["y"], [])
    two = _model(
        [
            node("Unsqueeze", ["scale", "axis"], ["column"]),
            node("Cast", ["x"], ["f"], to=TensorProto.FLOAT),
            node("Mul", ["f", "column"], ["y"]),
            node("Mul", ["column", "f"], ["y2"]),
        ],
        inputs,
        ["y", "y2"],
        [numpy_helper.from_array(np.array([1], np.int64), "axis")],
    )
    for n in (1, 3, 8, 17, 512, 2048, 60000):
        m = int(rng.integers(1, 40))
        x = rng.integers(-(2**31), 2**31, size=(m, n), dtype=np.int64).astype(np.int32)
        x[:, : n // 2] >>= rng.integers(0, 31, size=(m, 1)).astype(np.int32)
        scale = (10.0 ** rng.uniform(-44, 30, size=m)).astype(np.float32)
        scale[0] = np.float32(1e-45)
        (got,) = one_pass.run(None, {"x": x, "scale": scale})
        expected, swapped = two.run(None, {"x": x, "scale": scale})
        np.testing.assert_array_equal(got.view(np.int32), expected.view(np.int32))
        np.testing.assert_array_equal(got.view(np.int32), swapped.view(np.int32))
        with np.errstate(over="ignore"):
            by_hand = x.astype(np.float32) * scale[:, None]
        np.testing.assert_array_equal(got.view(np.int32), by_hand.view(np.int32))


def test_matmuls_of_one_quantization_with_and_without_correction_rows() -> None:
    """One quantization read by a matmul whose correction fits in rows (int8) and one
    whose does not (uint8 with zero point 0: its weights get rows of their zero point for
    the padded columns, and the column sums are subtracted after): both give the files'
    values for one token and each token what it gets alone."""
    rng = np.random.default_rng(6)
    node = helper.make_node
    nodes = [node("DynamicQuantizeLinear", ["x"], ["q", "xs", "xz"])]
    constants = [numpy_helper.from_array(np.array(0.004, np.float32), "ws")]
    for i, weights in enumerate(
        [
            rng.integers(-127, 128, (64, 8)).astype(np.int8),
            rng.integers(0, 256, (64, 5)).astype(np.uint8),
        ]
    ):
        zero = np.zeros((), weights.dtype)
        nodes += [
            node("MatMulInteger", ["q", f"W{i}", "xz", f"wz{i}"], [f"i{i}"]),
            node("Cast", [f"i{i}"], [f"f{i}"], to=TensorProto.FLOAT),
            node("Mul", ["xs", "ws"], [f"s{i}"]),
            node("Mul", [f"f{i}", f"s{i}"], [f"y{i}"]),
        ]
        constants += [
            numpy_helper.from_array(weights, f"W{i}"),
            numpy_helper.from_array(zero, f"wz{i}"),
        ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", 64])],
        [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in (0, 1)],
        constants,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    files = _session(model.SerializeToString())
    done = per_token(model)
    assert (done.quantizations, done.matmuls) == (1, 2)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Pad") == 1 and ops.count("Sub") == 2  # the range's, the correction's
    tokens = _tokens(model.SerializeToString())
    x = np.concatenate([_rows()] * 4, axis=-1)
    together = tokens.run(["y0", "y1"], {"x": x})
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            alone = files.run(["y0", "y1"], {"x": x[b : b + 1, t : t + 1]})
            for got, expected in zip(together, alone, strict=True):
                np.testing.assert_array_equal(got[b : b + 1, t : t + 1], expected)


@pytest.mark.parametrize(
    ("dtype", "zero"),
    [(np.int8, 0), (np.uint8, 131), (np.uint8, 0)],
    ids=["int8", "uint8 zp", "uint8 zp 0"],
)
def test_correction_rows_subtract_the_zero_point_inside_the_matmul(dtype: Any, zero: int) -> None:
    """Values widened by their zero point and weights by `correction_rows` give
    sum_k (q - zp) (w - wz) in int32, for every zero point; None where the pieces cannot
    have the sign they need (uint8 weights with zero point 0 give only >= 0) or would
    take too many rows."""
    rng = np.random.default_rng(5)
    info = np.iinfo(dtype)
    w = rng.integers(info.min, info.max + 1, (64, 12)).astype(dtype)
    w[:8, 0] = info.max  # large column sums, one sign
    w[:8, 1] = info.min  # and the other
    rows = correction_rows(w, None if zero == 0 else np.array(zero, dtype))
    if dtype is np.uint8 and zero == 0:
        assert rows is None
        return
    assert rows is not None and rows.dtype == w.dtype
    assert 0 < len(rows) <= 64 * MAX_CORRECTION_ROWS
    wide = np.concatenate([w, rows]).astype(np.int64) - zero
    q = rng.integers(0, 256, (9, 64))
    for zp in (0, 1, 127, 255):
        got = np.concatenate([q, np.full((9, len(rows)), zp)], axis=1) @ wide
        np.testing.assert_array_equal(got, (q - zp) @ (w.astype(np.int64) - zero))
    assert correction_rows(w[:4], None if zero == 0 else np.array(zero, dtype)) is None


def test_a_quantization_read_by_anything_but_matmuls_is_refused_and_the_graph_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    weights = np.ones((16, 8), np.int8)
    model = _matmul_model(weights, np.int8(0), extra_user=True)
    before = model.SerializeToString()
    with pytest.raises(NotPerToken, match="values feed Cast"):
        per_token(model)
    assert model.SerializeToString() == before
    with caplog.at_level(logging.WARNING):
        assert per_token_graph(model, "leaky") is None
    assert "leaky: int8 activations stay quantized per call" in caplog.text


def test_an_fp32_graph_has_nothing_to_rewrite() -> None:
    needs_fixture()
    model = onnx.load(str(FIXTURE_MODEL / "decoder_with_past_model.onnx"))
    assert per_token(model).quantizations == 0
    assert PER_TOKEN_KEY not in {p.key for p in model.metadata_props}
    assert per_token_graph(FIXTURE_MODEL / "decoder_with_past_model.onnx", "fp32") is None


@pytest.mark.parametrize(
    "file", ["decoder_with_past_model", "decoder_model", "decoder_model_merged", "encoder_model"]
)
def test_the_fixtures_int8_graphs_per_token(file: str) -> None:
    """One row of one token: the files' outputs bit for bit. Four rows in one call: each
    row's outputs what it gets alone, bit for bit (the files' graphs: not)."""
    needs_fixture()
    path = FIXTURE_MODEL / f"{file}_quantized.onnx"
    rewritten = per_token_graph(path, file)
    assert rewritten is not None
    # Both as the engine opens them (the same ONNX Runtime fusions: `fusions_off`).
    files = open_session(str(path), RuntimeOptions(intra_op_threads=1))
    tokens = _tokens(rewritten)
    output = files.get_outputs()[0].name
    inputs = files.get_inputs()
    if file == "encoder_model":
        rng = np.random.default_rng(0)
        ids = rng.integers(1, 60, (4, 1), dtype=np.int64)
        feeds = [{"input_ids": ids, "attention_mask": np.ones_like(ids)}]
    else:
        # One token in every quantized tensor: one target token, and in the no-past call
        # (which projects the encoder states for cross-attention) a one-token source.
        past = 0 if file == "decoder_model" else 4
        feeds = [
            probe_feed(
                inputs,
                past_len=past,
                cur_len=1,
                batch=4,
                vocab=60,
                seed=s,
                source_len=1 if past == 0 else 5,
            )
            for s in (0, 1)
        ]
    for feed in feeds:
        together = tokens.run([output], feed)[0]
        shared = files.run([output], feed)[0]
        moved = 0.0
        for r in range(4):
            row = {k: v[r : r + 1] if v.ndim and v.shape[0] == 4 else v for k, v in feed.items()}
            alone = files.run([output], row)[0]
            np.testing.assert_array_equal(tokens.run([output], row)[0], alone)
            np.testing.assert_array_equal(together[r : r + 1], alone)
            moved = max(moved, float(np.abs(shared[r : r + 1] - alone).max()))
        assert moved > 1e-4, "the files' graph did not depend on the batch: nothing tested"


def test_the_engine_runs_int8_per_token_and_a_lone_token_on_the_files_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Encodes of padded batches give each source what it gets alone (its own call, the
    file's values); a step of one row and one token runs the files' quantization (fused
    kernels, same values), every other step the per-token graph. `int8_per_token=False`
    runs the files as they are."""
    from engine import DecodeOptions, Translator
    from engine.decoding.scheduler import SchedulerOptions

    needs_fixture()
    texts = ["I will meet Tom at three", "we eat noodles"]
    moved = {}
    for per_token_on in (True, False):
        tr = Translator.from_dir(FIXTURE_MODEL, quantized=True, int8_per_token=per_token_on)
        assert tr.model.masked is not None
        assert (tr.model.masked.one_token is not None) == per_token_on
        sources = [tr.source_ids(t) for t in texts]
        both = tr.encode(sources).hidden_states
        moved[per_token_on] = max(
            float(np.abs(both[r, : len(s)] - tr.encode([s]).hidden_states[0]).max())
            for r, s in enumerate(sources)
        )
    assert moved[True] == 0.0 and moved[False] > 1e-3

    # Steps over KV slots, with self-attention in place (the CPU's default) and with the
    # state copied.
    for kv_slots, inplace in ((8, None), (0, None), (0, False)):
        tr = Translator.from_dir(
            FIXTURE_MODEL,
            quantized=True,
            scheduler=SchedulerOptions(kv_slots=kv_slots, inplace_attention=inplace),
        )
        masked = tr.model.masked
        assert masked is not None and masked.one_token is not None
        pool = tr.scheduler.kv
        assert (pool is not None) == bool(kv_slots)
        runs = {"one": 0, "tokens": 0}
        if pool is not None:
            sessions = {"one": pool.sessions["one_token"], "tokens": pool.sessions["step"]}
            method = "run_with_iobinding"
        elif inplace is None:
            steps = tr.model.kv
            assert isinstance(steps, InPlaceSteps) and steps.one is not None
            sessions = {"one": steps.one.session, "tokens": steps.graph.session}
            method = "run_with_iobinding"
        else:
            assert masked.one_token is not None
            sessions = {"one": masked.one_token.session, "tokens": masked.steps.session}
            method = "run"
        for name, session in sessions.items():
            original = getattr(session, method)

            def counted(
                *args: Any, _name: str = name, _run: Any = original, _runs: Any = runs
            ) -> Any:
                _runs[_name] += 1
                return _run(*args)

            monkeypatch.setattr(session, method, counted)
        enc = tr.encode([tr.source_ids(texts[0])])
        tr.decode(enc, DecodeOptions(), prefixes=[[]])
        assert runs["one"] > 0 and runs["tokens"] == 0, (kv_slots, inplace)


def test_a_per_token_step_is_cut_at_its_projection_with_its_quantization() -> None:
    """The head of a per-token step holds its projection's quantization, which reads the
    shape of the head's input (to give the flat dequantized logits their shape back):
    body then head are the whole step bit for bit, batched rows included."""
    needs_fixture()
    pair = load_batched_decoder(FIXTURE_MODEL, quantized=True, check=False, per_token=True)
    assert pair is not None and pair.one_token is not None
    split = split_output_projection(pair.with_past, ModelConfig.from_dir(FIXTURE_MODEL).vocab_size)
    assert split is not None
    head_graph = load_model(split.head).graph
    shapes = [n for n in head_graph.node if n.op_type == "Shape"]
    assert shapes and all(list(n.input) == [split.hidden] for n in shapes)
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in head_graph.node}
    whole, body, head = _tokens(pair.with_past), _tokens(split.body), _tokens(split.head)
    feed = probe_feed(whole.get_inputs(), past_len=5, cur_len=2, batch=3, source_len=4)
    expected = whole.run(["logits"], feed)[0]
    hidden = body.run([split.hidden], feed)[0]
    np.testing.assert_array_equal(head.run(["logits"], {split.hidden: hidden})[0], expected)
