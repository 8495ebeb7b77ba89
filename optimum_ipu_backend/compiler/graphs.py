"""What every pass needs to read or extend an ONNX graph, written once.

* Walking a graph and its If/Loop/Scan subgraphs (``iter_graphs``, ``iter_nodes``, ``names_read``), and
  the value a Constant node holds (``constant_node_value``).
* A weight-free copy (``weight_free_copy``, ``shape_view``): shape inference, onnxslim and the checker
  serialize the whole model, and no pass needs a weight's values, so initializers of ``WEIGHT_MIN_BYTES``
  or more travel as typed graph inputs. One threshold for every such copy.
* Fresh names that clash with nothing in the model (``NameAllocator``).
* Who produces and who reads each tensor (``TensorIndex``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import onnx
from google.protobuf.message import Message
from onnx import helper, numpy_helper

#: Initializers at least this large (or stored outside the model file) are weights: a weight-free copy
#: carries them as typed graph inputs instead of data.
WEIGHT_MIN_BYTES = 64 * 1024

_DEFAULT_DOMAINS = ("", "ai.onnx")


# -- walking -------------------------------------------------------------------------------------------


def subgraphs_of(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs a node holds in its attributes (an If's branches, a Loop's or Scan's body)."""
    found: list[onnx.GraphProto] = []
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            found.append(attr.g)
        elif attr.type == onnx.AttributeProto.GRAPHS:
            found.extend(attr.graphs)
    return found


def iter_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """The graph and, depth first, every subgraph held in a node attribute (If, Loop, Scan)."""
    yield graph
    for node in graph.node:
        for sub in subgraphs_of(node):
            yield from iter_graphs(sub)


def iter_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of the graph and of its subgraphs."""
    for sub in iter_graphs(graph):
        yield from sub.node


def has_subgraphs(graph: onnx.GraphProto) -> bool:
    """Whether any node holds a subgraph (If, Loop, Scan)."""
    return any(subgraphs_of(node) for node in graph.node)


def count_ops(graph: onnx.GraphProto) -> dict[str, int]:
    """How many nodes of each op type the graph holds, subgraphs included."""
    counts: dict[str, int] = {}
    for node in iter_nodes(graph):
        key = node.op_type if node.domain in _DEFAULT_DOMAINS else f"{node.domain}::{node.op_type}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def names_read(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name a node of the graph or of its subgraphs reads, and every graph output."""
    names: set[str] = set()
    for sub in iter_graphs(graph):
        for node in sub.node:
            names.update(name for name in node.input if name)
        names.update(output.name for output in sub.output)
    return names


