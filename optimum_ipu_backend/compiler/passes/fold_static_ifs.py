"""FoldStaticIfs: an If whose condition is fixed once the call's shapes are becomes the branch it takes.

Exporters write shape-conditional code as control flow: torch's TorchScript exporter turns ``x.squeeze(1)``
on a dimension that may be 1 into ``If(Equal(Gather(Shape(x), 1), 1))``, one branch squeezing and the other
not, so the If's output has no single rank. At the static sizes a graph is compiled for, such a condition
is a constant: this pass evaluates it (Shape and Size of tensors whose shapes are known, and nodes that
compute from constants, with onnxruntime as FoldConstants does), moves the nodes and initializers of the
branch taken into the outer graph (ONNX names are unique across scopes, so the outer names a branch reads
resolve unchanged) and gives the branch's outputs the If's output names. It repeats after inferring
shapes again, because a condition may read the shape of an earlier If's output (``x.squeeze(1).squeeze(1)``)
and an inlined branch may hold Ifs of its own. A condition that is a bound input (a merged decoder's
``use_cache_branch``) is a constant too, and folds the same way.

An If whose condition is computed from the data of a call cannot be chosen at compile time. One whose
outputs still have static shapes is left for PopART, which runs If; one whose branches return different
shapes is refused here, naming the node and the inputs its condition is computed from.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import numpy as np
import onnx

from ..errors import (
    DEFAULT_HINTS,
    DYNAMIC_DIMENSIONS_HINT,
    PATTERN_RUNTIME_BRANCH,
    LegalizationError,
    UnsupportedNode,
    branch_binding_hint,
)
from ..graphs import GraphView, attribute, iter_nodes, reach, subgraphs_of
from ..op_table import branch_inputs
from .base import GraphPass, PassContext
from .fix_shapes import is_static, refresh_shapes
from .fold_constants import evaluated_outputs, static_shape_value

#: The value of a tensor when it is known at compile time, else None.
ValueOf = Callable[[str], "np.ndarray | None"]


class StaticValues:
    """The values of a graph's tensors that the static shapes fix: constants, Shape and Size of tensors of
    known shape, and what nodes compute from those alone (each evaluated once, only where every input is
    known, so a condition computed from data costs a walk over its inputs and no evaluation)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.view = GraphView.of_model(model)
        self._opset_import = list(model.opset_import)
        self._known: dict[str, np.ndarray] = {}
        self._unknown: set[str] = set()

    def value(self, name: str) -> np.ndarray | None:
        stack = [name]
        while stack:  # iterative: shape chains can be long
            current = stack[-1]
            if current in self._known or current in self._unknown:
                stack.pop()
                continue
            constant = self.view.constant(current)
            node = self.view.producer.get(current)
            if constant is not None or node is None:
                self._record([current], None if constant is None else [constant])
                stack.pop()
                continue
            if node.op_type in ("Shape", "Size"):
                shape_value = static_shape_value(node, self.view.shape(node.input[0]))
                self._record(node.output, None if shape_value is None else [shape_value])
                stack.pop()
                continue
            pending = [i for i in node.input if i and i not in self._known and i not in self._unknown]
            if pending:
                stack.extend(pending)
                continue
            values = None
            if not subgraphs_of(node) and not any(i in self._unknown for i in node.input if i):
                values = evaluated_outputs(node, self._known.get, self._opset_import)
            self._record(node.output, values)
            stack.pop()
        return self._known.get(name)

    def _record(self, names: Sequence[str], values: list[np.ndarray] | None) -> None:
        outputs = [name for name in names if name]
        if values is None:
            self._unknown.update(outputs)
            return
        self._known.update(zip(outputs, (np.asarray(value) for value in values), strict=True))

    def data_inputs(self, name: str) -> list[str]:
        """The graph inputs ``name`` is computed from, not counting those only read through their shape."""

        def sources(current: str) -> list[str]:
            node = self.view.producer.get(current)
            if node is None or node.op_type in ("Shape", "Size"):
                return []
            return [i for i in node.input if i]

        return sorted(reach([name], sources) & self.view.graph_inputs)


def _branch_nodes_with_if_names(
    if_node: onnx.NodeProto, taken: str, outer_names: set[str]
) -> list[onnx.NodeProto]:
    """The branch's nodes, each branch output renamed to the If output it stands for (in every node that
    makes or reads it, nested subgraphs included); an Identity where the branch output cannot take the
    name (it is an outer value, a branch initializer, or listed twice)."""
    branch = attribute(if_node, taken)
    made = {name for node in branch.node for name in node.output}
    listed = [value.name for value in branch.output]
    renames = {
        branch_output: if_output
        for branch_output, if_output in zip(listed, if_node.output, strict=True)
        if branch_output != if_output
        and branch_output in made
        and listed.count(branch_output) == 1
        and branch_output not in outer_names
    }
    nodes = list(branch.node)
    for node in (inner for top in nodes for inner in _with_nested_nodes(top)):
        for slots in (node.input, node.output):
            for index, name in enumerate(slots):
                if name in renames:
                    slots[index] = renames[name]
    for branch_output, if_output in zip(listed, if_node.output, strict=True):
        if branch_output != if_output and branch_output not in renames:
            nodes.append(
                onnx.helper.make_node(
                    "Identity", [branch_output], [if_output], name=f"{if_output}__from_{taken}"
                )
            )
    return nodes


