"""Scan-8's batch axis, kept when ``onnx.version_converter`` takes a graph to opset 9 or later.

Scan-8 runs its body once per sample of a leading batch axis that all its states and scan inputs carry;
Scan-9 has none. onnx's Scan 8->9 adapter only deletes the leading axis from the declared shapes of the
node's inputs and outputs: it inserts nothing that removes the axis, and where the Scan reads and writes
the graph's own inputs and outputs it changes the graph's interface (a caller's float32[1, 2] becomes
float32[2]). With a batch of one the conversion is exact once the axis is squeezed before the Scan and
unsqueezed after it, and the declared types are those of the source graph again; a larger batch (several
runs of the body) is refused.
"""

from __future__ import annotations

import onnx
from onnx import helper

from ..errors import PATTERN_NO_LOWERING, LegalizationError, UnsupportedNode
from ..graphs import GraphView, NameAllocator, iter_graphs, iter_nodes

#: The first Scan without a batch axis.
SCAN_WITHOUT_BATCH = 9


def restore_scan8_batch(original: onnx.ModelProto, converted: onnx.ModelProto, source_opset: int) -> None:
    """Make the Scans of ``converted`` (``original`` after the converter, in place) take and give the batch
    axis the Scan-8 nodes of ``original`` (ai.onnx ``source_opset``) had."""
    if source_opset >= SCAN_WITHOUT_BATCH:
        return
    scans = {node.output[0]: node for node in iter_nodes(original.graph) if node.op_type == "Scan"}
    if not scans:
        return
    view = GraphView.of_model(original, subgraphs=True)
    names = NameAllocator.for_model(converted)
    restored: set[str] = set()
    for graph in iter_graphs(converted.graph):
        nodes: list[onnx.NodeProto] = []
        for node in graph.node:
            source = scans.get(node.output[0]) if node.op_type == "Scan" else None
            if source is None:
                nodes.append(node)
                continue
            _require_one_sample(source, view)
            nodes.extend(_batch_axis_removed(node, names))
            restored.update(source.input, source.output)
        del graph.node[:]
        graph.node.extend(nodes)
    _restore_declared_types(original, converted, restored)


def _require_one_sample(scan: onnx.NodeProto, view: GraphView) -> None:
    """Refuse a Scan-8 whose batch (the leading axis of its inputs after ``sequence_lens``) is not one."""
    leading = {dims[0] if dims else None for dims in (view.shape(name) for name in scan.input[1:])}
    if leading != {1}:
        batch = ", ".join(sorted(str(size or "unknown") for size in leading))
        raise LegalizationError(
            "Scan-8 runs its body per sample of a batch axis that opset 11's Scan does not have.",
            [
                UnsupportedNode(
                    scan.name or scan.output[0],
                    scan.op_type,
                    scan.domain,
                    f"its batch axis has size {batch}; only a batch of 1 converts to opset 11",
                    PATTERN_NO_LOWERING,
                )
            ],
            ("export the model at opset 9 or later, or fix the batch to 1",),
        )


def _batch_axis_removed(scan: onnx.NodeProto, names: NameAllocator) -> list[onnx.NodeProto]:
    """``scan`` reading its inputs with axis 0 squeezed and giving its outputs with it unsqueezed."""
    hint = scan.name or "Scan"
    before, after = [], []
    for position, name in enumerate(scan.input):
        unbatched = names.fresh(f"{name}_unbatched")
        before.append(helper.make_node("Squeeze", [name], [unbatched], name=names.fresh(hint), axes=[0]))
        scan.input[position] = unbatched
    for position, name in enumerate(scan.output):
        unbatched = names.fresh(f"{name}_unbatched")
        after.append(helper.make_node("Unsqueeze", [unbatched], [name], name=names.fresh(hint), axes=[0]))
        scan.output[position] = unbatched
    return [*before, scan, *after]


def _restore_declared_types(original: onnx.ModelProto, converted: onnx.ModelProto, names: set[str]) -> None:
    """The source's declared types for the graphs' inputs and outputs in ``names``; the converter's
    value_info for them (without the batch axis) is dropped, inference finds it again."""
    declared = {
        value.name: value.type
        for graph in iter_graphs(original.graph)
        for value in (*graph.input, *graph.output)
    }
    for graph in iter_graphs(converted.graph):
        for value in (*graph.input, *graph.output):
            if value.name in names and value.name in declared:
                value.type.CopyFrom(declared[value.name])
        kept = [value for value in graph.value_info if value.name not in names]
        del graph.value_info[:]
        graph.value_info.extend(kept)