def names_defined(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name the graph or its subgraphs define (initializers, inputs, node outputs)."""
    names: set[str] = set()
    for sub in iter_graphs(graph):
        names.update(init.name for init in sub.initializer)
        names.update(graph_input.name for graph_input in sub.input)
        for node in sub.node:
            names.update(name for name in node.output if name)
    return names


def all_names(model: onnx.ModelProto) -> Iterator[str]:
    """Every tensor and node name used anywhere in the model (what a new name must not clash with)."""
    for graph in iter_graphs(model.graph):
        for value in (*graph.input, *graph.output, *graph.value_info):
            yield value.name
        for init in graph.initializer:
            yield init.name
        for node in graph.node:
            yield node.name
            yield from node.output
            yield from node.input


def constant_node_value(node: onnx.NodeProto) -> np.ndarray | None:
    """The value a Constant node produces (any of its value_* forms); None for sparse values."""
    for attr in node.attribute:
        if attr.name == "value":
            return numpy_helper.to_array(attr.t)
        if attr.name == "value_float":
            return np.array(attr.f, dtype=np.float32)
        if attr.name == "value_floats":
            return np.array(list(attr.floats), dtype=np.float32)
        if attr.name == "value_int":
            return np.array(attr.i, dtype=np.int64)
        if attr.name == "value_ints":
            return np.array(list(attr.ints), dtype=np.int64)
    return None


# -- weight-free copies --------------------------------------------------------------------------------


def element_bytes(elem_type: int) -> int:
    """Bytes one element of an ONNX element type takes (4 when numpy has no such type)."""
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).itemsize
    except (KeyError, TypeError):
        return 4


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    """Bytes a tensor's values take on the device."""
    return int(math.prod(tensor.dims)) * element_bytes(tensor.data_type)


def is_weight(tensor: onnx.TensorProto) -> bool:
    """Whether an initializer is a weight: large, or stored outside the model file."""
    return tensor.data_location == onnx.TensorProto.EXTERNAL or tensor_bytes(tensor) >= WEIGHT_MIN_BYTES


@dataclass
class WeightFreeCopy:
    """A model whose weights are typed graph inputs, and those weights (the originals, not copies)."""

    model: onnx.ModelProto
    weights: dict[str, onnx.TensorProto] = field(default_factory=dict)
    #: The weights that were not graph inputs already (the inputs to remove when they are put back).
    added_inputs: set[str] = field(default_factory=set)


def _copy_fields(source: Message, target: Message, skip: str) -> None:
    for descriptor, value in source.ListFields():
        if descriptor.name == skip:
            continue
        if hasattr(value, "extend"):  # a repeated field (upb's descriptors no longer expose `label`)
            getattr(target, descriptor.name).extend(value)
        elif descriptor.message_type is not None:
            getattr(target, descriptor.name).CopyFrom(value)
        else:
            setattr(target, descriptor.name, value)


def weight_free_copy(model: onnx.ModelProto) -> WeightFreeCopy:
    """A copy of ``model`` (every field kept) whose top-level weights are typed graph inputs.

    Shape inference, onnxslim and the checker each serialize the whole graph; carrying hundreds of MB of
    weights through each would dominate the time, and their values never matter for shapes or folding
    (a constant expression over a weight is left for the device to compute).
    """
    light = onnx.ModelProto()
    _copy_fields(model, light, skip="graph")
    _copy_fields(model.graph, light.graph, skip="initializer")
    copy = WeightFreeCopy(light)
    graph_inputs = {graph_input.name for graph_input in model.graph.input}
    for init in model.graph.initializer:
        if not is_weight(init):
            light.graph.initializer.append(init)
            continue
        copy.weights[init.name] = init
        if init.name not in graph_inputs:
            copy.added_inputs.add(init.name)
            light.graph.input.append(
                helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
            )
    return copy


def shape_view(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model to hand to shape inference: the same graph, its weights typed inputs instead of data."""
    return weight_free_copy(model).model


# -- names ---------------------------------------------------------------------------------------------


class NameAllocator:
    """Hands out tensor and node names that clash with nothing in the model (all scopes)."""

    def __init__(self, taken: Iterable[str]) -> None:
        self._taken = set(taken)
        self._counter = 0

    @classmethod
    def for_model(cls, model: onnx.ModelProto) -> NameAllocator:
        return cls(all_names(model))

    def fresh(self, hint: str) -> str:
        """``hint`` itself when it is free, else ``hint__N``; either way reserved from now on."""
        base = hint or "lowered"
        name = base
        while name in self._taken:
            self._counter += 1
            name = f"{base}__{self._counter}"
        self._taken.add(name)
        return name


# -- producers and consumers ---------------------------------------------------------------------------


class TensorIndex:
    """Who produces and who reads each tensor: in the graph alone, or with ``subgraphs`` in every scope.

    ``consumers[name]`` lists ``(node, input index)`` pairs; ``producer[name]`` is the node that outputs
    ``name`` (absent for graph inputs and initializers). ``read_in_subgraphs`` holds the names the nodes
    of nested subgraphs read (outer-scope values an If branch captures).
    """

    def __init__(self, graph: onnx.GraphProto, *, subgraphs: bool = True) -> None:
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
        self.graph_outputs: set[str] = set()
        for sub in iter_graphs(graph) if subgraphs else (graph,):
            for node in sub.node:
                for index, name in enumerate(node.input):
                    if name:
                        self.consumers[name].append((node, index))
                for name in node.output:
                    if name:
                        self.producer[name] = node
            self.graph_outputs.update(output.name for output in sub.output)
        self.read_in_subgraphs: set[str] = set()
        for node in graph.node:
            for sub in subgraphs_of(node):
                self.read_in_subgraphs |= names_read(sub)

    def slots(self, name: str) -> list[tuple[str, int]]:
        """The (op_type, input index) operand slots that read ``name``."""
        return [(node.op_type, index) for node, index in self.consumers.get(name, ())]

    def only_feeds(self, name: str, allowed: frozenset[tuple[str, int]]) -> bool:
        """Whether ``name`` is read, and only read, by the given operand slots (and is no graph output)."""
        slots = self.slots(name)
        return bool(slots) and name not in self.graph_outputs and all(slot in allowed for slot in slots)


class GraphFacts:
    """Producers, consumers, ranks and element types of the top-level graph's tensors."""

    def __init__(self, model: onnx.ModelProto) -> None:
        graph = model.graph
        self.graph = graph
        self.initializers = {init.name: init for init in graph.initializer}
        self.graph_inputs = {vi.name for vi in graph.input} - set(self.initializers)
        self.graph_outputs = {vi.name for vi in graph.output}
        # One list of node objects, so every lookup hands out the same objects and their positions hold.
        self.nodes = list(graph.node)
        self.position = {id(node): index for index, node in enumerate(self.nodes)}
        index = TensorIndex(graph, subgraphs=False)
        self.producer = index.producer
        self.consumers = index.consumers
        self.subgraph_reads = index.read_in_subgraphs
        inferred = onnx.shape_inference.infer_shapes(shape_view(model), strict_mode=False)
        self.types: dict[str, onnx.TypeProto] = {}
        for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
            self.types[vi.name] = vi.type
        for init in graph.initializer:
            self.types.setdefault(init.name, helper.make_tensor_type_proto(init.data_type, list(init.dims)))
        self._constant: dict[str, bool] = {}

    def rank(self, name: str) -> int | None:
        tensor_type = self.types.get(name)
        if tensor_type is None or not tensor_type.tensor_type.HasField("shape"):
            return None
        return len(tensor_type.tensor_type.shape.dim)

    def elem_type(self, name: str) -> int | None:
        tensor_type = self.types.get(name)
        return tensor_type.tensor_type.elem_type if tensor_type is not None else None

    def is_constant(self, name: str) -> bool:
        """Whether ``name`` is computed from initializers and Constant nodes only."""
        if name in self._constant:
            return self._constant[name]
        stack = [name]
        while stack:  # iterative: exported graphs have long constant chains
            current = stack[-1]
            if current in self._constant:
                stack.pop()
                continue
            if current in self.initializers:
                self._constant[current] = True
                stack.pop()
                continue
            node = self.producer.get(current)
            if node is None or current in self.graph_inputs:
                self._constant[current] = False
                stack.pop()
                continue
            pending = [i for i in node.input if i and i not in self._constant]
            if pending:
                stack.extend(pending)
                continue
            self._constant[current] = all(self._constant[i] for i in node.input if i)
            stack.pop()
        return self._constant[name]

    def constant_value(self, name: str) -> np.ndarray | None:
        """The value of an initializer or a Constant node's output; None for anything computed."""
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            return constant_node_value(node)
        return None
