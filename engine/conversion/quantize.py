"""Dynamic int8 quantization of an Optimum Marian export, done so that it actually pays off.

Two traps make the obvious `quantize_dynamic` of the merged decoder file useless:

* By default ONNX Runtime's quantizer does not descend into the merged decoder's `If`
  branches, so the merged file comes out unquantized. It does with
  `extra_options={"EnableSubgraph": True}` (how Xenova's hub int8 files were made),
  but we quantize the decoder and decoder-with-past apart and merge them again with
  Optimum's merger instead: the same inputs and outputs as the fp32 file, each branch
  quantized as the split files are, so split and merged int8 give the same results.
* The output projection is tied to the embedding: it is a MatMul fed by a Transpose of the
  embedding initializer, which the quantizer skips (its B is not a constant). Giving it its
  own pre-transposed initializer first lets it become int8; the vocabulary projection is
  the largest MatMul of a translation model's decoder step.

Only onnx and onnxruntime are needed (plus optimum's decoder merger, imported lazily).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.model.names import (
    DECODER,
    DECODER_MERGED,
    DECODER_WITH_PAST,
    ENCODER,
    onnx_file,
)

SPLIT_MODELS = (ENCODER, DECODER, DECODER_WITH_PAST)
MERGED_MODEL = DECODER_MERGED
QUANTIZED_OPS = ("MatMulInteger", "DynamicQuantizeLinear")


def untie_lm_head(model: Any) -> int:
    """Give every `MatMul(x, Transpose(initializer))` its own transposed initializer.

    In Marian exports this is the tied lm_head. Returns how many MatMuls were untied;
    Transposes and initializers left unused are removed.
    """
    import numpy as np
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    taken = set(inits) | {out for node in graph.node for out in node.output}
    taken |= {value.name for value in graph.input}
    made: dict[str, str] = {}
    untied = 0
    for node in graph.node:
        if node.op_type != "MatMul" or len(node.input) < 2:
            continue
        transpose = producers.get(node.input[1])
        if transpose is None or transpose.op_type != "Transpose":
            continue
        source = transpose.input[0]
        if source not in inits:
            continue
        if transpose.output[0] not in made:
            weight = numpy_helper.to_array(inits[source])
            perm = next(
                (
                    list(helper.get_attribute_value(a))
                    for a in transpose.attribute
                    if a.name == "perm"
                ),
                list(reversed(range(weight.ndim))),
            )
            name = _unique_name(f"{source}_untied", taken)
            untied_init = numpy_helper.from_array(
                np.ascontiguousarray(np.transpose(weight, perm)), name
            )
            graph.initializer.append(untied_init)
            taken.add(name)
            made[transpose.output[0]] = name
        node.input[1] = made[transpose.output[0]]
        untied += 1
    if untied:
        _remove_unused(graph)
    return untied


def _unique_name(base: str, taken: set[str]) -> str:
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    return name


def _remove_unused(graph: Any) -> None:
    """Drop nodes whose outputs nobody reads, then initializers nobody reads."""
    while True:
        used = {name for node in graph.node for name in node.input}
        used |= {out.name for out in graph.output}
        dead = [n for n in graph.node if n.output and not any(o in used for o in n.output)]
        if not dead:
            break
        for node in dead:
            graph.node.remove(node)
    used = {name for node in graph.node for name in node.input}
    for init in [i for i in graph.initializer if i.name not in used]:
        graph.initializer.remove(init)


def _subgraphs(graph: Any, path: str = "main") -> Iterator[tuple[str, Any]]:
    """The graph and, recursively, each If/Loop body, named like `main/If.then_branch`."""
    import onnx

    yield path, graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _subgraphs(attr.g, f"{path}/{node.op_type}.{attr.name}")


def quantized_op_counts(model: Any) -> dict[str, dict[str, int]]:
    """Per (sub)graph, how many MatMul, MatMulInteger and DynamicQuantizeLinear nodes."""
    counts: dict[str, dict[str, int]] = {}
    for path, graph in _subgraphs(model.graph):
        ops = [node.op_type for node in graph.node]
        counts[path] = {op: ops.count(op) for op in ("MatMul", *QUANTIZED_OPS)}
    return counts


# Nodes that may sit between a merged decoder's `If` and its `logits` output (some tools add
# them when renaming outputs); they pass one tensor through.
_PASS_THROUGH = ("Identity", "Cast")


def lm_head_outputs(model: Any) -> dict[str, tuple[Any, str]]:
    """Where the lm_head lives: (graph, name of its logits output) by graph path.

    A split decoder computes `logits` in its main graph. A merged decoder's main graph only
    routes an `If` output to `logits` (perhaps through Identity/Cast): the lm_head is in
    both branches, at the branch output in the same position. The main graph of a merged
    decoder is never returned, so it cannot count as an unquantized lm_head.
    """
    import onnx

    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    name = "logits"
    node = producers.get(name)
    while node is not None and node.op_type in _PASS_THROUGH and node.input:
        name = node.input[0]
        node = producers.get(name)
    if node is None or node.op_type != "If":
        return {"main": (graph, "logits")}
    index = list(node.output).index(name)
    return {
        f"main/If.{attr.name}": (attr.g, attr.g.output[index].name)
        for attr in node.attribute
        if attr.type == onnx.AttributeProto.GRAPH
    }


def is_lm_head_quantized(model: Any) -> dict[str, bool]:
    """For each graph holding the lm_head (see `lm_head_outputs`): is it int8?

    Walks back from the logits output to the first matrix product: MatMulInteger means
    quantized, a float MatMul (typically fed by the tied Transpose) means not.
    """
    result: dict[str, bool] = {}
    for path, (graph, logits) in lm_head_outputs(model).items():
        producers = {out: node for node in graph.node for out in node.output}
        frontier, seen, found = [logits], set(), False
        while frontier and not found:
            name = frontier.pop(0)
            node = producers.get(name)
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if node.op_type in ("MatMul", "MatMulInteger", "Gemm"):
                result[path] = node.op_type == "MatMulInteger"
                found = True
            else:
                frontier.extend(node.input)
        if not found:
            result[path] = False
    return result


def quantize_int8(onnx_dir: str | Path) -> None:
    """Write the int8 files (`QUANTIZED_SUFFIX`) next to an Optimum Marian export: encoder,
    decoder, decoder-with-past and the last two merged again.

    Raises if a decoder kept an fp32 lm_head (checked where it lives: the split decoders'
    graphs and both branches of the merged one) or a merged branch has no int8 MatMuls.
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from optimum.onnx import merge_decoders

    directory = Path(onnx_dir)
    missing = [onnx_file(n) for n in SPLIT_MODELS if not (directory / onnx_file(n)).is_file()]
    if missing:
        raise FileNotFoundError(f"{directory} lacks {', '.join(missing)}")
    from engine.conversion.export import known_export_noise

    with tempfile.TemporaryDirectory() as tmp, known_export_noise():
        for name in SPLIT_MODELS:
            model = onnx.load(str(directory / onnx_file(name)))
            if name != ENCODER:
                untie_lm_head(model)
            untied = Path(tmp, onnx_file(name))
            onnx.save(model, str(untied))
            quantize_dynamic(
                untied,
                directory / onnx_file(name, quantized=True),
                op_types_to_quantize=["MatMul", "Gather"],
                weight_type=QuantType.QInt8,
                per_channel=False,
                extra_options={"MatMulConstBOnly": True},
            )
    for name in SPLIT_MODELS[1:]:
        path = directory / onnx_file(name, quantized=True)
        check_quantized_split(onnx.load(str(path)), path.name)
    merged_path = directory / onnx_file(MERGED_MODEL, quantized=True)
    merge_decoders(
        decoder=directory / onnx_file(DECODER, quantized=True),
        decoder_with_past=directory / onnx_file(DECODER_WITH_PAST, quantized=True),
        save_path=merged_path,
        strict=False,
    )
    check_quantized_merged(onnx.load(str(merged_path)))


def check_quantized_merged(model: Any) -> None:
    """Raise unless both If branches hold int8 MatMuls and an int8 lm_head."""
    branches = {path: ops for path, ops in quantized_op_counts(model).items() if path != "main"}
    if len(branches) != 2:
        raise RuntimeError(f"expected a merged decoder with two If branches, got {list(branches)}")
    for path, ops in branches.items():
        if not all(ops[op] > 0 for op in QUANTIZED_OPS):
            raise RuntimeError(f"{path} is not quantized: {ops}")
    heads = is_lm_head_quantized(model)
    if set(heads) != set(branches) or not all(heads.values()):
        raise RuntimeError(f"lm_head not quantized in every branch: {heads}")


def check_quantized_split(model: Any, name: str) -> None:
    """Raise unless a split decoder file (no If) has an int8 lm_head."""
    heads = is_lm_head_quantized(model)
    if heads != {"main": True}:
        raise RuntimeError(f"{name}: lm_head not quantized: {heads}")
