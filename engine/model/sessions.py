"""How the model's ONNX Runtime sessions are opened: the options, the threads, and the one
reader of `NMT_INTRA_OP_THREADS`."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import onnxruntime as ort

from engine.errors import ModelLoadError

THREADS_ENV = "NMT_INTRA_OP_THREADS"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeOptions:
    """How to open a model: which files, which cache mode, how many threads.

    `prefer_split`: run the split pair rather than the merged decoder, whose `If` costs
    time on every step: the split files when present, else the merged file's two branches
    cut apart at load (checked against the merged graph first).
    `batchable`: also load the decoders rewritten to take a per-row self-attention mask and
    position ids (`engine.model.passes.masks`, checked against the originals), so that rows
    of different decoder lengths share a call (continuous batching); without them, or when
    the rewrite fails, rows are batched only when they start together (lockstep).
    `intra_op_threads`: threads of every session (None: `NMT_INTRA_OP_THREADS`, else ONNX
    Runtime's default). `head_threads`: threads of the batchable step's output projection,
    run as a session of its own when this is more than `intra_op_threads`; the scheduler
    sets both (`SchedulerOptions`).
    `int8_per_token`: run int8 files with their activations quantized per token
    (`engine.model.passes.per_token`), so that a token's values do not depend on what else
    shares its call (batch mates, padding, a forced prefix): batching is then exact in
    int8 too. One-token calls give the files' own values either way, so a one-row step of
    the batchable layout runs the files' quantization (their fused kernels are faster;
    lockstep layouts run every call per token). Off: the files as they are.
    """

    quantized: bool = False
    # The `*_fp16.onnx` files (`engine.conversion.fp16`): for a GPU.
    fp16: bool = False
    use_cache: bool = True
    prefer_split: bool = True
    intra_op_threads: int | None = None
    allow_spinning: bool = False
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    batchable: bool = True
    head_threads: int | None = None
    # Threads of the output projection while its lane runs alone (the scheduler's other
    # lanes idle): all the model's cores, as a session of its own when more than
    # `head_threads` (`MaskedDecoder.step`'s `alone`).
    alone_head_threads: int | None = None
    # The KV backend asked for (`engine.model.backend.select_backend`, the one place it is
    # chosen): `kv_slots`, a pool of KV slots; `inplace_attention`, the state in lane
    # buffers extended in place. None: the device's default (slots on a GPU, in place on
    # the CPU); False: not that one.
    kv_slots: bool | None = None
    inplace_attention: bool | None = None
    int8_per_token: bool = True
    device_id: int = 0
    # Where ONNX Runtime writes each session's profile (a file prefix; None: no profile).
    profile: str | None = None
    # Whether greedy steps over KV slots replay CUDA graphs (`engine.model.kv.slots.graphed`): None,
    # on a CUDA device. True on the CPU runs the same fixed-shape buckets uncaptured.
    cuda_graphs: bool | None = None
    # The encoder's and the rewritten decoder's shape computations folded into constants
    # (`engine.model.passes.shapes`, checked at load): fewer nodes per call. Not the fp16
    # files (`folds`).
    fold_shapes: bool = True
    # The encoder's and the prefill's attention cores as one ONNX `Attention` each
    # (`engine.model.passes.attention`, each graph checked at load and kept unfused where
    # it differs): fewer nodes per call. On the CPU only (`fuses`).
    fuse_attention: bool = True
    # The projections that read one tensor (a layer's query, key and value; the prefill's
    # cross-attention keys and values) as one `MatMul`, `Add` and `Split`
    # (`engine.model.passes.pack`) in the graphs `fuse_attention` rewrites and the in-place
    # step: fewer nodes per call. On the CPU only (`packs`).
    pack_projections: bool = True
    # ONNX Runtime's `SkipLayerNormalization` fusion (a residual `Add` and the
    # `LayerNormalization` after it as one kernel): off on the CPU, where that kernel ran
    # slower than the two ops it replaces (`fusions_off`; docs/performance.md).
    skip_layer_norm: bool = False
    # One CPU arena for all the process's sessions rather than one each
    # (`shared_cpu_arena`): memory under load grows about a third as much.
    shared_arena: bool = True

    def __post_init__(self) -> None:
        if self.quantized and self.fp16:
            raise ValueError("load the int8 files or the fp16 ones, not both")

    @property
    def folds(self) -> bool:
        """Whether a load folds shape computations (`fold_shapes`): not in the fp16 files,
        where ONNX Runtime then fuses kernels that round differently in fp16 (0.008 of a
        logit on the fixture, past the masks rewrite's check: lockstep batching)."""
        return self.fold_shapes and not self.fp16

    @property
    def fuses(self) -> bool:
        """Whether a load fuses attention cores (`fuse_attention`): on the CPU, where it
        was measured (not on a GPU, nor in the fp16 files the folds leave as they are)."""
        return self.fuse_attention and not self.fp16 and device_of(self)[0] == "cpu"

    @property
    def packs(self) -> bool:
        """Whether a load packs projections of one input (`pack_projections`): on the CPU,
        where it was measured, and not in the fp16 files."""
        return self.pack_projections and not self.fp16 and device_of(self)[0] == "cpu"

    @property
    def per_token(self) -> bool:
        """Whether int8 activations are quantized per token (see `int8_per_token`)."""
        return self.quantized and self.int8_per_token


class DeviceUnavailable(ModelLoadError):
    """The device asked for cannot run the model here (the message says what is missing)."""


CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


def parse_device(device: str) -> tuple[str, int]:
    """("cpu", 0) or ("cuda", N) for "cpu", "cuda" or "cuda:N"; `ValueError` for any
    other name."""
    kind, _, index = device.partition(":")
    if kind == "cpu" and not index:
        return ("cpu", 0)
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"unknown device {device!r}: use cpu, cuda or cuda:N")
    return ("cuda", int(index or 0))


