"""Merged split: Optimum's merged decoder cut into its two branch graphs at load.

The merged decoder (`names.DECODER_MERGED`) is one `If` on `use_cache_branch` whose
branches are the no-past decoder (else) and the with-past decoder (then), sharing the
weights as top-level initializers. Running it pays for the `If` on every step, and
`models pull` fetches only this file. Each branch becomes a standalone model: its nodes,
the top-level initializers and graph inputs it reads, and its outputs renamed to the
`If`'s. The loader checks the two against the merged graph before use and keeps the merged
file if anything differs; a graph of another shape gives None and the merged file runs as
it is.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import onnx
from onnx import helper

log = logging.getLogger(__name__)


def split_merged(path: Path) -> tuple[bytes, bytes] | None:
    """(no-past model, with-past model) serialised, or None when it cannot be split."""
    model = onnx.load(str(path))
    graph = model.graph
    if len(graph.node) != 1 or graph.node[0].op_type != "If":
        return None  # only the plain merger output is understood
    if_node = graph.node[0]
    branches = {attr.name: attr.g for attr in if_node.attribute if attr.type == attr.GRAPH}
    if set(branches) != {"then_branch", "else_branch"}:
        return None
    initializers = {init.name: init for init in graph.initializer}
    inputs = {value.name: value for value in graph.input}
    out: list[bytes] = []
    for name in ("else_branch", "then_branch"):  # no past, with past
        branch = branches[name]
        produced = {o for node in branch.node for o in node.output}
        produced |= {init.name for init in branch.initializer}
        read = [i for node in branch.node for i in node.input if i and i not in produced]
        read += [o.name for o in branch.output if o.name not in produced]
        outer = list(dict.fromkeys(read))
        unknown = [n for n in outer if n not in initializers and n not in inputs]
        if unknown:
            log.debug("%s: %s reads %s from outside; not split", path.name, name, unknown[:3])
            return None
        nodes: list[Any] = list(branch.node)
        outputs = []
        for branch_out, if_out in zip(branch.output, if_node.output, strict=True):
            if branch_out.name != if_out:
                nodes.append(helper.make_node("Identity", [branch_out.name], [if_out]))
            renamed = onnx.ValueInfoProto()
            renamed.CopyFrom(branch_out)
            renamed.name = if_out
            outputs.append(renamed)
        shared = [initializers[n] for n in outer if n in initializers]
        sub = helper.make_graph(
            nodes,
            f"{graph.name}_{name}",
            [inputs[n] for n in outer if n in inputs],
            outputs,
            initializer=[*branch.initializer, *shared],
            value_info=list(branch.value_info),
        )
        standalone = helper.make_model(
            sub, opset_imports=list(model.opset_import), ir_version=model.ir_version
        )
        standalone.functions.extend(model.functions)
        out.append(standalone.SerializeToString())
    return out[0], out[1]
