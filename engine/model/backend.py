"""Which KV backend a model's decoding runs over, chosen in one place (`select_backend`).

A backend is where a batch's rows keep their decoder state between calls:

- `LOCKSTEP`: the stock decoder graphs, whose rows keep one length; requests that start
  together run together (no rewrite, or none asked for);
- `COPIED`: the masked decoder (`engine.model.masked`); every step is handed the rows'
  keys and values and returns them one position longer;
- `INPLACE`: lane buffers that each step reads and extends in place
  (`engine.model.kv.inplace.steps`); the CPU's default;
- `SLOTS`: a pool of KV slots allocated at start, a slot per running row
  (`engine.model.kv.slots.pool`); a GPU's default, where they replay CUDA graphs.

The load asks `select_backend` what to build, builds it, and asks again with what it
could build, so that a backend whose graphs were refused falls back here, and only here;
the choice and its reason are logged once. Nothing above the load chooses again: the
scheduler runs the backend the model carries (`MarianOnnx.backend`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.model.sessions import RuntimeOptions


class Backend(str, enum.Enum):
    """A KV backend (module docstring)."""

    LOCKSTEP = "lockstep"
    COPIED = "copied"
    INPLACE = "inplace"
    SLOTS = "slots"


@dataclass(frozen=True)
class Built:
    """What a load has for each backend so far: True built, False refused (logged where
    it was), None not tried yet. `masked`: the masked decoder, which every backend but
    lockstep runs on."""

    masked: bool
    inplace: bool | None = None
    slots: bool | None = None


@dataclass(frozen=True)
class Selection:
    """The backend chosen and why, in words for the log and `serve`'s model line."""

    backend: Backend
    reason: str

    @property
    def batching(self) -> str:
        """`continuous` (rows join and leave at any step) or `lockstep`."""
        return "lockstep" if self.backend is Backend.LOCKSTEP else "continuous"


def select_backend(device: tuple[str, int], options: RuntimeOptions, model: Built) -> Selection:
    """The backend for a model on `device` ("cpu" or "cuda", index), asked for by
    `options` (`batchable`, `use_cache`, `kv_slots`, `inplace_attention`; None: the
    device's default), given what the load has built (`model`). A backend not tried yet
    is chosen where it would be wanted: the load builds it and asks again."""
    kind = device[0]
    if not options.batchable:
        return Selection(Backend.LOCKSTEP, "continuous batching turned off (--lockstep)")
    if not options.use_cache:
        return Selection(Backend.LOCKSTEP, "no decoder cache (--no-cache)")
    if not model.masked:
        return Selection(Backend.LOCKSTEP, "the decoder could not be rewritten with masks")
    why_not: list[str] = []
    slots = options.kv_slots if options.kv_slots is not None else kind != "cpu"
    if slots and model.slots is not False:
        asked = "asked for" if options.kv_slots else f"the default on {kind}"
        return Selection(Backend.SLOTS, f"KV slots, {asked}")
    if slots:
        why_not.append("the graphs over KV slots were refused")
    elif options.kv_slots is None:
        why_not.append(
            f"KV slots are not the default on {kind}: slower than the state in place "
            "(Gather and the greedy choice in the graph)"
        )
    inplace = options.inplace_attention if options.inplace_attention is not None else kind == "cpu"
    if inplace and model.inplace is not False:
        asked = "asked for" if options.inplace_attention else f"the default on {kind}"
        return Selection(Backend.INPLACE, "; ".join([f"state in place, {asked}", *why_not]))
    if inplace:
        why_not.append("the step with self-attention in place was refused")
    elif options.inplace_attention is False:
        why_not.append("state in place turned off")
    return Selection(Backend.COPIED, "; ".join(["state copied per step", *why_not]))