def device_of(options: RuntimeOptions) -> tuple[str, int]:
    """Where the model's buffers live: ("cuda", N) with the CUDA provider first, else the
    host."""
    if options.providers and options.providers[0] == CUDA:
        return ("cuda", options.device_id)
    return ("cpu", 0)


def device_options(device: str) -> dict[str, Any]:
    """`RuntimeOptions` fields for `device`: "cpu", or "cuda" / "cuda:N" (the CUDA
    provider on GPU N, the CPU provider for what it does not run). Raises
    `DeviceUnavailable` when this onnxruntime has no CUDA provider (the `[gpu]` extra,
    onnxruntime-gpu, is not installed) or `ValueError` for a device it does not know."""
    kind, index = parse_device(device)
    if kind == "cpu":
        return {"providers": (CPU,), "device_id": 0}
    preload = getattr(ort, "preload_dlls", None)
    if preload is not None:  # CUDA and cuDNN from an installed PyTorch or nvidia wheels
        with contextlib.suppress(Exception):  # the provider check below says what is missing
            preload()
    if CUDA not in ort.get_available_providers():
        raise DeviceUnavailable(
            f"--device {device}: this onnxruntime ({ort.__version__}) has no CUDA provider; "
            "install the [gpu] extra (onnxruntime-gpu) in place of onnxruntime"
        )
    return {"providers": (CUDA, CPU), "device_id": index}


def threads_from_env() -> int | None:
    """The intra-op threads `NMT_INTRA_OP_THREADS` asks for, or None when it is unset or
    empty: what a session gets when `RuntimeOptions.intra_op_threads` is None."""
    value = os.environ.get(THREADS_ENV)
    return int(value) if value else None


_shared_arena_lock = threading.Lock()
_shared_arena: list[bool] = []  # [whether registered], once per process


def shared_cpu_arena() -> bool:
    """Register one CPU memory arena for every session of the process (ONNX Runtime's
    environment allocator), once; False where ONNX Runtime refuses it.

    Why: each session's own arena keeps the largest blocks it ever served, for its life,
    so the model's eight or so sessions (encoder, bodies, projections) each held their
    own peak; shared, they hold the peak of what runs at once: RSS under load grows about
    a third as much; arenas turned off instead, glibc kept more (docs/performance.md,
    memory under load)."""
    with _shared_arena_lock:
        if not _shared_arena:
            try:
                info = ort.OrtMemoryInfo(
                    "Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT
                )
                # max memory 0 (no limit), power-of-two growth, default chunk sizes
                ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, 0, -1, -1))
                _shared_arena.append(True)
            except Exception as exc:  # registered by the embedding program, or refused
                log.info("one CPU arena for all sessions not registered: %s", exc)
                _shared_arena.append(False)
        return _shared_arena[0]


