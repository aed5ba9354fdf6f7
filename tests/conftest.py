"""Shared paths and fixtures: the committed fixture model and the optional ../shared data."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest

from engine.decoding.translator import Translator
from engine.model.config import OPTIONAL_TOKENIZER_FILES, PROJECT_CONFIG, TOKENIZER_FILES
from protocol.messages import PartialTranscript

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_DIR = ROOT / "models" / "fixture"
FIXTURE_MODEL = FIXTURE_DIR / "model"
# The committed PyTorch checkpoint the committed ONNX was exported from (the export tests
# re-export it); NMT_FIXTURE_CHECKPOINT points them at another one, e.g. a fresh retrain.
FIXTURE_CHECKPOINT = Path(os.environ.get("NMT_FIXTURE_CHECKPOINT", FIXTURE_DIR / "checkpoint"))
# The second fixture, trained like real OPUS-MT (whole sentences in recogniser styles, no
# partial marker): it invents endings for partials, as real models do. Streaming guarantees
# are checked on both (`FIXTURE_MODELS`).
FIXTURE_OFFLINE_DIR = ROOT / "models" / "fixture_offline"
FIXTURE_OFFLINE_MODEL = FIXTURE_OFFLINE_DIR / "model"
FIXTURE_OFFLINE_CHECKPOINT = Path(
    os.environ.get("NMT_FIXTURE_OFFLINE_CHECKPOINT", FIXTURE_OFFLINE_DIR / "checkpoint")
)
# The third, English -> German from the same grammar (`--target de`): a second language
# that translates for real, for fan-out.
FIXTURE_DE_MODEL = ROOT / "models" / "fixture_de" / "model"
FIXTURE_DIRS = {"prefix": FIXTURE_DIR, "offline": FIXTURE_OFFLINE_DIR}
FIXTURE_MODELS = {"prefix": FIXTURE_MODEL, "offline": FIXTURE_OFFLINE_MODEL}
FIXTURE_CHECKPOINTS = {"prefix": FIXTURE_CHECKPOINT, "offline": FIXTURE_OFFLINE_CHECKPOINT}
SHARED = ROOT.parent / "shared"
ZH_EN = SHARED / "opus-mt-zh-en"
FLORES = SHARED / "flores200-devtest"


def shared_absent(folder: Path) -> str:
    """The skip reason of a test that reads `folder` of ../shared (optional data beside
    the checkout; a fresh clone has none, and every other test runs)."""
    return (
        f"../shared/{folder.name} absent (optional data beside the checkout: "
        "docs/repository.md, '../shared: data beside the checkout')"
    )


# Files a model directory needs besides its ONNX files.
SIDE_FILES = (*TOKENIZER_FILES, *OPTIONAL_TOKENIZER_FILES, PROJECT_CONFIG)


def needs_fixture(kind: str = "prefix") -> None:
    if not (FIXTURE_MODELS[kind] / "encoder_model.onnx").is_file():
        pytest.skip(f"{kind} fixture model not built (models/fixture/build.py --kind {kind})")


def model_copy(dest: Path, onnx_files: dict[str, Path]) -> Path:
    """A model directory with the fixture's side files and the chosen ONNX files."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in SIDE_FILES:
        if (FIXTURE_MODEL / name).is_file():
            shutil.copy(FIXTURE_MODEL / name, dest / name)
    for name, source in onnx_files.items():
        shutil.copy(source, dest / name)
    return dest


@pytest.fixture(scope="session")
def fixture_variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One directory per decoder layout, all sharing the fixture's encoder and tokenizer."""
    needs_fixture()
    base = tmp_path_factory.mktemp("variants")
    enc = {"encoder_model.onnx": FIXTURE_MODEL / "encoder_model.onnx"}
    variants = FIXTURE_DIR / "variants"
    return {
        "merged": model_copy(
            base / "merged",
            {**enc, "decoder_model_merged.onnx": FIXTURE_MODEL / "decoder_model_merged.onnx"},
        ),
        "split": model_copy(
            base / "split",
            {
                **enc,
                "decoder_model.onnx": FIXTURE_MODEL / "decoder_model.onnx",
                "decoder_with_past_model.onnx": FIXTURE_MODEL / "decoder_with_past_model.onnx",
            },
        ),
        "self_kv_only": model_copy(
            base / "self_kv_only",
            {**enc, "decoder_model.onnx": variants / "no_encoder_kv" / "decoder_model.onnx"},
        ),
        "no_cache": model_copy(
            base / "no_cache",
            {**enc, "decoder_model.onnx": variants / "no_past" / "decoder_model.onnx"},
        ),
    }


