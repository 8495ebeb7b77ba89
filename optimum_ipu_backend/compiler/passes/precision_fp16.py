"""ToFloat16: float32 compute becomes float16, with what would overflow made safe.

* float32 initializers, Constant/ConstantOfShape values, ``Cast(to=FLOAT)`` and the float graph
  inputs/outputs become float16 (the session casts host arrays at the boundary, see
  ``LegalizedGraph.input_types``); operands ONNX types float32-only (Resize scales) stay float32;
* constants beyond float16's range (attention masks built from ``finfo(float32).min = -3.4e38``)
  become -/+1e4: far enough to zero a Softmax entry, near enough that adding two masks, or a fully
  masked row, does not reach -inf and NaN;
* non-zero constants below float16's smallest subnormal keep their sign at that subnormal, so a
  LayerNorm epsilon does not become 0 (and 0/0 on a constant row);
* the variance of every normalisation (``Pow(x, 2)`` or ``Mul(x, x)`` feeding a ReduceMean/ReduceSum,
  then ``Add(eps)`` and ``Sqrt``) runs in float32 between two Casts: squares of activations above
  256 overflow float16.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ..graphs import GraphView, NameAllocator, iter_graphs
from ..op_table import FLOAT32_ONLY_OPERANDS
from .base import GraphPass, PassContext
from .fix_shapes import refresh_shapes

FP16_MAX = float(np.finfo(np.float16).max)  # 65504
FP16_TINY = float(np.finfo(np.float16).smallest_subnormal)
#: What an out-of-range constant becomes: exp(-1e4) is 0 in float16, and -1e4 * 6 is still finite.
MASK_MAGNITUDE = 1e4

_REDUCTIONS = frozenset({"ReduceMean", "ReduceSum"})


def to_float16_values(values: np.ndarray) -> tuple[np.ndarray, int]:
    """float32 values as float16, out-of-range ones clamped; also how many were clamped."""
    values = np.asarray(values, dtype=np.float32)
    overflow = np.isfinite(values) & (np.abs(values) > FP16_MAX)
    result = np.where(overflow, np.sign(values) * MASK_MAGNITUDE, values)
    underflow = (result != 0) & (np.abs(result) < FP16_TINY)
    result = np.where(underflow, np.sign(result) * FP16_TINY, result)
    return result.astype(np.float16), int(np.count_nonzero(overflow))


@dataclass
class _Island:
    """Nodes that stay float32: a variance computation."""

    nodes: list[onnx.NodeProto]
    source: str
    result: str
    constants: list[tuple[onnx.NodeProto, int]] = field(default_factory=list)


def _scalar_constant(name: str, initializers: dict[str, TensorProto]) -> float | None:
    tensor = initializers.get(name)
    if tensor is None or tensor.data_type != TensorProto.FLOAT:
        return None
    values = numpy_helper.to_array(tensor)
    return float(values.reshape(-1)[0]) if values.size == 1 else None


def _find_variance_islands(graph: onnx.GraphProto) -> list[_Island]:
    initializers = {init.name: init for init in graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            readers[name].append(node)
    outputs = {output.name for output in graph.output}

    def sole_reader(name: str) -> onnx.NodeProto | None:
        nodes = readers.get(name, [])
        return nodes[0] if len(nodes) == 1 and name not in outputs else None

    islands = []
    for node in graph.node:
        is_square = (node.op_type == "Pow" and _scalar_constant(node.input[1], initializers) == 2.0) or (
            node.op_type == "Mul" and node.input[0] == node.input[1]
        )
        reduction = sole_reader(node.output[0]) if is_square else None
        if reduction is None or reduction.op_type not in _REDUCTIONS:
            continue
        island = _Island(nodes=[node, reduction], source=node.input[0], result=reduction.output[0])
        if node.op_type == "Pow":
            island.constants.append((node, 1))
        for index in range(1, len(reduction.input)):
            if reduction.input[index]:
                island.constants.append((reduction, index))
        while (follower := sole_reader(island.result)) is not None:
            if follower.op_type == "Sqrt":
                pass
            elif follower.op_type == "Add" and sum(n in initializers for n in follower.input) == 1:
                island.constants.extend(
                    (follower, i) for i, n in enumerate(follower.input) if n in initializers
                )
            else:
                break
            island.nodes.append(follower)
            island.result = follower.output[0]
        islands.append(island)
    return islands


def _isolate_islands(
    graph: onnx.GraphProto, islands: list[_Island], names: NameAllocator
) -> tuple[set[str], set[str]]:
    """Give each island float32 copies of its constants and Casts at its edges (named after the island's
    first and last nodes, so errors lead back to them).

    Returns the names of the float32 constant copies and of the Casts into float32.
    """
    initializers = {init.name: init for init in graph.initializer}
    copies: dict[str, str] = {}
    cast_before: dict[int, onnx.NodeProto] = {}
    cast_after: dict[int, onnx.NodeProto] = {}
    for island in islands:
        first, last = island.nodes[0], island.nodes[-1]
        for node, index in island.constants:
            original = node.input[index]
            if original not in initializers or initializers[original].data_type != TensorProto.FLOAT:
                continue
            if original not in copies:
                copy = TensorProto()
                copy.CopyFrom(initializers[original])
                copy.name = copies[original] = names.fresh(f"{original}__fp32")
                graph.initializer.append(copy)
            node.input[index] = copies[original]
        source_fp32 = names.fresh(f"{first.name or island.source}/input_fp32")
        cast_before[id(first)] = onnx.helper.make_node(
            "Cast",
            [island.source],
            [source_fp32],
            name=names.fresh(f"{first.name or island.source}/cast_to_fp32"),
            to=TensorProto.FLOAT,
        )
        for index, name in enumerate(first.input):
            if name == island.source:
                first.input[index] = source_fp32
        result_fp32 = names.fresh(f"{last.name or island.result}/output_fp32")
        last.output[0] = result_fp32
        cast_after[id(last)] = onnx.helper.make_node(
            "Cast",
            [result_fp32],
            [island.result],
            name=names.fresh(f"{last.name or island.result}/cast_to_fp16"),
            to=TensorProto.FLOAT16,
        )
    ordered: list[onnx.NodeProto] = []
    for node in graph.node:
        if id(node) in cast_before:
            ordered.append(cast_before[id(node)])
        ordered.append(node)
        if id(node) in cast_after:
            ordered.append(cast_after[id(node)])
    del graph.node[:]
    graph.node.extend(ordered)
    return set(copies.values()), {cast.name for cast in cast_before.values()}


class ToFloat16(GraphPass):
    """Run the graph in float16; keep overflow-prone constants and reductions safe."""

    name = "precision_fp16"
    guarantee = "float compute is float16 (variance reductions in float32); no constant overflows float16"

    def run(self, model: onnx.ModelProto, ctx: PassContext) -> onnx.ModelProto:
        self.notes = []
        counts: dict[str, int] = defaultdict(int)
        keep_fp32: set[str] = set()
        island_casts: set[str] = set()
        names = NameAllocator.for_model(model)
        for graph in iter_graphs(model.graph):
            islands = _find_variance_islands(graph)
            constants, casts = _isolate_islands(graph, islands, names)
            keep_fp32 |= constants
            island_casts |= casts
            counts["variance reductions kept in float32"] += len(islands)
        view = GraphView(model.graph, subgraphs=True)
        _ = view.consumers  # link producers and consumers before the graphs change
        for graph in iter_graphs(model.graph):
            self._convert_graph(graph, view, keep_fp32, island_casts, counts)
        self.notes.extend(f"{what}: {count}" for what, count in sorted(counts.items()) if count)
        return refresh_shapes(model)

    def _convert_tensor(self, tensor: TensorProto, counts: dict[str, int]) -> None:
        values, clamped = to_float16_values(numpy_helper.to_array(tensor))
        converted = numpy_helper.from_array(values, tensor.name)
        tensor.CopyFrom(converted)
        counts["out-of-range constants clamped to +/-1e4"] += clamped

    def _convert_graph(
        self,
        graph: onnx.GraphProto,
        view: GraphView,
        keep_fp32: set[str],
        island_casts: set[str],
        counts: dict[str, int],
    ) -> None:
        for value_info in list(graph.input) + list(graph.output):
            if value_info.type.tensor_type.elem_type == TensorProto.FLOAT:
                value_info.type.tensor_type.elem_type = TensorProto.FLOAT16
                counts["float inputs/outputs made float16"] += 1
        for init in graph.initializer:
            if init.data_type != TensorProto.FLOAT or init.name in keep_fp32:
                continue
            if view.only_feeds(init.name, FLOAT32_ONLY_OPERANDS):
                continue
            self._convert_tensor(init, counts)
            counts["float initializers made float16"] += 1
        for node in graph.node:
            if node.domain not in ("", "ai.onnx"):
                continue
            float32_only = any(view.only_feeds(name, FLOAT32_ONLY_OPERANDS) for name in node.output if name)
            if node.op_type == "Cast" and not float32_only and node.name not in island_casts:
                to = next(a for a in node.attribute if a.name == "to")
                if to.i == TensorProto.FLOAT:
                    to.i = TensorProto.FLOAT16
                    counts["Cast(to=FLOAT) made float16"] += 1
            elif node.op_type in ("Constant", "ConstantOfShape") and not float32_only:
                self._convert_value_attribute(node, counts)

    def _convert_value_attribute(self, node: onnx.NodeProto, counts: dict[str, int]) -> None:
        value = next((a for a in node.attribute if a.name == "value"), None)
        if value is None:
            if node.op_type == "ConstantOfShape":  # the default value is a float32 zero
                zero = numpy_helper.from_array(np.zeros(1, dtype=np.float16))
                node.attribute.append(onnx.helper.make_attribute("value", zero))
                counts["ConstantOfShape values made float16"] += 1
            return
        if value.type == onnx.AttributeProto.TENSOR and value.t.data_type == TensorProto.FLOAT:
            self._convert_tensor(value.t, counts)
            counts[f"{node.op_type} values made float16"] += 1