def session_options(options: RuntimeOptions, threads: int | None = None) -> ort.SessionOptions:
    """ONNX Runtime options of one session: `threads` intra-op threads where given, else
    those of `options` (or the environment's, see `threads_from_env`)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if threads is None:
        threads = options.intra_op_threads
    if threads is None:
        threads = threads_from_env()
    if threads:
        so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    if options.shared_arena and shared_cpu_arena():
        so.add_session_config_entry("session.use_env_allocators", "1")
    if options.profile:
        so.enable_profiling = True
        so.profile_file_prefix = options.profile
    if not options.allow_spinning:
        # Busy-waiting worker threads only pay off on otherwise idle cores; on a shared box
        # or with several streams decoding at once they fight for the CPU.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


PER_TOKEN_FUSIONS_OFF = ("MatMulIntegerToFloatFusion",)
"""ONNX Runtime fusions a graph quantized per token (`engine.model.passes.per_token`) must
not get. This one makes `MatMulInteger -> Cast -> Mul` one `MatMulIntegerToFloat`, which
with a per-token scale multiplies by the two scales one after the other where the files'
kernels multiply by their product: values one float step apart from the files' for a
one-token call, so a row stepped alone (on the files' graph) and in a batch would differ."""


SLOW_ON_CPU = ("SkipLayerNormFusion",)
"""ONNX Runtime fusions a CPU session does not get unless `RuntimeOptions.skip_layer_norm`:
its `SkipLayerNormalization` kernel cost more than `Add` and `LayerNormalization` at every
size measured but one token of 64 values (docs/performance.md, attention fused), and the
graphs whose shapes the passes make known get more of them."""


def fusions_off(options: RuntimeOptions, per_token: bool = False) -> list[str]:
    """The ONNX Runtime optimizers a session of `options` runs without: those a graph
    quantized per token must not get (`per_token`), and on the CPU those slower there."""
    off = list(PER_TOKEN_FUSIONS_OFF) if per_token else []
    if not options.skip_layer_norm and device_of(options)[0] == "cpu":
        off += SLOW_ON_CPU
    return off


def providers(options: RuntimeOptions, graph_capture: bool = False) -> list[Any]:
    """The providers a session is opened with, the CUDA one on `device_id` (and
    capturing CUDA graphs where `graph_capture`)."""
    cuda: dict[str, Any] = {"device_id": options.device_id}
    if graph_capture:
        cuda["enable_cuda_graph"] = "1"
    return [(name, cuda) if name == CUDA else name for name in options.providers]


def open_session(
    graph: str | bytes,
    options: RuntimeOptions,
    threads: int | None = None,
    *,
    per_token: bool = False,
    graph_capture: bool = False,
) -> ort.InferenceSession:
    """A session of a file (its path as a string) or a serialised graph, without the
    fusions `fusions_off` names; `per_token`: a graph whose int8 activations are
    quantized per token (see `PER_TOKEN_FUSIONS_OFF`);
    `graph_capture`: runs may capture and replay CUDA graphs (`engine.model.kv.slots.graphed`)."""
    session = ort.InferenceSession(
        graph,
        session_options(options, threads),
        providers=providers(options, graph_capture),
        **({"disabled_optimizers": off} if (off := fusions_off(options, per_token)) else {}),
    )
    if isinstance(graph, bytes):
        # ONNX Runtime's Python session keeps a serialised graph for as long as it lives,
        # to open itself again on another provider if one fails at run time (its own
        # comment calls that holding the memory indefinitely): the rewritten decoder's
        # graphs are as large as the model. Here a failing provider raises instead.
        session.disable_fallback()
        session._model_bytes = None
    return session
