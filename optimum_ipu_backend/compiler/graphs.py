"""What every pass needs to read or extend an ONNX graph, written once.

* Walking a graph and its If/Loop/Scan subgraphs (``iter_graphs``, ``iter_nodes``, ``names_read``), and
  the value a Constant node holds (``constant_node_value``).
* A weight-free copy (``weight_free_copy``, ``shape_view``): shape inference, onnxslim and the checker
  serialize the whole model, and no pass needs a weight's values, so initializers of ``WEIGHT_MIN_BYTES``
  or more travel as typed graph inputs. One threshold for every such copy.
* Fresh names that clash with nothing in the model (``NameAllocator``), and the nodes a rewrite splices
  in (``NodeSplice``).
* Which tensors feed a table's indices (``index_operand_sources``).
* One shape inference (``infer_shapes``), always on a weight-free copy, so a model above protobuf's 2 GiB
  limit is inferred like any other; a node's attributes (``attribute``); a tensor's bytes
  (``value_bytes``).
* ``GraphView``: what one graph scope sees (types, shapes, constants, producers and consumers), and
  through its parent what the enclosing scopes hold; every pass, rewrite and analysis reads a graph
  through it.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import onnx
from google.protobuf.message import Message
from onnx import helper, numpy_helper

#: Initializers at least this large (or stored outside the model file) are weights: a weight-free copy
#: carries them as typed graph inputs instead of data.
WEIGHT_MIN_BYTES = 64 * 1024

_DEFAULT_DOMAINS = ("", "ai.onnx")

_logger = logging.getLogger(__name__)

#: op_type -> the input slot holding indices into a table (the table is input 0, except for OneHot).
INDEX_OPERANDS: Mapping[str, int] = {
    "Gather": 1,
    "GatherElements": 1,
    "GatherND": 1,
    "ScatterND": 1,
    "ScatterElements": 1,
    "Scatter": 1,
    "OneHot": 0,
}

#: The operators of ``INDEX_OPERANDS`` whose negative indices count from the end of the indexed axis, as ONNX
#: defines them, in the compiled graph too: their lowerings map [-size, -1] onto [0, size - 1] before the
#: device reads them (``passes/rewrites/negative_indices.py``, ``passes/rewrites/gather_scatter.py``).
INDICES_FROM_THE_END: frozenset[str] = frozenset(
    {"Gather", "GatherElements", "GatherND", "ScatterElements", "ScatterND"}
)

#: ONNX integer element types and their numpy types.
INTEGER_TYPES: Mapping[int, type[np.integer]] = {
    onnx.TensorProto.INT8: np.int8,
    onnx.TensorProto.UINT8: np.uint8,
    onnx.TensorProto.INT16: np.int16,
    onnx.TensorProto.UINT16: np.uint16,
    onnx.TensorProto.INT32: np.int32,
    onnx.TensorProto.UINT32: np.uint32,
    onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.UINT64: np.uint64,
}

#: Operators whose outputs depend on the shape of their input, not on its values.
SHAPE_ONLY = frozenset({"Shape", "Size", "ConstantOfShape", "EyeLike"})


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


def node_reads(node: onnx.NodeProto) -> set[str]:
    """The names a node reads: its inputs, and what the subgraphs it holds read."""
    read = {name for name in node.input if name}
    for sub in subgraphs_of(node):
        read |= names_read(sub)
    return read


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


def attributes(node: onnx.NodeProto) -> dict[str, Any]:
    """The Python value of each attribute of a node, by name."""
    return {attr.name: helper.get_attribute_value(attr) for attr in node.attribute}


def attribute(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    """The Python value of a node attribute, or ``default`` when absent (the others are not read)."""
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


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


def value_bytes(value: onnx.ValueInfoProto) -> int:
    """Bytes a typed tensor takes, an unknown dimension counted as 1."""
    tensor_type = value.type.tensor_type
    dims = [dim.dim_value if dim.HasField("dim_value") else 1 for dim in tensor_type.shape.dim]
    return int(math.prod(dims)) * element_bytes(tensor_type.elem_type)


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


def initializer_inputs_as_constants(copy: WeightFreeCopy) -> None:
    """Make the graph inputs that name an initializer constants of ``copy``'s graph (in place).

    IR 3 lists every initializer among the graph inputs; from IR 4 such an input is a default a caller may
    override. An IPU executable is compiled with the values it holds, so the compiled graph takes them as
    constants (the session refuses a feed for one, naming it), and the graph becomes IR 4 at least, where
    an initializer need not be an input: passes that add initializers (folding a Constant) then keep
    every input defined, which an IR-3 graph would not.
    """
    graph = copy.model.graph
    copy.model.ir_version = max(copy.model.ir_version, 4)
    constants = {init.name for init in graph.initializer}
    listed = [value.name for value in graph.input if value.name in constants or value.name in copy.weights]
    if not listed:
        return
    # A weight stays a typed stand-in input while the passes run and is an initializer again afterwards.
    copy.added_inputs.update(copy.weights)
    kept = [value for value in graph.input if value.name not in constants]
    del graph.input[:]
    graph.input.extend(kept)


def shape_view(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model to hand to shape inference: the same graph, its weights typed inputs instead of data."""
    return weight_free_copy(model).model


