"""One scheduler turn's path stays in the batch and its backend (issue 55): the files a
decode runs through on the lane's thread, traced call by call, are the decoding core
(scheduler, policy, the one `ContinuousBatch` and its searches) and the model layer, and
under `engine/model/kv/` only the chosen backend's own module or package and the
interface every backend shares (`base.py`, `arrays.py`). Before the one batch, a turn over
KV slots went back and forth between `slot_batch.py` and helpers kept in `batch.py`; a
backend reaching into another backend's files, or the turn leaving the decoding and model
layers, fails here."""

from __future__ import annotations

import threading
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from engine import DecodeOptions, Translator
from engine.decoding.scheduler import SchedulerOptions
from engine.model.backend import Backend
from tests.conftest import FIXTURE_MODEL, needs_fixture
from tests.test_backend_exactness import BACKENDS

ENGINE = Path(__file__).resolve().parent.parent / "engine"
SHARED_KV = {"kv/base.py", "kv/arrays.py", "kv/__init__.py"}


def _traced_files(backend: Backend, options: dict[str, object]) -> list[str]:
    """The engine files (relative to `engine/`) entered by the scheduler's threads while
    two sources are translated greedily and with a beam, in the order first entered."""
    options = dict(options)
    batchable = bool(options.pop("batchable", True))
    recording = threading.Event()
    seen: dict[str, None] = {}
    root = str(ENGINE) + "/"

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and recording.is_set():
            name = frame.f_code.co_filename
            if name.startswith(root):
                seen.setdefault(name[len(root) :], None)

    # Only threads started after this are profiled: the lanes (started by the first
    # decode), not this test's thread.
    threading.setprofile(profile)
    try:
        tr = Translator.from_dir(
            FIXTURE_MODEL,
            scheduler=SchedulerOptions(
                lanes=1,
                kv_slots=options.pop("kv_slots", None),  # type: ignore[arg-type]
                inplace_attention=options.pop("inplace_attention", None),  # type: ignore[arg-type]
            ),
            batchable=batchable,
            **options,  # type: ignore[arg-type]
        )
        tr.translate(["a warm-up."])
    finally:
        threading.setprofile(None)
    try:
        assert tr.model.backend.backend is backend, tr.model.backend.reason
        recording.set()
        sources = ["the cat sat on the mat.", "a dog ran."]
        greedy = tr.translate(sources, DecodeOptions(beam_size=1))
        beam = tr.translate(sources, DecodeOptions(beam_size=2))
        recording.clear()
        assert all(greedy) and all(beam)
    finally:
        tr.close()
    return list(seen)


@pytest.mark.parametrize("backend", list(BACKENDS), ids=[b.value for b in BACKENDS])
def test_a_turn_stays_in_the_batch_and_its_backend(backend: Backend) -> None:
    needs_fixture()
    files = _traced_files(backend, BACKENDS[backend])
    assert "decoding/continuous.py" in files, files
    outside = [f for f in files if not f.startswith(("decoding/", "model/"))]
    assert not outside, f"a decode turn left the decoding and model layers: {outside}"
    kv = [f.removeprefix("model/") for f in files if f.startswith("model/kv/")]
    own = (f"kv/{backend.value}.py", f"kv/{backend.value}/")
    assert any(f.startswith(own) for f in kv), (backend, kv)
    foreign = [f for f in kv if f not in SHARED_KV and not f.startswith(own)]
    assert not foreign, f"{backend.value} reached into other backends' files: {foreign}"