def _with_nested_nodes(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """``node`` and every node of the subgraphs it holds, at any depth."""
    return [node, *(inner for sub in subgraphs_of(node) for inner in iter_nodes(sub))]


def inline_known_ifs(graph: onnx.GraphProto, value_of: ValueOf) -> int:
    """Replace, in place, each top-level If whose condition ``value_of`` knows by the branch it takes;
    return how many were replaced."""
    outer_names = {name for node in graph.node for name in node.output} | {
        value.name for value in (*graph.input, *graph.initializer)
    }
    inlined = 0
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        condition = None
        if node.op_type == "If":
            condition = value_of(node.input[0])
        if condition is None or condition.size != 1:
            nodes.append(node)
            continue
        taken = "then_branch" if bool(condition.reshape(())) else "else_branch"
        nodes.extend(_branch_nodes_with_if_names(node, taken, outer_names - set(node.output)))
        graph.initializer.extend(attribute(node, taken).initializer)
        inlined += 1
    if inlined:
        del graph.node[:]
        graph.node.extend(nodes)
    return inlined


def _runtime_branch_problems(
    model: onnx.ModelProto, values: StaticValues, call_inputs: Collection[str]
) -> tuple[list[UnsupportedNode], set[str]]:
    """The Ifs left whose condition is computed from data and whose outputs have no static shape, and
    their conditions."""
    view = GraphView.of_model(model)
    problems, conditions = [], set()
    for node in model.graph.node:
        if node.op_type != "If":
            continue
        reached = values.data_inputs(node.input[0])
        # name the call's inputs, not the weights (which the passes see as inputs too), when one is reached
        inputs = [name for name in reached if name in call_inputs] or reached
        dynamic = [name for name in node.output if name and not _static_output(view, name)]
        if not inputs or not dynamic:
            continue  # a condition not computed from data is left to FoldConstants; static outputs to PopART
        reason = (
            f"its condition {node.input[0]!r} is computed at run time from input(s) {inputs}, and the shape "
            f"of its output(s) {dynamic} depends on the branch taken, so the shapes after it are known only "
            "while the model runs; an IPU executable has fixed shapes"
        )
        name = node.name or node.output[0]
        problems.append(UnsupportedNode(name, "If", node.domain, reason, PATTERN_RUNTIME_BRANCH))
        conditions.add(node.input[0])
    return problems, conditions


def _static_output(view: GraphView, name: str) -> bool:
    found = view.type_of(name)
    if found is None or not found.HasField("tensor_type"):
        return False
    value = onnx.ValueInfoProto()
    value.name = name
    value.type.CopyFrom(found)
    return is_static(value)


def _has_if(model: onnx.ModelProto) -> bool:
    return any(node.op_type == "If" for node in model.graph.node)


class FoldStaticIfs(GraphPass):
    """Inline every top-level If whose condition the static shapes fix; refuse one chosen by data whose
    branches differ in shape."""

    name = "fold_static_ifs"
    guarantee = (
        "no top-level If whose condition the static shapes fix; none chosen by data with dynamic outputs"
    )

    def run(self, model: onnx.ModelProto, ctx: PassContext) -> onnx.ModelProto:
        self.notes = []
        if not _has_if(model):
            return model
        inlined = 0
        while True:
            values = StaticValues(model)
            done = inline_known_ifs(model.graph, values.value)
            if not done:
                break
            inlined += done
            model = refresh_shapes(model)  # the next condition may read an inlined branch's shapes
            if not _has_if(model):
                break
        if inlined:
            self.notes.append(f"inlined {inlined} If with a condition fixed by the static shapes")
        if _has_if(model):
            problems, conditions = _runtime_branch_problems(model, StaticValues(model), ctx.input_shapes)
            if problems:
                choosing = [name for name in branch_inputs(model) if name in conditions]
                hints = [branch_binding_hint(choosing)] if choosing else []
                hints.append(
                    "compute both branches and choose between them with a Where (torch.where) so every "
                    "shape is static, or make the condition depend on shapes only"
                )
                # the sizes are static here and are not the cause: no advice about them
                hints.extend(hint for hint in DEFAULT_HINTS if hint != DYNAMIC_DIMENSIONS_HINT)
                raise LegalizationError("An If branch is chosen at run time.", problems, hints)
        return model