def infer_shapes(
    model: onnx.ModelProto, *, strict: bool = False, propagate_data: bool = False, with_weights: bool = True
) -> onnx.ModelProto:
    """``model`` with the types and shapes ONNX shape inference finds, its initializers as they were (or,
    without ``with_weights``, for reading types only, its weights as typed graph inputs).

    Inference runs on a weight-free copy: serializing the weights would only cost time, and fails above
    protobuf's 2 GiB. ``strict`` makes a type error or a failed inference raise. ``propagate_data``
    propagates values (so Shape->Gather->Reshape chains get sizes) where the graph has no subgraphs: onnx
    keys the propagated values by tensor name across all scopes, and the two branches of an optimum merged
    decoder reuse names, so one branch's values would leak into the other ("Incompatible dimensions").
    """
    light = weight_free_copy(model) if any(is_weight(init) for init in model.graph.initializer) else None
    inferred = onnx.shape_inference.infer_shapes(
        model if light is None else light.model,
        check_type=strict,
        strict_mode=strict,
        data_prop=propagate_data and not has_subgraphs(model.graph),
    )
    if (
        light is not None and with_weights
    ):  # the weights go back in their places: initializers, and no added inputs
        del inferred.graph.input[len(model.graph.input) :]
        del inferred.graph.initializer[:]
        inferred.graph.initializer.extend(model.graph.initializer)
    return inferred


# -- a runtime's own operators ---------------------------------------------------------------------------


def is_runtime_operator(node: onnx.NodeProto) -> bool:
    """An operator ONNX does not define: of another domain (com.microsoft's fused operators), or one
    onnxruntime registers in the default domain (SimplifiedLayerNormalization)."""
    return node.domain not in _DEFAULT_DOMAINS or not onnx.defs.has(node.op_type)


def type_runtime_operator_outputs(model: onnx.ModelProto) -> None:
    """Give the outputs of the runtime's own operators their types and shapes (``value_info``, in place).

    ONNX's shape inference does not know them, so without this nothing after them is typed either, and a
    shape computed from one (a Shape of a fused layer norm's output) is never folded. onnxruntime's
    symbolic shape inference knows them; where it cannot type one, its type stays unknown and what needs
    it refuses, naming the node."""
    runtime_outputs = {
        name for node in iter_nodes(model.graph) if is_runtime_operator(node) for name in node.output if name
    }
    if not runtime_outputs:
        return
    inferred = _symbolic_shapes(shape_view(model))
    if inferred is None:
        return
    typed = {value.name for value in (*model.graph.value_info, *model.graph.input, *model.graph.output)}
    model.graph.value_info.extend(
        value
        for value in inferred.graph.value_info
        if value.name in runtime_outputs and value.name not in typed and has_shape(value.type)
    )


