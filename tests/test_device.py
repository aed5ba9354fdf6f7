"""Devices and precisions without a GPU: `--device` answers what cannot run here in one
line, and fp16 files (`models fp16`) run on the CPU provider, over KV slots in fp16,
giving what fp32 gives on the fixture's held-out sentences (as often as measured)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from engine import Translator
from engine.conversion.fp16 import convert_fp16
from engine.decoding.scheduler import SchedulerOptions
from engine.model.config import ModelConfig
from engine.model.names import onnx_file
from engine.model.passes.head import split_output_projection
from engine.model.sessions import CUDA, DeviceUnavailable, device_options
from tests.conftest import FIXTURE_DIR, FIXTURE_MODEL, ROOT, needs_fixture

NO_CUDA = CUDA not in ort.get_available_providers()


def test_device_names() -> None:
    assert device_options("cpu") == {"providers": ("CPUExecutionProvider",), "device_id": 0}
    for wrong in ("gpu", "cuda:x", "cpu:1", ""):
        with pytest.raises(ValueError, match="use cpu, cuda or cuda:N"):
            device_options(wrong)


@pytest.mark.skipif(not NO_CUDA, reason="this onnxruntime has the CUDA provider")
def test_cuda_without_the_gpu_build_names_what_is_missing() -> None:
    with pytest.raises(DeviceUnavailable, match=r"no CUDA provider.*\[gpu\] extra"):
        device_options("cuda:1")


def nmt(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


@pytest.mark.skipif(not NO_CUDA, reason="this onnxruntime has the CUDA provider")
def test_the_cli_answers_a_device_it_cannot_use_in_one_line() -> None:
    needs_fixture()
    model = str(FIXTURE_MODEL)
    for args, said in (
        (["--device", "cuda"], "install the [gpu] extra"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--fp16", "--quantized"], "not allowed with argument"),
    ):
        done = nmt("translate", "--model", model, *args, "we eat noodles")
        assert done.returncode == 2, done
        assert said in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.fixture(scope="module")
def fp16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    needs_fixture()
    copy = tmp_path_factory.mktemp("fp16") / "model"
    shutil.copytree(FIXTURE_MODEL, copy)
    done = nmt("models", "fp16", str(copy))
    assert done.returncode == 0, done.stderr
    written = {Path(line).name for line in done.stdout.split()}
    assert onnx_file("encoder_model", fp16=True) in written
    assert onnx_file("decoder_with_past_model", fp16=True) in written
    return copy


def test_fp16_files_run_on_the_cpu_over_fp16_kv_slots(fp16_model: Path) -> None:
    half = Translator.from_dir(fp16_model, fp16=True, scheduler=SchedulerOptions(kv_slots=8))
    full = Translator.from_dir(fp16_model)
    assert half.model.float_type is np.float16
    pool = half.scheduler.kv
    assert pool is not None and pool.float_type is np.float16
    assert half.model.batching == "continuous"
    lines = (FIXTURE_DIR / "heldout.tsv").read_text(encoding="utf-8").splitlines()[:40]
    sources = [line.split("\t")[0] for line in lines]
    same = sum(
        half.translate([s])[0].token_ids == full.translate([s])[0].token_ids for s in sources
    )
    # Measured (examples/benchmarks/fp16_agreement.py): 200 of 200 on the fixture.
    assert same >= len(sources) - 1, same
    assert half.scheduler.kv_slots == {"total": 8, "free": 8, "bytes": pool.bytes}


def test_an_fp16_graph_is_cut_at_its_projection_with_fp16_hidden_states(fp16_model: Path) -> None:
    """The cut declares the hidden states in the projection's own precision: declared as
    float32, ONNX Runtime refused both parts of an fp16 graph (a type error at load)."""
    data = (fp16_model / onnx_file("decoder_with_past_model", fp16=True)).read_bytes()
    split = split_output_projection(data, ModelConfig.from_dir(fp16_model).vocab_size)
    assert split is not None
    (hidden,) = onnx.load_from_string(split.head).graph.input
    assert hidden.name == split.hidden
    assert hidden.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    body = ort.InferenceSession(split.body, providers=["CPUExecutionProvider"])
    head = ort.InferenceSession(split.head, providers=["CPUExecutionProvider"])
    assert split.hidden in {o.name for o in body.get_outputs()}
    assert head.get_inputs()[0].type == "tensor(float16)"


def test_a_missing_fp16_file_says_how_to_make_it() -> None:
    needs_fixture()
    done = nmt("translate", "--model", str(FIXTURE_MODEL), "--fp16", "we eat noodles")
    assert done.returncode == 2
    assert "missing encoder_model_fp16.onnx" in done.stderr
    assert "nmt-incremental models fp16" in done.stderr


def test_the_conversion_refuses_a_directory_without_fp32_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no fp32 encoder_model\.onnx"):
        convert_fp16(tmp_path)
