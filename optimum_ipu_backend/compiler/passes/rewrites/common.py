"""What every opset-11 rewrite shares: the scope it reads types and constants from, and how it refuses.

A rewrite sees one node at a time. It reads the element types, static shapes and constant values of the
node's inputs through a :class:`GraphScope` (which also resolves names from enclosing graphs, so If/Loop
branches see outer initializers), and returns the opset-11 nodes that replace it. New constants go
through the scope too: the main graph gets initializers, subgraphs get ``Constant`` nodes (a branch's
initializers are legal ONNX but not something PopART's If lowering is known to read).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...graphs import NameAllocator, constant_node_value

FLOAT_TYPES: frozenset[int] = frozenset(
    {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}
)


class CannotLower(Exception):
    """A rewrite's refusal: the node is left as it is and reported with ``reason``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class GraphScope:
    """The types, shapes and constants visible from one graph, and where its new constants go."""

    def __init__(
        self,
        graph: onnx.GraphProto,
        parent: GraphScope | None,
        types: dict[str, onnx.TypeProto],
        names: NameAllocator,
        listed_initializers_are_constant: bool = False,
    ) -> None:
        self.graph = graph
        self.parent = parent
        self._types = types
        self.names = names
        self.is_subgraph = parent is not None
        initializer_names = {init.name for init in graph.initializer}
        # From IR 4 on, an initializer that is also a graph input is only a default the caller may
        # override; before, every initializer had to be listed as an input and was still a constant.
        self._input_names = {graph_input.name for graph_input in graph.input} - (
            initializer_names if listed_initializers_are_constant else set()
        )
        self._initializers = {
            init.name: init for init in graph.initializer if init.name not in self._input_names
        }
        self._constant_nodes = {node.output[0]: node for node in graph.node if _is_plain_constant(node)}
        self._constant_cache: dict[str, np.ndarray] = {}
        self.new_initializers: list[onnx.TensorProto] = []
        self._pending_nodes: list[onnx.NodeProto] = []

    # -- reading -------------------------------------------------------------------------------

    def type_of(self, name: str) -> onnx.TypeProto | None:
        scope: GraphScope | None = self
        while scope is not None:
            found = scope._types.get(name)
            if found is not None:
                return found
            scope = scope.parent
        return None

    def learn_type(self, name: str, found: onnx.TypeProto) -> None:
        """Record a type found after shape inference (e.g. node by node inside a subgraph)."""
        self._types[name] = found

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
        if found is not None and found.HasField("tensor_type") and found.tensor_type.HasField("shape"):
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

    def constant(self, name: str) -> np.ndarray | None:
        """The value of a tensor fixed at build time (initializer or Constant node), else None."""
        if not name:
            return None
        scope: GraphScope | None = self
        while scope is not None:
            value = scope._own_constant(name)
            if value is not None:
                return value
            if name in scope._input_names:
                return None  # a subgraph input (a Loop/Scan iteration value) is never a constant
            scope = scope.parent
        return None

    def _own_constant(self, name: str) -> np.ndarray | None:
        if name in self._constant_cache:
            return self._constant_cache[name]
        value: np.ndarray | None = None
        if name in self._initializers:
            value = numpy_helper.to_array(self._initializers[name])
        elif name in self._constant_nodes:
            value = constant_node_value(self._constant_nodes[name])
        if value is not None:
            self._constant_cache[name] = value
        return value

    # -- requiring: what a lowering cannot do without, refused with CannotLower when unknown --------

    def require_constant(self, name: str, reason: str) -> np.ndarray:
        """The value of a tensor the lowering needs at compile time; refused with ``reason`` if unknown."""
        value = self.constant(name)
        if value is None:
            raise CannotLower(reason)
        return value

    def require_constant_ints(self, node: onnx.NodeProto, index: int, what: str) -> list[int]:
        """The values of an integer input that opset 11 needs as an attribute; refuse if not constant."""
        name = input_at(node, index)
        value = self.require_constant(
            name,
            f"its {what} input '{name}' must be a constant to become an opset-11 attribute; "
            "fix the input shapes and fold constants first so that it is computed at compile time",
        )
        return [int(v) for v in np.asarray(value).reshape(-1)]

    def require_rank(self, name: str) -> int:
        rank = self.rank(name)
        if rank is None:
            raise CannotLower(f"the rank of input '{name}' is unknown; fix the input shapes first")
        return rank

    def require_static_shape(self, name: str, why: str) -> tuple[int, ...]:
        dims = self.static_shape(name)
        if dims is None:
            raise CannotLower(
                f"tensor '{name}' has no static shape (inferred: {self.shape(name)}), which {why}; "
                "fix every input dimension and fold constants first"
            )
        return dims

    def require_elem_type(self, name: str) -> int:
        elem_type = self.elem_type(name)
        if elem_type is None:
            raise CannotLower(f"the element type of '{name}' is unknown")
        return elem_type

    # -- writing -------------------------------------------------------------------------------

    def add_constant(self, value: np.ndarray, hint: str, exact_name: str | None = None) -> str:
        """Make ``value`` available under a new name (or ``exact_name``, a replaced node's output)."""
        name = exact_name or self.names.fresh(hint)
        tensor = numpy_helper.from_array(np.asarray(value), name)
        if self.is_subgraph:
            self._pending_nodes.append(helper.make_node("Constant", [], [name], name=name, value=tensor))
        else:
            self.new_initializers.append(tensor)
        self._constant_cache[name] = np.asarray(value)
        return name

    def make_node(
        self,
        op_type: str,
        inputs: Sequence[str],
        outputs: Sequence[str] | int,
        hint: str,
        **attributes: Any,
    ) -> onnx.NodeProto:
        """A default-domain node with a unique name; ``outputs`` may be a count of fresh tensors."""
        if isinstance(outputs, int):
            outputs = [
                self.names.fresh(f"{hint}_out{i}" if outputs > 1 else f"{hint}_out") for i in range(outputs)
            ]
        return helper.make_node(
            op_type, list(inputs), list(outputs), name=self.names.fresh(hint), **attributes
        )

    def take_pending_nodes(self) -> list[onnx.NodeProto]:
        """The Constant nodes added since the last call (subgraphs only), to emit before their users."""
        pending, self._pending_nodes = self._pending_nodes, []
        return pending


