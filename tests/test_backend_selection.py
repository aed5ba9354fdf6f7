"""The KV backend is chosen in one place (`engine.model.backend.select_backend`), logged at
load with its reason, and carried by the model; the KV slot pool's free list is its own
object (`engine.model.kv.slots.manager`), which the policy only asks whether rows fit; the
masked decoder is frozen once loaded; and the decoding and model layers keep to their
module rules (no module over 600 lines, no private name imported from another module)."""

from __future__ import annotations

import ast
import dataclasses
import logging
from pathlib import Path

import pytest

from engine import Translator
from engine.decoding.scheduler import SchedulerOptions
from engine.model.backend import Backend, Built, select_backend
from engine.model.kv.inplace.steps import InPlaceSteps
from engine.model.kv.slots.manager import KvSlotManager, SlotsExhausted
from engine.model.sessions import RuntimeOptions
from tests.conftest import FIXTURE_MODEL, needs_fixture

ROOT = Path(__file__).resolve().parent.parent
CPU, GPU = ("cpu", 0), ("cuda", 0)
MASKED = Built(masked=True)


@pytest.mark.parametrize(
    ("device", "options", "built", "backend", "reason"),
    [
        (CPU, RuntimeOptions(), MASKED, Backend.INPLACE, "the default on cpu"),
        # Why not slots on the CPU, as measured (docs/performance.md).
        (CPU, RuntimeOptions(), MASKED, Backend.INPLACE, "slower than the state in place"),
        (GPU, RuntimeOptions(), MASKED, Backend.SLOTS, "the default on cuda"),
        (CPU, RuntimeOptions(kv_slots=True), MASKED, Backend.SLOTS, "asked for"),
        (CPU, RuntimeOptions(inplace_attention=False), MASKED, Backend.COPIED, "turned off"),
        (GPU, RuntimeOptions(kv_slots=False), MASKED, Backend.COPIED, "copied"),
        (GPU, RuntimeOptions(inplace_attention=True, kv_slots=False), MASKED, Backend.INPLACE, ""),
        # What the load could not build falls back, with the reason.
        (GPU, RuntimeOptions(), Built(True, slots=False), Backend.COPIED, "slots were refused"),
        (
            CPU,
            RuntimeOptions(kv_slots=True),
            Built(True, slots=False),
            Backend.INPLACE,
            "slots were refused",
        ),
        (CPU, RuntimeOptions(), Built(True, inplace=False), Backend.COPIED, "was refused"),
        (CPU, RuntimeOptions(), Built(masked=False), Backend.LOCKSTEP, "could not be rewritten"),
        (GPU, RuntimeOptions(batchable=False), MASKED, Backend.LOCKSTEP, "--lockstep"),
        (CPU, RuntimeOptions(use_cache=False), MASKED, Backend.LOCKSTEP, "no decoder cache"),
    ],
)
def test_select_backend_chooses_by_device_options_and_what_was_built(
    device: tuple[str, int],
    options: RuntimeOptions,
    built: Built,
    backend: Backend,
    reason: str,
) -> None:
    chosen = select_backend(device, options, built)
    assert chosen.backend is backend
    assert reason in chosen.reason
    assert chosen.batching == ("lockstep" if backend is Backend.LOCKSTEP else "continuous")


def test_the_load_logs_its_choice_and_builds_only_the_chosen_backend(
    caplog: pytest.LogCaptureFixture,
) -> None:
    needs_fixture()
    with caplog.at_level(logging.INFO, logger="engine.model.load"):
        tr = Translator.from_dir(FIXTURE_MODEL, scheduler=SchedulerOptions(lanes=1))
    try:
        assert tr.model.backend.backend is Backend.INPLACE
        lines = [r.getMessage() for r in caplog.records if "KV backend" in r.getMessage()]
        assert len(lines) == 1 and "KV backend inplace: state in place" in lines[0]
        assert tr.scheduler.kv is None  # no slot graphs nor pool on the CPU by default
    finally:
        tr.close()
    slots = Translator.from_dir(FIXTURE_MODEL, scheduler=SchedulerOptions(lanes=1, kv_slots=2))
    try:
        assert slots.model.backend.backend is Backend.SLOTS
        assert slots.scheduler.kv is not None and slots.scheduler.kv.slots == 2
    finally:
        slots.close()


def test_scheduler_options_that_contradict_the_loaded_backend_are_refused() -> None:
    """The choice is the load's: a scheduler over a model loaded in place cannot quietly
    run another backend (it would not have its graphs)."""
    needs_fixture()
    from engine.decoding.scheduler import DecodeScheduler

    tr = Translator.from_dir(FIXTURE_MODEL, scheduler=SchedulerOptions(lanes=1))
    try:
        with pytest.raises(ValueError, match="inplace_attention=False"):
            DecodeScheduler(tr.model, SchedulerOptions(lanes=1, inplace_attention=False))
    finally:
        tr.close()


def test_the_masked_decoder_and_the_in_place_steps_are_frozen_once_loaded() -> None:
    needs_fixture()
    tr = Translator.from_dir(FIXTURE_MODEL, scheduler=SchedulerOptions(lanes=1))
    try:
        masked = tr.model.masked
        assert masked is not None
        with pytest.raises(dataclasses.FrozenInstanceError):
            masked.lookahead = False  # type: ignore[misc]
        assert not hasattr(masked, "slots") and not hasattr(masked, "inplace")
        steps = tr.model.kv
        assert isinstance(steps, InPlaceSteps)
        with pytest.raises(dataclasses.FrozenInstanceError):
            steps.one = None  # type: ignore[misc]
    finally:
        tr.close()


def test_the_slot_manager_owns_the_free_list() -> None:
    kv: KvSlotManager[str] = KvSlotManager(4)
    assert kv.fits(4) and not kv.fits(5) and kv.could_fit(4) and not kv.could_fit(5)
    first = kv.allocate("a", 3)
    assert first == (0, 1, 2) and kv.free == 1 and kv.slots_of("a") == first
    assert not kv.fits(2)
    with pytest.raises(SlotsExhausted):
        kv.allocate("b", 2)
    kv.release("a")
    assert kv.free == 4 and kv.slots_of("a") == ()
    # The slots given back last are given first (their pages are warm).
    assert kv.allocate("b", 1) == (0,)
    kv.release("never held")  # nothing held, nothing to give back
    assert kv.free == 3
    with pytest.raises(ValueError, match="at least one slot"):
        KvSlotManager(0)


def _modules(*folders: str) -> list[Path]:
    return [path for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))]


def test_no_decoding_or_model_module_holds_two_concerns() -> None:
    """A module past 600 lines holds two concerns (split it)."""
    long = {
        str(path.relative_to(ROOT)): n
        for path in _modules("engine/decoding", "engine/model")
        if (n := len(path.read_text().splitlines())) > 600
    }
    assert long == {}


def test_no_private_name_is_imported_from_another_module() -> None:
    found = []
    for path in _modules("engine/decoding", "engine/model"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engine"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                if private:
                    found.append(f"{path.relative_to(ROOT)}: {node.module} {private}")
    assert found == []
