"""Options and files that cannot work get one `error:` line and exit status 2, not a
traceback (issue 53, finding 4): a beam wider than the KV slot pool, a pool larger than
memory, an ONNX file that is corrupt or truncated."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.model.memory import available_memory, size_text
from tests.conftest import FIXTURE_MODEL, ROOT, needs_fixture

LOG = ROOT / "examples" / "logs" / "fixture_en_zh.jsonl"


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    needs_fixture()
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def refused(done: subprocess.CompletedProcess[str], *words: str) -> str:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ")
    for word in words:
        assert word in last
    return last


@pytest.mark.parametrize("command", ["translate", "replay"])
def test_a_beam_wider_than_the_kv_slots_is_refused_before_loading(command: str) -> None:
    given = ["x"] if command == "translate" else [str(LOG)]
    done = cli(command, "--beam", "4", "--kv-slots", "2", *given)
    assert refused(done, "--beam 4", "--kv-slots 2") and done.stdout == ""
    assert "loading" not in done.stderr


def test_a_kv_slot_pool_larger_than_memory_is_refused_saying_what_fits() -> None:
    done = cli("serve", "--port", "0", "--kv-slots", "100000000")
    line = refused(done, "100000000 KV slots need", "would fill")
    fits = int(line.split(" which ")[1].split()[0])
    room = available_memory()
    assert room is not None and 0 < fits <= room // 1024
    assert "ready" not in done.stderr


def test_a_corrupt_or_truncated_onnx_file_is_refused_by_models_fp16(tmp_path: Path) -> None:
    needs_fixture()
    for name, content in [
        ("encoder_model.onnx", (FIXTURE_MODEL / "encoder_model.onnx").read_bytes()[:5000]),
        ("decoder_model.onnx", b""),  # parses as an empty model
    ]:
        model = tmp_path / name.split(".")[0]
        shutil.copytree(FIXTURE_MODEL, model)
        (model / name).write_bytes(content)
        done = cli("models", "fp16", str(model))
        refused(done, name, "not a valid ONNX model")
        assert not list(model.glob("*_fp16.onnx"))  # nothing written


def test_size_text() -> None:
    assert size_text(3 * 2**40 + 2**39) == "3.50 TiB"
    assert size_text(384 * 1024) == "384.00 KiB"
    assert size_text(12) == "12 B"
