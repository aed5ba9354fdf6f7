"""Head split: a decoder graph cut in two at its vocabulary projection, so that the
projection (the one large op of a step) can run on more threads than the rest."""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import helper

from engine.model.names import LOGITS
from engine.model.passes.graph import SHAPE_ONLY, GraphView
from engine.model.passes.per_token import activation_source


@dataclass(frozen=True)
class HeadSplit:
    """A decoder graph cut in two at the input of its vocabulary projection.

    `body` computes everything but the logits and outputs `hidden` (the last layer norm's
    output) besides the graph's other outputs; `head` maps `hidden` to `logits`. Run one
    after the other they are the original graph, op for op.
    """

    body: bytes
    head: bytes
    hidden: str


def split_output_projection(data: bytes, vocab: int, logits: str = LOGITS) -> HeadSplit | None:
    """`data` (a decoder graph) cut at the input of the matmul that projects to `vocab`
    logits, or None when the graph has no such single projection feeding `logits` alone.

    Why: at one row per call a decoder step is hundreds of small ops and one large one, the
    vocabulary projection. Worker threads pay off only on the large one: waking a second
    thread for each small op costs more than it saves (`MaskedDecoder` runs the body on
    one thread and the head on all cores). Initializers go with the part that reads them,
    so no weight is held twice (but a tied embedding, which both read).
    """
    model = onnx.load_from_string(data)
    graph = model.graph
    if any(attr.type in (attr.GRAPH, attr.GRAPHS) for n in graph.node for attr in n.attribute):
        return None  # an `If` (merged decoder): its branches read names this cut cannot see
    view = GraphView(graph, {})
    hidden = projection_input(view, vocab, logits)
    if hidden is None:
        return None
    return _split(model, view, hidden, logits)


def projection_input(view: GraphView, vocab: int, logits: str = LOGITS) -> str | None:
    """The hidden states [B, T, d] the graph's one vocabulary projection reads (for an
    int8 projection, the float activations before their quantization), or None when the
    graph has no such single projection feeding `logits`."""
    graph = view.graph

    def projects(weight: str) -> bool:
        """[hidden, vocab], or a Transpose of a [vocab, hidden] one (tied embeddings)."""
        dims = view.dims(weight)
        if dims is not None:
            return len(dims) == 2 and dims[1] == vocab
        node = view.producer.get(weight)
        if node is None or node.op_type != "Transpose" or not view.is_constant(node.input[0]):
            return False
        dims = view.dims(node.input[0])
        return dims is not None and len(dims) == 2 and dims[0] == vocab

    projections = [
        node
        for node in graph.node
        if node.op_type in ("MatMul", "MatMulInteger")
        and len(node.input) > 1
        and projects(node.input[1])
    ]
    if len(projections) != 1 or logits not in view.outputs:
        return None
    projection = projections[0]
    hidden = projection.input[0]
    if projection.op_type == "MatMulInteger":
        source = activation_source(view.producer, hidden)
        if source is None:
            return None  # int8 activations from something this cut does not know
        hidden = source
    return str(hidden)


def _hidden_type(view: GraphView, head_nodes: list[onnx.NodeProto], hidden: str) -> int:
    """The element type of `hidden`: that of the float projection's weights that read it
    (fp16 in a model converted to fp16), else float32 (an int8 projection's activations
    before their quantization)."""
    for node in head_nodes:
        if node.op_type != "MatMul" or node.input[0] != hidden:
            continue
        weight = node.input[1]
        producer = view.producer.get(weight)
        if producer is not None and producer.op_type == "Transpose":
            weight = producer.input[0]  # tied embeddings
        if weight in view.initializers:
            return int(view.initializers[weight].data_type)
    return int(onnx.TensorProto.FLOAT)


def _split(model: onnx.ModelProto, view: GraphView, hidden: str, logits: str) -> HeadSplit | None:
    graph = model.graph
    # The head: every node between `hidden` and `logits`.
    nodes, leaves = view.ancestry(logits, leaves_at=frozenset({hidden}))
    if leaves - {hidden} - view.initializers.keys():
        return None  # the logits read a graph input besides `hidden`
    if any(node.op_type in SHAPE_ONLY and set(node.input) != {hidden} for node in nodes):
        return None  # a shape read from the body, which the walk does not follow
    head_ids = {id(node) for node in nodes}
    head_nodes = [n for n in graph.node if id(n) in head_ids]
    if not any(n.op_type in ("MatMul", "MatMulInteger") for n in head_nodes):
        return None
    for node in head_nodes:
        for out in node.output:
            users = view.consumers.get(out, [])
            if any(id(u) not in head_ids for u in users) and node.op_type != "Constant":
                return None  # the body reads a head value: not a clean cut
            if out != logits and out in view.outputs:
                return None

    def used(nodes: list[onnx.NodeProto]) -> set[str]:
        return {name for node in nodes for name in node.input}

    body_nodes = [n for n in graph.node if id(n) not in head_ids]
    body_reads = used(body_nodes)
    shared = {id(n) for n in head_nodes if n.op_type == "Constant" and body_reads & set(n.output)}
    body_nodes = [n for n in graph.node if id(n) not in head_ids or id(n) in shared]
    body_reads, head_reads = used(body_nodes), used(head_nodes)  # once: graphs are large

    hidden_type = _hidden_type(view, head_nodes, hidden)
    hidden_info = helper.make_tensor_value_info(hidden, hidden_type, None)
    logits_info = next(o for o in graph.output if o.name == logits)
    body_graph = helper.make_graph(
        body_nodes,
        f"{graph.name}_body",
        list(graph.input),
        [hidden_info, *(o for o in graph.output if o.name != logits)],
        [i for i in graph.initializer if i.name in body_reads],
    )
    body_inputs = body_reads | {hidden}
    del body_graph.input[:]
    body_graph.input.extend(i for i in graph.input if i.name in body_inputs)
    head_graph = helper.make_graph(
        head_nodes,
        f"{graph.name}_head",
        [hidden_info],
        [logits_info],
        [i for i in graph.initializer if i.name in head_reads],
    )
    # The shapes the graph knows go with each part: ORT's fusions need them (without them
    # the body's Add + LayerNormalization stayed unfused where the whole step had
    # SkipLayerNormalization, which rounds differently: not the same values bit for bit).
    for part, part_nodes, reads in (
        (body_graph, body_nodes, body_reads),
        (head_graph, head_nodes, head_reads),
    ):
        names = reads | {out for node in part_nodes for out in node.output}
        part.value_info.extend(v for v in graph.value_info if v.name in names)
    parts = []
    for part in (body_graph, head_graph):
        out = helper.make_model(part, opset_imports=list(model.opset_import))
        out.ir_version = model.ir_version
        parts.append(out.SerializeToString())
    return HeadSplit(parts[0], parts[1], hidden)