class Rewrite(ABC):
    """Replace nodes of ``op_types`` by nodes valid at opset 11 with the same outputs."""

    op_types: ClassVar[frozenset[str]]

    @abstractmethod
    def lower(
        self, node: onnx.NodeProto, since_version: int, scope: GraphScope
    ) -> list[onnx.NodeProto] | None:
        """The replacement nodes, or None when the node already means the same at opset 11.

        ``since_version`` is the version of the node's operator in the model's source opset. Raise
        :class:`CannotLower` when the node cannot be expressed at opset 11.
        """


def _is_plain_constant(node: onnx.NodeProto) -> bool:
    return node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.output) == 1


def attribute(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    """The Python value of a node attribute, or ``default`` when absent."""
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


def text_attribute(node: onnx.NodeProto, name: str, default: str) -> str:
    """A string attribute as text (ONNX stores strings as bytes), or ``default`` when absent."""
    return as_text(attribute(node, name, default))


def as_text(value: Any) -> Any:
    """``value`` with bytes decoded, the form string attributes are compared in."""
    return value.decode() if isinstance(value, bytes) else value


def copy_attributes(node: onnx.NodeProto, drop: Iterable[str] = ()) -> dict[str, Any]:
    """A node's attributes as keyword arguments for ``helper.make_node``, minus ``drop``."""
    dropped = set(drop)
    return {
        attr.name: helper.get_attribute_value(attr) for attr in node.attribute if attr.name not in dropped
    }


def input_at(node: onnx.NodeProto, index: int) -> str:
    """The name of an optional input, or '' when it is absent."""
    return node.input[index] if index < len(node.input) else ""


def numpy_dtype(elem_type: int) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
