"""What every opset-11 rewrite shares: the scope it reads types and constants from, and how it refuses.

A rewrite sees one node at a time. It reads the element types, static shapes and constant values of the
node's inputs through a :class:`GraphScope`, the graph's view (which also resolves names from enclosing
graphs, so If/Loop branches see outer initializers), and returns the opset-11 nodes that replace it. New
constants go through the scope too: the main graph gets initializers, subgraphs get ``Constant`` nodes (a
branch's initializers are legal ONNX but not something PopART's If lowering is known to read).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...graphs import GraphView, NameAllocator, attribute, attributes

FLOAT_TYPES: frozenset[int] = frozenset(
    {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}
)


class CannotLower(Exception):
    """A rewrite's refusal: the node is left as it is and reported with ``reason``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class GraphScope(GraphView):
    """The view of one graph a lowering reads (see :class:`GraphView`), and where its new constants go."""

    def __init__(
        self,
        graph: onnx.GraphProto,
        parent: GraphScope | None,
        types: dict[str, onnx.TypeProto],
        names: NameAllocator,
        listed_initializers_are_constant: bool = False,
    ) -> None:
        super().__init__(
            graph,
            types=types,
            parent=parent,
            initializer_inputs_are_constant=listed_initializers_are_constant,
        )
        self.names = names
        self.new_initializers: list[onnx.TensorProto] = []
        self._pending_nodes: list[onnx.NodeProto] = []

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
        self.add_constant_value(name, np.asarray(value))
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
    #: The domain of ``op_types``: the default one, or a runtime's own (com.microsoft's fused operators).
    domain: ClassVar[str] = ""

    @abstractmethod
    def lower(
        self, node: onnx.NodeProto, since_version: int, scope: GraphScope
    ) -> list[onnx.NodeProto] | None:
        """The replacement nodes, or None when the node already means the same at opset 11.

        ``since_version`` is the version of the node's operator in the model's source opset. Raise
        :class:`CannotLower` when the node cannot be expressed at opset 11.
        """


def text_attribute(node: onnx.NodeProto, name: str, default: str) -> str:
    """A string attribute as text (ONNX stores strings as bytes), or ``default`` when absent."""
    return as_text(attribute(node, name, default))


def as_text(value: Any) -> Any:
    """``value`` with bytes decoded, the form string attributes are compared in."""
    return value.decode() if isinstance(value, bytes) else value


def copy_attributes(node: onnx.NodeProto, drop: Iterable[str] = ()) -> dict[str, Any]:
    """A node's attributes as keyword arguments for ``helper.make_node``, minus ``drop``."""
    dropped = set(drop)
    return {name: value for name, value in attributes(node).items() if name not in dropped}


def input_at(node: onnx.NodeProto, index: int) -> str:
    """The name of an optional input, or '' when it is absent."""
    return node.input[index] if index < len(node.input) else ""


def numpy_dtype(elem_type: int) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