def relabel(dest: Path, **settings: str) -> Path:
    """A copy of the fixture model whose nmt-incremental.json says other languages.

    The weights are the fixture's own (English -> Chinese): only the label changes. Tests
    of fan-out use it as a second target language, to check routing and per-language
    guarantees, not translation quality (there is one committed model)."""
    dest = model_copy(dest, {p.name: p for p in sorted(FIXTURE_MODEL.glob("*.onnx"))})
    project = json.loads((FIXTURE_MODEL / PROJECT_CONFIG).read_text(encoding="utf-8"))
    (dest / PROJECT_CONFIG).write_text(json.dumps({**project, **settings}), encoding="utf-8")
    return dest


@pytest.fixture(scope="session")
def relabelled_de(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture relabelled as an English -> German model (see `relabel`)."""
    needs_fixture()
    return relabel(tmp_path_factory.mktemp("fanout") / "en-de", target_lang="de")


@pytest.fixture(scope="session")
def german() -> Path:
    """The committed English -> German fixture (`models/fixture_de`)."""
    if not (FIXTURE_DE_MODEL / "encoder_model.onnx").is_file():
        pytest.skip("German fixture model not built (models/fixture/build.py --target de)")
    return FIXTURE_DE_MODEL


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def translator() -> Translator:
    """The committed fixture model, loaded once per test module (its scheduler's threads
    end with the module); a module that needs another model defines its own."""
    needs_fixture()
    return Translator.from_dir(FIXTURE_MODEL)


async def wait_for(condition: Callable[[], object], timeout: float = 10.0) -> None:
    """Poll `condition` until it holds: for state that a server changes on its own time."""
    with anyio.fail_after(timeout):
        while not condition():
            await anyio.sleep(0.01)


def partial_event(
    stream: str = "s", seq: int = 0, text: str = "I will", final: bool = False, segment: int = 0
) -> PartialTranscript:
    """A `partial_transcript` event (`final`: the segment's last)."""
    return PartialTranscript(stream, segment, seq, text, is_final=final)


def partial_message(
    stream: str, seq: int, text: str = "I will", final: bool = False, segment: int = 0
) -> str:
    """A `partial_transcript` as the wire's JSON text (with the spaces `json.dumps` puts, which
    some tests edit to break a field), for a WebSocket or a connection's core."""
    message = {"type": "partial_transcript", "stream_id": stream, "segment_id": segment}
    return json.dumps({**message, "seq": seq, "text": text, "is_final": final})


@dataclass
class Served:
    """A `nmt-incremental serve` subprocess and the stderr lines it has written so far."""

    proc: subprocess.Popen[str]
    reader: threading.Thread
    lines: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@contextlib.contextmanager
def serving(args: Sequence[str], ready_within: float) -> Iterator[Served]:
    """`nmt-incremental serve --port 0 ARGS` in a subprocess, yielded once it logs "ready"
    (asserted within `ready_within` s), its stderr lines collected as they come; killed on
    the way out if it still runs."""
    cmd = [sys.executable, "-m", "engine.cli", "serve", "--port", "0", *args]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    ready = threading.Event()
    lines: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            if line.rstrip().endswith(" ready"):
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(ready_within), "\n".join(lines)
        yield Served(proc, reader, lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def slow_decodes(
    monkeypatch: pytest.MonkeyPatch, delay: float = 0.0, until: threading.Event | None = None
) -> None:
    """Slow translations, as a slow model gives them: every decode's answer comes `delay`
    seconds after it was submitted (and, with `until`, not before that is set), from a
    thread of its own. The engine awaits its decodes' futures on the event loop, so this
    slows translating without blocking the loop, as a real model does."""
    import time
    from concurrent.futures import Future
    from typing import Any

    real = Translator.submit

    def submit(self: Translator, *args: Any, **kwargs: Any) -> Any:
        futures = real(self, *args, **kwargs)
        held: list[Future[Any]] = [Future() for _ in futures]

        def answer() -> None:
            time.sleep(delay)
            if until is not None:
                until.wait(30)
            for mine, theirs in zip(held, futures, strict=True):
                try:
                    mine.set_result(theirs.result())
                except BaseException as exc:
                    mine.set_exception(exc)

        threading.Thread(target=answer, daemon=True).start()
        return held

    monkeypatch.setattr(Translator, "submit", submit)
