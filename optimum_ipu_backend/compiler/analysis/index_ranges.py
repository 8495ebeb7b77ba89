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

For each such path the allowed values are those that put the index in ``[-size, size - 1]``, ``size``
being the table's static size along the indexed axis: ONNX counts a negative index from the end, and the
compiler maps negative indices of those operators (``INDICES_FROM_THE_END``) into ``[0, size - 1]``
before the device reads them. A OneHot's indices must lie in ``[0, depth - 1]``. The indices of GatherND
and ScatterND are tuples: column ``j`` of their last axis addresses the data's axis ``batch_dims + j``,
and is bounded by that axis where the input's last axis is the tuples' axis (the path only computes
element by element); otherwise the smallest addressed axis bounds every column.

Where an input reaches an index operand through anything else (a comparison, CumSum, an addition of
two tensors, a Cast to a float type, a control-flow node's outputs) the relation between its values
and the index is not provable by this analysis, and the path is reported in ``unchecked``. Such
indices are computed by the graph itself from masks and shapes (RoBERTa's position ids are a CumSum
of ``input_ids != pad``): their range follows from the sequence length, which the compiled sizes and
the model's position limit already bound. They are not checked per call, and the session says so in
its log when it is created.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import onnx

from optimum_ipu_backend.compiler.graphs import (
    INDEX_OPERANDS,
    INDICES_FROM_THE_END,
    INTEGER_TYPES,
    SHAPE_ONLY,
    GraphView,
    attribute,
    index_operand_sources,
    reach,
    subgraphs_of,
)

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

# Of VALUE_PRESERVING: those whose output value at each position is the input's at the same position.
_ELEMENTWISE_COPIES = frozenset({"Identity", "Dropout"})

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
    #: The column of the input's last axis the bound holds for (a GatherND/ScatterND index tuple's column);
    #: None: every value.
    column: int | None = None


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
    #: Every step computed element by element: the tensor's positions are the input's (broadcast aside).
    elementwise: bool = True

    def then(self, step: str, scale: int = 1, offset: int = 0, elementwise: bool = True) -> _Relation:
        return _Relation(
            self.low,
            self.high,
            self.scale * scale,
            self.offset * scale + offset,
            (*self.steps, step),
            self.elementwise and elementwise,
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
        return _Relation(first, last, self.scale, self.offset, (*self.steps, step), self.elementwise)


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


class _Graph:
    """The model's view over all its subgraphs, and what this analysis asks of it."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.view = GraphView.of_model(model, subgraphs=True)
        self.consumers = self.view.consumers
        # subgraph output name -> the node whose subgraph it leaves
        self.leaves_subgraph = {
            output.name: node
            for node in self.view.producer.values()
            for sub in subgraphs_of(node)
            for output in sub.output
        }
        self._feeds_index = index_operand_sources(self.view)

    def feeds_an_index(self, name: str) -> bool:
        return name in self._feeds_index

    def constant(self, name: str) -> np.ndarray | None:
        """The value of a small constant tensor (an embedding table is no offset), or None."""
        return self.view.constant(name, max_elements=_MAX_CONSTANT_ELEMENTS)

    def single_integer(self, name: str) -> int | None:
        """The one value of an integer constant whose elements are all equal, or None."""
        value = self.constant(name)
        if value is None or value.size == 0 or not np.issubdtype(value.dtype, np.integer):
            return None
        first = value.reshape(-1)[0]
        return int(first) if (value == first).all() else None

    def dims(self, name: str) -> list[int | None] | None:
        """Static dims of a tensor (None per unknown axis), or None when its rank is unknown."""
        value = self.constant(name)
        dims = value.shape if value is not None else self.view.shape(name)
        return None if dims is None else list(dims)


def _table_sizes(graph: _Graph, node: onnx.NodeProto) -> tuple[str, tuple[int, ...] | None, str]:
    """(table name, its static sizes along the indexed axes or None, why they are unknown): one size, or for
    GatherND/ScatterND with a static tuple length, one per column of the index tuples."""
    if node.op_type == "OneHot":
        depth = graph.single_integer(node.input[1]) if len(node.input) > 1 else None
        if depth is None and len(node.input) > 1:
            value = graph.constant(node.input[1])
            if value is not None and value.size == 1:  # OneHot allows a float depth
                depth = int(value.reshape(-1)[0])
        return node.input[1], None if depth is None else (depth,), "its depth is not a constant"
    table = node.input[0]
    dims = graph.dims(table)
    if dims is None:
        return table, None, f"the shape of {table!r} is unknown"
    if node.op_type in ("Gather", "GatherElements", "ScatterElements", "Scatter"):
        axis = attribute(node, "axis", 0)
        axis = axis + len(dims) if axis < 0 else axis
        if not 0 <= axis < len(dims) or dims[axis] is None:
            return table, None, f"{table!r} has no static size on axis {axis}"
        return table, (dims[axis],), ""
    # GatherND / ScatterND: column j of the indices' last axis addresses the data's dim batch_dims + j.
    batch_dims = attribute(node, "batch_dims", 0)
    index_dims = graph.dims(node.input[1])
    depth = index_dims[-1] if index_dims else None
    addressed = dims[batch_dims:] if depth is None else dims[batch_dims : batch_dims + depth]
    if not addressed or any(size is None for size in addressed):
        return table, None, f"{table!r} has no static size on the axes the indices address"
    return table, tuple(addressed) if depth is not None else (min(addressed),), ""  # type: ignore[arg-type]


class _Walk:
    """Follows one graph input forward through the operators whose effect on values is known."""

    def __init__(self, graph: _Graph, input_name: str, input_type: int) -> None:
        self.graph = graph
        self.input = input_name
        self.bounds: list[IndexBound] = []
        self.unchecked: list[UncheckedIndex] = []
        info = np.iinfo(INTEGER_TYPES[input_type])
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
                self._visit(output, relation.then(op, elementwise=op in _ELEMENTWISE_COPIES), seen)
            return
        if INDEX_OPERANDS.get(op) == slot or op in SHAPE_ONLY or (op in VALUE_PRESERVING and slot > 0):
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
            target = attribute(node, "to", 0)
            if target not in INTEGER_TYPES:
                return None
            info = np.iinfo(INTEGER_TYPES[target])
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
        table, sizes, why = _table_sizes(self.graph, node)
        if sizes is None:
            self.unchecked.append(UncheckedIndex(self.input, node.name, node.op_type, why))
            return
        input_dims = self.graph.dims(self.input)
        by_column = (
            len(sizes) > 1 and relation.elementwise and bool(input_dims) and input_dims[-1] == len(sizes)
        )
        columns = list(enumerate(sizes)) if by_column else [(None, min(sizes))]
        for column, size in columns:
            first = -size if node.op_type in INDICES_FROM_THE_END else 0
            low, high = relation.within(first, size - 1)
            self.bounds.append(
                IndexBound(
                    self.input,
                    low,
                    high,
                    node.name,
                    node.op_type,
                    table,
                    int(size),
                    " -> ".join(relation.steps),
                    column,
                )
            )

    def _unprovable(self, tensor: str, reason: str) -> None:
        targets = self._index_nodes_downstream(tensor)
        for node in targets:
            self.unchecked.append(UncheckedIndex(self.input, node.name, node.op_type, reason))

    def _index_nodes_downstream(self, tensor: str) -> list[onnx.NodeProto]:
        """The indexing nodes whose index operand depends on ``tensor``."""
        found: dict[str, onnx.NodeProto] = {}

        def downstream(name: str) -> list[str]:
            after = (
                list(self.graph.leaves_subgraph[name].output) if name in self.graph.leaves_subgraph else []
            )
            for node, slot in self.graph.consumers.get(name, ()):
                if INDEX_OPERANDS.get(node.op_type) == slot:
                    found.setdefault(node.name or node.output[0], node)
                if node.op_type not in SHAPE_ONLY:
                    after.extend(node.output)
            return after

        reach([tensor], downstream)
        return list(found.values())


def analyze_index_ranges(model: onnx.ModelProto) -> IndexRanges:
    """The index bounds of every integer graph input of ``model`` (initializers excluded), and the paths
    from inputs to indices that the analysis cannot bound; see the module docstring."""
    graph = _Graph(model)
    initializers = {init.name for init in model.graph.initializer}
    bounds: dict[tuple, IndexBound] = {}
    unchecked: dict[tuple, UncheckedIndex] = {}
    for value in model.graph.input:
        elem_type = value.type.tensor_type.elem_type
        if value.name in initializers or elem_type not in INTEGER_TYPES:
            continue
        walk = _Walk(graph, value.name, elem_type)
        for bound in walk.bounds:
            bounds.setdefault(
                (bound.input, bound.node, bound.low, bound.high, bound.table, bound.path, bound.column), bound
            )
        for entry in walk.unchecked:
            unchecked.setdefault((entry.input, entry.node, entry.reason), entry)
    return IndexRanges(tuple(bounds.values()), tuple(unchecked.values()))
