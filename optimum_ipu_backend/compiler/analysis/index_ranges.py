"""Which graph inputs index a table on the device, and the values each may hold.

An IPU does not bounds-check the indices of a gather: a token id outside the vocabulary reads
whatever lies there and the call returns a wrong answer, where onnxruntime on a CPU raises. So the
session checks such inputs on the host, and this analysis says which inputs and against what, once
per graph (the result is part of the graph's cached description).

An input *indexes a table* when its values reach the index operand of one of ``INDEX_OPERANDS``
(Gather, GatherElements, GatherND, ScatterND, ScatterElements, OneHot) through operators whose effect
on the values is known exactly:

* operators that only move or copy values (Reshape, Unsqueeze, Squeeze, Flatten, Transpose, Expand,
  Tile, Slice, Split, Identity, and a gather that reads *from* the tracked tensor): every value that
  reaches the index is a value of the input;
* Add, Sub and Mul with a constant that has one value, and Neg: the index is ``scale * value + offset``
  (RoBERTa-style position offsets, ``ids + 2``);
* Cast to an integer type: the relation holds where the value fits the target type, so the allowed
  range is cut to it (a wrap-around is never allowed).

For each such path the allowed values are those that put the index in ``[0, size - 1]``, ``size``
being the table's static size along the indexed axis (the depth of a OneHot). Negative indices are
refused although onnxruntime counts them from the end: token ids, token types and positions are
never negative, and PopART's Gather is not documented to wrap them, so a negative value is refused
rather than risk a different answer on the device.

Where an input reaches an index operand through anything else (a comparison, CumSum, an addition of
two tensors, a Cast to a float type, a control-flow node's outputs) the relation between its values
and the index is not provable by this analysis, and the path is reported in ``unchecked``. Such
indices are computed by the graph itself from masks and shapes (RoBERTa's position ids are a CumSum
of ``input_ids != pad``): their range follows from the sequence length, which the compiled sizes and
the model's position limit already bound. They are not checked per call, and the session says so in
its log when it is created.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

_logger = logging.getLogger(__name__)

# op_type -> input slot holding indices into a table (the table is input 0, except for OneHot).
INDEX_OPERANDS: Mapping[str, int] = {
    "Gather": 1,
    "GatherElements": 1,
    "GatherND": 1,
    "ScatterND": 1,
    "ScatterElements": 1,
    "Scatter": 1,
    "OneHot": 0,
}

# op_type -> input slot whose values the outputs are copies of (every output value is one of them).
VALUE_PRESERVING: Mapping[str, int] = {
    "Identity": 0,
    "Reshape": 0,
    "Flatten": 0,
    "Squeeze": 0,
    "Unsqueeze": 0,
    "Transpose": 0,
    "Expand": 0,
    "Tile": 0,
    "Slice": 0,
    "Split": 0,
    "Dropout": 0,  # inference: the identity on output 0
    "Gather": 0,
    "GatherElements": 0,
    "GatherND": 0,
}

# Operators whose outputs depend on the shape of the tracked tensor, not on its values.
_SHAPE_ONLY = frozenset({"Shape", "Size", "ConstantOfShape", "EyeLike"})

_INTEGER_TYPES = {
    onnx.TensorProto.INT8: np.int8,
    onnx.TensorProto.UINT8: np.uint8,
    onnx.TensorProto.INT16: np.int16,
    onnx.TensorProto.UINT16: np.uint16,
    onnx.TensorProto.INT32: np.int32,
    onnx.TensorProto.UINT32: np.uint32,
    onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.UINT64: np.uint64,
}

# Constants larger than this are not read to look for a single value (an embedding table is no offset).
_MAX_CONSTANT_ELEMENTS = 4096


@dataclass(frozen=True)
class IndexBound:
    """Values ``input`` may hold so that the index it becomes stays inside one table."""

    input: str
    low: int  # inclusive
    high: int  # inclusive
    node: str  # the indexing node
    op_type: str
    table: str  # the tensor indexed (the depth operand for OneHot)
    size: int  # the table's size along the indexed axis
    path: str  # how the input reaches the index, e.g. "Reshape -> Add(+2)"; "" when directly


@dataclass(frozen=True)
class UncheckedIndex:
    """An input that reaches an index operand in a way the analysis does not model."""

    input: str
    node: str  # the indexing node
    op_type: str
    reason: str


@dataclass(frozen=True)
class IndexRanges:
    bounds: tuple[IndexBound, ...] = ()
    unchecked: tuple[UncheckedIndex, ...] = ()

    def to_json(self) -> dict[str, list[dict[str, Any]]]:
        """JSON-native form, for the graph's cached description."""
        return {
            "bounds": [asdict(bound) for bound in self.bounds],
            "unchecked": [asdict(entry) for entry in self.unchecked],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> IndexRanges:
        return cls(
            tuple(IndexBound(**entry) for entry in data.get("bounds", ())),
            tuple(UncheckedIndex(**entry) for entry in data.get("unchecked", ())),
        )


@dataclass(frozen=True)
class _Relation:
    """``tensor = scale * value + offset`` for the input's ``value``, valid for values in [low, high]."""

    low: int  # the input's own dtype range to start with
    high: int
    scale: int = 1
    offset: int = 0
    steps: tuple[str, ...] = ()

    def then(self, step: str, scale: int = 1, offset: int = 0) -> _Relation:
        return _Relation(
            self.low, self.high, self.scale * scale, self.offset * scale + offset, (*self.steps, step)
        )

    def within(self, low: int, high: int) -> tuple[int, int]:
        """The values of the input for which ``low <= scale * value + offset <= high``, cut to the range
        the relation holds in (first > last when there are none)."""
        if self.scale > 0:
            first, last = _ceil_div(low - self.offset, self.scale), (high - self.offset) // self.scale
        else:
            first, last = _ceil_div(high - self.offset, self.scale), (low - self.offset) // self.scale
        return max(first, self.low), min(last, self.high)

    def restricted(self, step: str, low: int, high: int) -> _Relation:
        first, last = self.within(low, high)
        return _Relation(first, last, self.scale, self.offset, (*self.steps, step))


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


class _Graph:
    """Lookups over a model and all its subgraphs (ONNX names are unique across nested scopes)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        # imported here: the per-call check imports this module for its result types at every session
        # start, and the graph utilities are only needed when a graph is analysed
        from optimum_ipu_backend.compiler.graphs import iter_graphs

        self.model = model
        self._iter_graphs = iter_graphs
        self.consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        self.producers: dict[str, onnx.NodeProto] = {}
        self.initializers: dict[str, onnx.TensorProto] = {}
        self.constant_nodes: dict[str, onnx.NodeProto] = {}
        self.value_types: dict[str, onnx.TypeProto] = {}
        # subgraph output name -> the node whose subgraph it leaves
        self.leaves_subgraph: dict[str, onnx.NodeProto] = {}
        # names read inside each control-flow node's subgraphs (outer-scope captures among them)
        self.captured: dict[str, set[str]] = {}  # keyed by the node's first output
        for graph in iter_graphs(model.graph):
            self.initializers.update((init.name, init) for init in graph.initializer)
            for value in (*graph.input, *graph.output, *graph.value_info):
                self.value_types.setdefault(value.name, value.type)
            for node in graph.node:
                for slot, name in enumerate(node.input):
                    if name:
                        self.consumers.setdefault(name, []).append((node, slot))
                for name in node.output:
                    self.producers[name] = node
                if node.op_type == "Constant":
                    self.constant_nodes[node.output[0]] = node
                for attribute in node.attribute:
                    subgraphs = (
                        [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs
                    )
                    for sub in subgraphs:
                        for output in sub.output:
                            self.leaves_subgraph[output.name] = node
                        for inner in iter_graphs(sub):
                            names = self.captured.setdefault(node.output[0], set())
                            names.update(
                                name for inner_node in inner.node for name in inner_node.input if name
                            )
                            names.update(output.name for output in inner.output)
        self._inferred: dict[str, onnx.TypeProto] | None = None
        self._feeds_index = self._upstream_of_indices()

    def _upstream_of_indices(self) -> set[str]:
        """Every tensor some index operand's values depend on."""
        pending = [
            node.input[slot]
            for graph in self._iter_graphs(self.model.graph)
            for node in graph.node
            if (slot := INDEX_OPERANDS.get(node.op_type)) is not None and len(node.input) > slot
        ]
        seen: set[str] = set()
        while pending:
            name = pending.pop()
            if not name or name in seen:
                continue
            seen.add(name)
            producer = self.producers.get(name)
            if producer is not None and producer.op_type not in _SHAPE_ONLY:
                pending.extend(producer.input)
                pending.extend(self.captured.get(producer.output[0], ()))
        return seen

    def feeds_an_index(self, name: str) -> bool:
        return name in self._feeds_index

    def constant(self, name: str) -> np.ndarray | None:
        """The value of a small constant tensor, or None."""
        if name in self.initializers:
            tensor = self.initializers[name]
            if int(np.prod(tensor.dims, dtype=np.int64)) > _MAX_CONSTANT_ELEMENTS or tensor.data_location:
                return None
            return numpy_helper.to_array(tensor)
        node = self.constant_nodes.get(name)
        if node is None:
            return None
        for attribute in node.attribute:
            if attribute.name == "value":
                if int(np.prod(attribute.t.dims, dtype=np.int64)) > _MAX_CONSTANT_ELEMENTS:
                    return None
                return numpy_helper.to_array(attribute.t)
            if attribute.name == "value_int":
                return np.array(attribute.i)
            if attribute.name == "value_ints":
                return np.array(list(attribute.ints))
        return None

    def single_integer(self, name: str) -> int | None:
        """The one value of an integer constant whose elements are all equal, or None."""
        value = self.constant(name)
        if value is None or value.size == 0 or not np.issubdtype(value.dtype, np.integer):
            return None
        first = value.reshape(-1)[0]
        return int(first) if (value == first).all() else None

    def dims(self, name: str) -> list[int | None] | None:
        """Static dims of a tensor (None per unknown axis), or None when its rank is unknown."""
        if name in self.initializers:
            return list(self.initializers[name].dims)
        node = self.constant_nodes.get(name)
        if node is not None:
            value = self.constant(name)
            if value is not None:
                return list(value.shape)
        value_type = self.value_types.get(name) or self._inferred_types().get(name)
        if value_type is None or not value_type.tensor_type.HasField("shape"):
            return None
        return [
            dim.dim_value if dim.HasField("dim_value") else None for dim in value_type.tensor_type.shape.dim
        ]

    def _inferred_types(self) -> dict[str, onnx.TypeProto]:
        """Shape inference, run only when a table is neither a constant nor typed in the graph."""
        if self._inferred is None:
            self._inferred = {}
            try:
                inferred = onnx.shape_inference.infer_shapes(self.model)
            except Exception as exc:  # a graph onnx cannot infer leaves the sizes unknown, never fails
                _logger.info("shape inference failed while sizing index tables: %s", exc)
                return self._inferred
            for graph in self._iter_graphs(inferred.graph):
                for value in (*graph.input, *graph.output, *graph.value_info):
                    self._inferred.setdefault(value.name, value.type)
        return self._inferred


def _attribute(node: onnx.NodeProto, name: str, default: int) -> int:
    for attribute in node.attribute:
        if attribute.name == name:
            return int(attribute.i)
    return default


def _table_size(graph: _Graph, node: onnx.NodeProto) -> tuple[str, int | None, str]:
    """(table name, its static size along the indexed axis or None, why it is unknown)."""
    if node.op_type == "OneHot":
        depth = graph.single_integer(node.input[1]) if len(node.input) > 1 else None
        if depth is None and len(node.input) > 1:
            value = graph.constant(node.input[1])
            if value is not None and value.size == 1:  # OneHot allows a float depth
                depth = int(value.reshape(-1)[0])
        return node.input[1], depth, "its depth is not a constant"
    table = node.input[0]
    dims = graph.dims(table)
    if dims is None:
        return table, None, f"the shape of {table!r} is unknown"
    if node.op_type in ("Gather", "GatherElements", "ScatterElements", "Scatter"):
        axis = _attribute(node, "axis", 0)
        axis = axis + len(dims) if axis < 0 else axis
        if not 0 <= axis < len(dims) or dims[axis] is None:
            return table, None, f"{table!r} has no static size on axis {axis}"
        return table, dims[axis], ""
    # GatherND / ScatterND: the last axis of the indices addresses the data's dims after batch_dims; the
    # smallest of them bounds every column (exact when they are equal, as for square tables).
    batch_dims = _attribute(node, "batch_dims", 0)
    index_dims = graph.dims(node.input[1])
    depth = index_dims[-1] if index_dims else None
    addressed = dims[batch_dims:] if depth is None else dims[batch_dims : batch_dims + depth]
    if not addressed or any(size is None for size in addressed):
        return table, None, f"{table!r} has no static size on the axes the indices address"
    return table, min(addressed), ""  # type: ignore[type-var]


def _describe_steps(steps: tuple[str, ...]) -> str:
    return " -> ".join(steps)


class _Walk:
    """Follows one graph input forward through the operators whose effect on values is known."""

    def __init__(self, graph: _Graph, input_name: str, input_type: int) -> None:
        self.graph = graph
        self.input = input_name
        self.bounds: list[IndexBound] = []
        self.unchecked: list[UncheckedIndex] = []
        info = np.iinfo(_INTEGER_TYPES[input_type])
        start = _Relation(low=int(info.min), high=int(info.max))
        self._visit(input_name, start, set())

    def _visit(self, tensor: str, relation: _Relation, seen: set[str]) -> None:
        if tensor in seen:
            return
        seen = seen | {tensor}
        if tensor in self.graph.leaves_subgraph:
            parent = self.graph.leaves_subgraph[tensor]
            if any(self.graph.feeds_an_index(output) for output in parent.output):
                self._unprovable(tensor, f"it leaves a subgraph of {parent.op_type} {parent.name!r}")
        for node, slot in self.graph.consumers.get(tensor, ()):
            self._step(node, slot, relation, seen)

    def _step(self, node: onnx.NodeProto, slot: int, relation: _Relation, seen: set[str]) -> None:
        op = node.op_type
        if INDEX_OPERANDS.get(op) == slot:
            self._bound(node, relation)
        if VALUE_PRESERVING.get(op) == slot:
            for output in node.output:
                self._visit(output, relation.then(op), seen)
            return
        if INDEX_OPERANDS.get(op) == slot or op in _SHAPE_ONLY or (op in VALUE_PRESERVING and slot > 0):
            return  # an index use (checked above), a shape use, or a shape/axes operand: no value flows on
        follow = self._affine(node, slot, relation)
        if follow is not None:
            self._visit(node.output[0], follow, seen)
        elif any(self.graph.feeds_an_index(output) for output in node.output):
            self._unprovable(node.output[0], f"it passes through {op} {node.name!r}")

    def _affine(self, node: onnx.NodeProto, slot: int, relation: _Relation) -> _Relation | None:
        op = node.op_type
        if op == "Neg":
            return relation.then("Neg", scale=-1)
        if op == "Cast":
            target = _attribute(node, "to", 0)
            if target not in _INTEGER_TYPES:
                return None
            info = np.iinfo(_INTEGER_TYPES[target])
            name = onnx.TensorProto.DataType.Name(target).lower()
            return relation.restricted(f"Cast({name})", int(info.min), int(info.max))
        if op not in ("Add", "Sub", "Mul") or len(node.input) != 2:
            return None
        constant = self.graph.single_integer(node.input[1 - slot])
        if constant is None:
            return None
        if op == "Add":
            return relation.then(f"Add({constant:+d})", offset=constant)
        if op == "Sub":
            if slot == 0:
                return relation.then(f"Sub({constant})", offset=-constant)
            return relation.then(f"Sub from {constant}", scale=-1, offset=constant)
        if constant == 0:
            return None  # the index no longer depends on the input
        return relation.then(f"Mul({constant})", scale=constant)

    def _bound(self, node: onnx.NodeProto, relation: _Relation) -> None:
        table, size, why = _table_size(self.graph, node)
        if size is None:
            self.unchecked.append(UncheckedIndex(self.input, node.name, node.op_type, why))
            return
        low, high = relation.within(0, size - 1)
        self.bounds.append(
            IndexBound(
                self.input,
                low,
                high,
                node.name,
                node.op_type,
                table,
                int(size),
                _describe_steps(relation.steps),
            )
        )

    def _unprovable(self, tensor: str, reason: str) -> None:
        targets = self._index_nodes_downstream(tensor)
        for node in targets:
            self.unchecked.append(UncheckedIndex(self.input, node.name, node.op_type, reason))

    def _index_nodes_downstream(self, tensor: str) -> list[onnx.NodeProto]:
        """The indexing nodes whose index operand depends on ``tensor``."""
        found: dict[str, onnx.NodeProto] = {}
        pending, seen = [tensor], set()
        while pending:
            name = pending.pop()
            if name in seen:
                continue
            seen.add(name)
            if name in self.graph.leaves_subgraph:
                pending.extend(self.graph.leaves_subgraph[name].output)
            for node, slot in self.graph.consumers.get(name, ()):
                if INDEX_OPERANDS.get(node.op_type) == slot:
                    found.setdefault(node.name or node.output[0], node)
                if node.op_type not in _SHAPE_ONLY:
                    pending.extend(node.output)
        return list(found.values())


@dataclass
class _Collected:
    bounds: dict[tuple, IndexBound] = field(default_factory=dict)
    unchecked: dict[tuple, UncheckedIndex] = field(default_factory=dict)


def analyze_index_ranges(model: onnx.ModelProto) -> IndexRanges:
    """The index bounds of every integer graph input of ``model`` (initializers excluded), and the paths
    from inputs to indices that the analysis cannot bound; see the module docstring."""
    graph = _Graph(model)
    initializers = {init.name for init in model.graph.initializer}
    collected = _Collected()
    for value in model.graph.input:
        elem_type = value.type.tensor_type.elem_type
        if value.name in initializers or elem_type not in _INTEGER_TYPES:
            continue
        walk = _Walk(graph, value.name, elem_type)
        for bound in walk.bounds:
            collected.bounds.setdefault(
                (bound.input, bound.node, bound.low, bound.high, bound.table, bound.path), bound
            )
        for entry in walk.unchecked:
            collected.unchecked.setdefault((entry.input, entry.node, entry.reason), entry)
    return IndexRanges(tuple(collected.bounds.values()), tuple(collected.unchecked.values()))
