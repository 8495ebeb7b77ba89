"""Int64ToInt32: no int64 tensor is left on the device; the host casts at the graph boundary.

Poplar has no INT64 type. Every int64 graph input/output, initializer, Constant, ConstantOfShape value
and ``Cast(to=INT64)`` becomes int32, in subgraphs too. Ops whose output ONNX defines as int64
(Shape, ArgMax, TopK indices, ...) get a Cast to int32 right after them, so the value is narrowed where
it is produced and every reader, wherever it sits, reads the int32 tensor. For ArgMax, ArgMin and
TopK's indices, PopART computes the output as INT32 anyway (``op_table.POPART_INT32_OUTPUTS``),
and that Cast is free.

One exception keeps the graph valid ONNX: operands that ONNX types as int64 only (Reshape/Expand
shape, Tile repeats, Pad pads, RoiAlign batch indices, ..., see ``op_table.INT64_ONLY_OPERANDS``).
A constant feeding only such operands stays int64 (PopART converts int64 constants when it loads
them). A constant feeding such an operand and other readers too (onnxslim merges equal constants, so a
``[-1]`` can be both a Reshape shape and an index) is converted for the others, and the int64 operand
gets an int64 copy of its own. Only a value computed at run time reaching such an operand gets a Cast
back to int64, which verify reports because the device would have to compute it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ..errors import PATTERN_INT32_RANGE, LegalizationError, UnsupportedNode
from ..graphs import GraphView, NameAllocator, iter_graphs
from ..op_table import INT64_ONLY_OPERANDS
from .base import GraphPass, PassContext
from .fix_shapes import refresh_shapes

INT32_MIN = int(np.iinfo(np.int32).min)
INT32_MAX = int(np.iinfo(np.int32).max)
_INT64_MAX = int(np.iinfo(np.int64).max)
_INT64_MIN = int(np.iinfo(np.int64).min)
# "Until the end" markers torch writes into Slice starts/ends; int32's extremes mean the same there.
_SENTINELS = {_INT64_MAX: INT32_MAX, _INT64_MIN: INT32_MIN, _INT64_MIN + 1: INT32_MIN}

#: Outputs ONNX always types int64, whatever the inputs: (op_type, output index).
INTRINSIC_INT64_OUTPUTS: frozenset[tuple[str, int]] = frozenset(
    {("Shape", 0), ("Size", 0), ("ArgMax", 0), ("ArgMin", 0), ("TopK", 1), ("NonZero", 0), ("MaxPool", 1)}
)

_HINTS = (
    "integer constants must fit in int32 (PopART has no int64); re-export with smaller index values",
    "file an issue with the model id if this constant is a marker value that should be clipped",
)


def to_int32_values(values: np.ndarray, where: str, problems: list[UnsupportedNode]) -> np.ndarray:
    """int64 values as int32, mapping the int64 sentinels to int32's extremes; record what does not fit."""
    values = np.asarray(values, dtype=np.int64)
    result = values.copy()
    for sentinel, replacement in _SENTINELS.items():
        result[values == sentinel] = replacement
    too_big = (result > INT32_MAX) | (result < INT32_MIN)
    if np.any(too_big):
        bad = result[too_big].ravel()[:3].tolist()
        problems.append(
            UnsupportedNode(
                where, "int64 constant", "", f"values {bad} do not fit in int32", PATTERN_INT32_RANGE
            )
        )
        result = np.clip(result, INT32_MIN, INT32_MAX)
    return result.astype(np.int32)


def _int32_tensor(tensor: TensorProto, where: str, problems: list[UnsupportedNode]) -> TensorProto:
    converted = numpy_helper.from_array(to_int32_values(numpy_helper.to_array(tensor), where, problems))
    converted.name = tensor.name
    return converted


@dataclass
class _Conversion:
    """What one run of the pass collects while it walks the graphs."""

    view: GraphView
    names: NameAllocator
    kept_int64: set[str] = field(default_factory=set)
    #: int64 constants made int32 (initializers and Constant nodes, any scope): their int64 values.
    narrowed_constants: dict[str, np.ndarray] = field(default_factory=dict)
    problems: list[UnsupportedNode] = field(default_factory=list)
    counts: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))

    def keeps_int64(self, name: str) -> bool:
        """Whether ``name`` stays int64 (only int64-only operands read it); remembered if so."""
        if self.view.only_feeds(name, INT64_ONLY_OPERANDS):
            self.kept_int64.add(name)
            return True
        return False


