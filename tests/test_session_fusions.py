"""The ONNX Runtime fusions a session runs without (`engine.model.sessions.fusions_off`):
`SkipLayerNormalization` on the CPU (its kernel ran slower than the `Add` and
`LayerNormalization` it replaces, docs/performance.md), `MatMulIntegerToFloat` in graphs
quantized per token; a profile of the session shows which kernels ran.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from engine.model.sessions import (
    PER_TOKEN_FUSIONS_OFF,
    SLOW_ON_CPU,
    RuntimeOptions,
    fusions_off,
    open_session,
)
from tests.conftest import FIXTURE_MODEL, needs_fixture

CUDA = ("CUDAExecutionProvider", "CPUExecutionProvider")


def test_which_fusions_are_off() -> None:
    assert fusions_off(RuntimeOptions()) == list(SLOW_ON_CPU) == ["SkipLayerNormFusion"]
    assert fusions_off(RuntimeOptions(), per_token=True) == [*PER_TOKEN_FUSIONS_OFF, *SLOW_ON_CPU]
    assert fusions_off(RuntimeOptions(skip_layer_norm=True)) == []
    assert fusions_off(RuntimeOptions(providers=CUDA)) == []  # a GPU keeps ONNX Runtime's
    assert fusions_off(RuntimeOptions(providers=CUDA), per_token=True) == list(
        PER_TOKEN_FUSIONS_OFF
    )


ENCODER = FIXTURE_MODEL / "encoder_model_quantized.onnx"  # ONNX Runtime fuses 3 of them


def _feed() -> dict[str, np.ndarray]:
    ids = np.random.default_rng(0).integers(1, 60, (2, 9), dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}


def _kernels_run(skip_layer_norm: bool, tmp_path: Path) -> tuple[set[str], np.ndarray]:
    """The op types a session of the fixture's int8 encoder ran, from its profile, and
    its hidden states."""
    prefix = str(tmp_path / f"profile-{skip_layer_norm}")
    options = RuntimeOptions(intra_op_threads=1, skip_layer_norm=skip_layer_norm, profile=prefix)
    session = open_session(str(ENCODER), options)
    states = session.run(None, _feed())[0]
    events = json.loads(Path(session.end_profiling()).read_text())
    kernels = {e["args"]["op_name"] for e in events if e.get("cat") == "Node" and "args" in e}
    return kernels, states


def test_a_cpu_session_runs_no_skip_layer_normalization(tmp_path: Path) -> None:
    """Off by default: `LayerNormalization` runs; on, ONNX Runtime's fused kernel does,
    and the states agree within its rounding."""
    needs_fixture()
    without, states = _kernels_run(False, tmp_path)
    with_it, fused_states = _kernels_run(True, tmp_path)
    assert "SkipLayerNormalization" not in without and "LayerNormalization" in without
    assert "SkipLayerNormalization" in with_it, "nothing to turn off: the test tests nothing"
    np.testing.assert_allclose(states, fused_states, atol=1e-5, rtol=0)