def _symbolic_shapes(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """``model`` typed by onnxruntime's symbolic shape inference as far as it gets, or None.

    ``SymbolicShapeInference.infer_shapes`` saves the model into the working directory and raises where it
    types only part of a graph; its steps, run here, keep what it typed and write nothing. Should those
    steps change in onnxruntime, the types stay unknown and the rewrites refuse their nodes by name."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    try:
        inference = SymbolicShapeInference(2**31 - 1, True, False, 0)  # int_max, auto_merge, guess, verbose
        inference._preprocess(model)
        while inference.run_:
            inference._infer_impl()
        return inference.out_mp_
    except Exception:  # noqa: BLE001 - its failure leaves the types as they were
        return None


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

    def constant_node(self, value: np.ndarray, hint: str) -> tuple[onnx.NodeProto, str]:
        """A Constant node holding ``value``, and its output's name (both fresh, from ``hint``)."""
        name = self.fresh(hint)
        tensor = numpy_helper.from_array(np.asarray(value), name)
        return helper.make_node("Constant", [], [name], name=self.fresh(f"{hint}_node"), value=tensor), name


class NodeSplice:
    """Nodes a rewrite adds to ``model``'s main graph (a copy the rewrite owns), under fresh names that
    start with ``prefix``: each list of ``before`` runs just before the node at that position, ``front``
    before all; ``renamed_input[(position, slot)]`` becomes that node's input; ``replaced`` positions are
    dropped. Nothing changes in the graph until ``splice``."""

    def __init__(self, model: onnx.ModelProto, prefix: str) -> None:
        self.graph = model.graph
        self._names = NameAllocator.for_model(model)
        self._prefix = prefix
        self.front: list[onnx.NodeProto] = []
        self.before: dict[int, list[onnx.NodeProto]] = defaultdict(list)
        self.renamed_input: dict[tuple[int, int], str] = {}
        self.replaced: set[int] = set()

    def fresh(self, hint: str) -> str:
        return self._names.fresh(f"{self._prefix}{hint}")

    def node(
        self,
        where: list[onnx.NodeProto],
        op_type: str,
        inputs: list[str],
        hint: str,
        output: str | None = None,
        **attributes: object,
    ) -> str:
        """Append a node to ``where``; return its output's name."""
        output = output or self.fresh(f"{hint}_output")
        where.append(helper.make_node(op_type, inputs, [output], name=self.fresh(hint), **attributes))
        return output

    def constant(self, value: np.ndarray, hint: str) -> str:
        """The name of a new initializer holding ``value``."""
        name = self.fresh(hint)
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def splice(self) -> None:
        for (index, slot), name in self.renamed_input.items():
            self.graph.node[index].input[slot] = name
        nodes = list(self.front)
        for index, node in enumerate(self.graph.node):
            nodes.extend(self.before.get(index, []))
            if index in self.replaced:
                continue
            copied = onnx.NodeProto()
            copied.CopyFrom(node)
            nodes.append(copied)
        del self.graph.node[:]
        self.graph.node.extend(nodes)


# -- producers and consumers ---------------------------------------------------------------------------


def reach(starts: Iterable[str], step: Callable[[str], Iterable[str]]) -> set[str]:
    """Every name reached from ``starts`` by following ``step`` (the names one name leads to), each
    visited once, depth first; empty names (absent optional inputs) are skipped."""
    pending = list(starts)
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if not name or name in seen:
            continue
        seen.add(name)
        pending.extend(step(name))
    return seen


def index_operand_sources(view: GraphView) -> set[str]:
    """Every tensor some index operand's values depend on (``INDEX_OPERANDS``), in every scope the view
    covers: through producers (but not shape-only ones) and, for a control-flow node, the names its
    subgraphs read."""

    def sources(name: str) -> list[str]:
        producer = view.producer.get(name)
        if producer is None or producer.op_type in SHAPE_ONLY:
            return []
        return node_reads(producer)

    return reach(
        (
            node.input[slot]
            for graph in iter_graphs(view.graph)
            for node in graph.node
            if (slot := INDEX_OPERANDS.get(node.op_type)) is not None and len(node.input) > slot
        ),
        sources,
    )


def declared_types(graph: onnx.GraphProto) -> dict[str, onnx.TypeProto]:
    """The types one graph states: of its initializers, and of its inputs, value_info and outputs."""
    types = {
        init.name: helper.make_tensor_type_proto(init.data_type, list(init.dims))
        for init in graph.initializer
    }
    for value in (*graph.input, *graph.value_info, *graph.output):
        if value.type.WhichOneof("value") is not None:
            types[value.name] = value.type
    return types


def has_shape(found: onnx.TypeProto | None) -> bool:
    """Whether a type is a tensor type with a shape (of known rank)."""
    return found is not None and found.HasField("tensor_type") and found.tensor_type.HasField("shape")


def _is_plain_constant(node: onnx.NodeProto) -> bool:
    return node.op_type == "Constant" and node.domain in _DEFAULT_DOMAINS and len(node.output) == 1


class GraphView:
    """The tensors one graph scope sees: types and shapes, constants, producers and consumers.

    ``types`` are the scope's known types (a lowering passes what inference found per graph, since the
    branches of a merged decoder reuse names); without them (``of_model``) the declared types are read
    first and shape inference on a weight-free copy runs once, when a type is asked for that no
    declaration holds. Names the scope does not know are looked up in ``parent``, the enclosing scope.
    ``subgraphs`` makes one flat view of a graph and all its subgraphs (ONNX names are unique across
    nested scopes in graphs that are not merged decoders). From IR 4 on, an initializer that is also a
    graph input is only a default the caller may override: ``initializer_inputs_are_constant`` says
    whether such an initializer still counts as a constant.
    """

    def __init__(
        self,
        graph: onnx.GraphProto,
        *,
        types: dict[str, onnx.TypeProto] | None = None,
        parent: GraphView | None = None,
        model: onnx.ModelProto | None = None,
        subgraphs: bool = False,
        initializer_inputs_are_constant: bool = True,
    ) -> None:
        self.graph = graph
        self.parent = parent
        self.is_subgraph = parent is not None
        self._model = model
        self._subgraphs = subgraphs
        scopes = list(iter_graphs(graph)) if subgraphs else [graph]
        initializers = {init.name: init for scope in scopes for init in scope.initializer}
        inputs = {vi.name for scope in scopes for vi in scope.input}
        self.graph_inputs = inputs - set(initializers) if initializer_inputs_are_constant else inputs
        self.initializers = {
            name: init for name, init in initializers.items() if name not in self.graph_inputs
        }
        self._constant_nodes = {
            node.output[0]: node for scope in scopes for node in scope.node if _is_plain_constant(node)
        }
        if types is None:
            types = {}
            for scope in scopes:
                for name, found in declared_types(scope).items():
                    types.setdefault(name, found)
        self._types = types
        self._inferred: dict[str, onnx.TypeProto] | None = None if model is not None else {}
        self._constants: dict[str, np.ndarray] = {}
        self._computed_from_constants: dict[str, bool] = {}

    @classmethod
    def of_model(cls, model: onnx.ModelProto, *, subgraphs: bool = False) -> GraphView:
        """The view of the model's main graph (and with ``subgraphs``, of every subgraph in it)."""
        return cls(model.graph, model=model, subgraphs=subgraphs)

    # -- producers and consumers ---------------------------------------------------------------------

    @cached_property
    def nodes(self) -> list[onnx.NodeProto]:
        """The graph's own nodes, in order: one list of node objects, so every lookup hands out the same
        objects and their positions hold."""
        return list(self.graph.node)

    @cached_property
    def position(self) -> dict[int, int]:
        """The index in ``nodes`` of each node, by ``id``."""
        return {id(node): index for index, node in enumerate(self.nodes)}

    @cached_property
    def _links(
        self,
    ) -> tuple[dict[str, onnx.NodeProto], dict[str, list[tuple[onnx.NodeProto, int]]], set[str]]:
        _ = self.nodes  # holds the node objects the links hand out
        producer: dict[str, onnx.NodeProto] = {}
        consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
        graph_outputs: set[str] = set()
        for sub in iter_graphs(self.graph) if self._subgraphs else (self.graph,):
            for node in sub.node:
                for index, name in enumerate(node.input):
                    if name:
                        consumers[name].append((node, index))
                for name in node.output:
                    if name:
                        producer[name] = node
            graph_outputs.update(output.name for output in sub.output)
        return producer, consumers, graph_outputs

    @property
    def producer(self) -> dict[str, onnx.NodeProto]:
        """The node that outputs each tensor (absent for graph inputs and initializers)."""
        return self._links[0]

    @property
    def consumers(self) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
        """The ``(node, input index)`` pairs that read each tensor."""
        return self._links[1]

    @property
    def graph_outputs(self) -> set[str]:
        return self._links[2]

    @cached_property
    def subgraph_reads(self) -> set[str]:
        """The names the nodes of nested subgraphs read (outer-scope values an If branch captures)."""
        return {name for node in self.graph.node for sub in subgraphs_of(node) for name in names_read(sub)}

    def slots(self, name: str) -> list[tuple[str, int]]:
        """The (op_type, input index) operand slots that read ``name``."""
        return [(node.op_type, index) for node, index in self.consumers.get(name, ())]

    def only_feeds(self, name: str, allowed: frozenset[tuple[str, int]]) -> bool:
        """Whether ``name`` is read, and only read, by the given operand slots (and is no graph output)."""
        slots = self.slots(name)
        return bool(slots) and name not in self.graph_outputs and all(slot in allowed for slot in slots)

    # -- types and shapes ----------------------------------------------------------------------------

    def type_of(self, name: str) -> onnx.TypeProto | None:
        """The tensor's type as the nearest scope that knows it has it, or None."""
        view: GraphView | None = self
        while view is not None:
            found = view._types.get(name)
            if not has_shape(found):
                found = view._inferred_types().get(name) or found
            if found is not None:
                return found
            view = view.parent
        return None

    def learn_type(self, name: str, found: onnx.TypeProto) -> None:
        """Record a type found after shape inference (e.g. node by node inside a subgraph)."""
        self._types[name] = found

    def _inferred_types(self) -> dict[str, onnx.TypeProto]:
        if self._inferred is None:
            self._inferred = {}
            assert self._model is not None
            try:
                inferred = infer_shapes(self._model, with_weights=False)
            except Exception as exc:  # noqa: BLE001 - a graph onnx cannot infer leaves types unknown
                _logger.info("shape inference failed: %s", exc)
                return self._inferred
            scopes = iter_graphs(inferred.graph) if self._subgraphs else (inferred.graph,)
            for scope in scopes:
                for value in (*scope.input, *scope.value_info, *scope.output):
                    self._inferred.setdefault(value.name, value.type)
        return self._inferred

    def elem_type(self, name: str) -> int | None:
        """The ONNX element type of a tensor, or None when unknown."""
        found = self.type_of(name)
        if found is not None and found.HasField("tensor_type") and found.tensor_type.elem_type:
            return found.tensor_type.elem_type
        value = self.constant(name)
        return None if value is None else helper.np_dtype_to_tensor_dtype(value.dtype)

    def shape(self, name: str) -> tuple[int | None, ...] | None:
        """The tensor's dims (None where unknown), or None when even the rank is unknown."""
        found = self.type_of(name)
        inferred: tuple[int | None, ...] | None = None
        if has_shape(found):
            inferred = tuple(
                dim.dim_value if dim.HasField("dim_value") else None for dim in found.tensor_type.shape.dim
            )
            if None not in inferred:
                return inferred
        value = self.constant(name)
        return inferred if value is None else tuple(int(d) for d in value.shape)

    def rank(self, name: str) -> int | None:
        dims = self.shape(name)
        return None if dims is None else len(dims)

    def static_shape(self, name: str) -> tuple[int, ...] | None:
        """The tensor's dims when every one is known, else None."""
        dims = self.shape(name)
        if dims is None or any(d is None for d in dims):
            return None
        return tuple(int(d) for d in dims)  # type: ignore[arg-type]

    # -- constants -----------------------------------------------------------------------------------

    def constant(self, name: str, max_elements: int | None = None) -> np.ndarray | None:
        """The value of a tensor fixed at build time (initializer or Constant node), else None; None too
        for one of more than ``max_elements`` elements or whose data lies outside the model."""
        if not name:
            return None
        view: GraphView | None = self
        while view is not None:
            value = view._own_constant(name, max_elements)
            if value is not None:
                return value
            if name in view.graph_inputs:
                return None  # a subgraph input (a Loop/Scan iteration value) is never a constant
            view = view.parent
        return None

    def _own_constant(self, name: str, max_elements: int | None) -> np.ndarray | None:
        if name in self._constants:
            value: np.ndarray | None = self._constants[name]
        elif name in self.initializers:
            tensor = self.initializers[name]
            if tensor.data_location == onnx.TensorProto.EXTERNAL or (
                max_elements is not None and math.prod(tensor.dims) > max_elements
            ):
                return None
            value = self._constants[name] = numpy_helper.to_array(tensor)
        elif name in self._constant_nodes:
            value = constant_node_value(self._constant_nodes[name])
            if value is None:
                return None
            self._constants[name] = value
        else:
            return None
        return None if max_elements is not None and value.size > max_elements else value

    def add_constant_value(self, name: str, value: np.ndarray) -> None:
        """Record the value of a constant a rewrite adds under ``name``."""
        self._constants[name] = value

    def is_constant(self, name: str) -> bool:
        """Whether ``name`` is computed from initializers and Constant nodes only."""
        known = self._computed_from_constants
        stack = [name]
        while stack:  # iterative: exported graphs have long constant chains
            current = stack[-1]
            if current in known:
                stack.pop()
                continue
            if current in self.initializers:
                known[current] = True
                stack.pop()
                continue
            node = self.producer.get(current)
            if node is None or current in self.graph_inputs:
                known[current] = False
                stack.pop()
                continue
            pending = [i for i in node.input if i and i not in known]
            if pending:
                stack.extend(pending)
                continue
            known[current] = all(known[i] for i in node.input if i)
            stack.pop()
        return known[name]