class Int64ToInt32(GraphPass):
    """Turn every int64 tensor, constant and cast into int32 (compile-time shape operands excepted)."""

    name = "int64_to_int32"
    guarantee = (
        "no int64 tensor remains except constants read only by int64-only operands and int64 outputs "
        "narrowed by a Cast where they are produced"
    )

    def run(self, model: onnx.ModelProto, ctx: PassContext) -> onnx.ModelProto:
        self.notes = []
        conversion = _Conversion(GraphView(model.graph, subgraphs=True), NameAllocator.for_model(model))
        _ = conversion.view.consumers  # link producers and consumers before the graphs change
        for graph in iter_graphs(model.graph):
            self._convert_boundary(graph, conversion)
            self._convert_initializers(graph, conversion)
            self._convert_nodes(graph, conversion)
        if conversion.problems:
            raise LegalizationError(
                "Some int64 constants cannot be represented in int32.", conversion.problems, _HINTS
            )
        for graph in iter_graphs(model.graph):
            self._restore_int64_operands(graph, graph is model.graph, conversion)
        self.notes.extend(f"{what}: {count}" for what, count in sorted(conversion.counts.items()) if count)
        return refresh_shapes(model)

    @staticmethod
    def _convert_boundary(graph: onnx.GraphProto, conversion: _Conversion) -> None:
        for value_info in list(graph.input) + list(graph.output):
            tensor_type = value_info.type.tensor_type
            if tensor_type.elem_type == TensorProto.INT64:
                tensor_type.elem_type = TensorProto.INT32
                conversion.counts["int64 inputs/outputs made int32"] += 1

    @staticmethod
    def _convert_initializers(graph: onnx.GraphProto, conversion: _Conversion) -> None:
        for index, init in enumerate(graph.initializer):
            if init.data_type != TensorProto.INT64 or conversion.keeps_int64(init.name):
                continue
            conversion.narrowed_constants[init.name] = numpy_helper.to_array(init)
            graph.initializer[index].CopyFrom(_int32_tensor(init, init.name, conversion.problems))
            conversion.counts["int64 initializers made int32"] += 1

    def _convert_nodes(self, graph: onnx.GraphProto, conversion: _Conversion) -> None:
        new_nodes: list[onnx.NodeProto] = []
        for node in graph.node:
            new_nodes.append(node)
            if node.domain not in ("", "ai.onnx"):
                continue
            if node.op_type == "Constant":
                self._convert_constant(node, conversion)
            elif node.op_type == "ConstantOfShape":
                self._convert_constant_of_shape(node, conversion)
            elif node.op_type == "Cast":
                to = next(a for a in node.attribute if a.name == "to")
                if to.i == TensorProto.INT64 and not conversion.keeps_int64(node.output[0]):
                    to.i = TensorProto.INT32
                    conversion.counts["Cast(to=INT64) made int32"] += 1
            for index, name in enumerate(node.output):
                if not name or (node.op_type, index) not in INTRINSIC_INT64_OUTPUTS:
                    continue
                if conversion.keeps_int64(name):
                    continue
                int64_name = conversion.names.fresh(f"{name}__int64")
                node.output[index] = int64_name
                new_nodes.append(
                    onnx.helper.make_node(
                        "Cast",
                        [int64_name],
                        [name],
                        name=conversion.names.fresh(f"{node.name or name}__to_int32"),
                        to=TensorProto.INT32,
                    )
                )
                conversion.counts[f"Cast to int32 after {node.op_type}"] += 1
        del graph.node[:]
        graph.node.extend(new_nodes)

    @staticmethod
    def _convert_constant(node: onnx.NodeProto, conversion: _Conversion) -> None:
        attr = node.attribute[0] if len(node.attribute) == 1 else None
        if attr is None:
            return
        if attr.name == "value" and attr.t.data_type == TensorProto.INT64:
            values = numpy_helper.to_array(attr.t)
        elif attr.name == "value_int":
            values = np.array(attr.i, dtype=np.int64)
        elif attr.name == "value_ints":
            values = np.array(list(attr.ints), dtype=np.int64)
        else:
            return
        if conversion.keeps_int64(node.output[0]):
            if attr.name != "value":  # value_int(s) are opset-12 attributes: write them as a tensor
                tensor = numpy_helper.from_array(values.astype(np.int64))
                del node.attribute[:]
                node.attribute.append(onnx.helper.make_attribute("value", tensor))
            return
        where = node.name or node.output[0]
        conversion.narrowed_constants[node.output[0]] = values.astype(np.int64)
        tensor = numpy_helper.from_array(to_int32_values(values, where, conversion.problems))
        del node.attribute[:]
        node.attribute.append(onnx.helper.make_attribute("value", tensor))
        conversion.counts["int64 Constants made int32"] += 1

    @staticmethod
    def _convert_constant_of_shape(node: onnx.NodeProto, conversion: _Conversion) -> None:
        for attr in node.attribute:
            if attr.name == "value" and attr.t.data_type == TensorProto.INT64:
                if conversion.keeps_int64(node.output[0]):
                    return
                attr.t.CopyFrom(_int32_tensor(attr.t, node.name or node.output[0], conversion.problems))
                conversion.counts["int64 ConstantOfShape values made int32"] += 1

    @staticmethod
    def _restore_int64_operands(graph: onnx.GraphProto, is_main: bool, conversion: _Conversion) -> None:
        """Give each int64-only operand that now reads an int32 value an int64 one: a copy of a constant,
        or a Cast of a value computed at run time (which verify reports)."""
        new_nodes: list[onnx.NodeProto] = []
        for node in graph.node:
            for index, name in enumerate(node.input):
                slot = (node.op_type, index)
                if not name or slot not in INT64_ONLY_OPERANDS or name in conversion.kept_int64:
                    continue
                original = conversion.narrowed_constants.get(name)
                if original is not None:
                    copy = conversion.names.fresh(f"{name}__int64")
                    tensor = numpy_helper.from_array(original, copy)
                    if is_main:
                        graph.initializer.append(tensor)
                    else:  # subgraphs hold their constants as Constant nodes, as the lowering writes them
                        new_nodes.append(
                            onnx.helper.make_node("Constant", [], [copy], name=copy, value=tensor)
                        )
                    node.input[index] = copy
                    conversion.kept_int64.add(copy)
                    conversion.counts["int64 copies of shared constants for int64-only operands"] += 1
                    continue
                # Named after the reader, so an error about it leads back to the exported node.
                reader = node.name or node.op_type
                cast_output = conversion.names.fresh(f"{reader}/input_{index}_as_int64")
                cast_name = conversion.names.fresh(f"{reader}/cast_input_{index}")
                new_nodes.append(
                    onnx.helper.make_node("Cast", [name], [cast_output], name=cast_name, to=TensorProto.INT64)
                )
                node.input[index] = cast_output
                conversion.counts["computed operands cast back to int64"] += 1
            new_nodes.append(node)
        del graph.node[:]
        graph.node.extend(new_nodes)
