"""FixShapes: every graph input gets the static shape asked for, and shapes are inferred from it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import onnx

from ..errors import PATTERN_INPUT_SIZE, LegalizationError, UnsupportedNode
from ..graphs import infer_shapes, iter_graphs, subgraphs_of, type_runtime_operator_outputs
from .base import GraphPass, PassContext

_SHAPE_HINTS = (
    "give every graph input a static shape, e.g. input_shapes={'input_ids': (1, 128)} "
    "or `optimum-ipu check --shape input_ids=1,128`",
    "the sizes must agree with the dimensions the export fixed (shown as numbers above)",
)


def dim_labels(value_info: onnx.ValueInfoProto) -> list[str | int]:
    """The dims of a tensor as numbers where static and names (or '?') where not."""
    labels: list[str | int] = []
    for dim in value_info.type.tensor_type.shape.dim:
        if dim.HasField("dim_value"):
            labels.append(dim.dim_value)
        else:
            labels.append(dim.dim_param or "?")
    return labels


def is_static(value_info: onnx.ValueInfoProto) -> bool:
    """Whether a tensor's type has a known rank and every dim a known size."""
    tensor_type = value_info.type.tensor_type
    if not tensor_type.HasField("shape"):
        return False
    return all(dim.HasField("dim_value") for dim in tensor_type.shape.dim)


def _check_request(
    graph_input: onnx.ValueInfoProto, requested: Sequence[int] | None
) -> tuple[list[int] | None, UnsupportedNode | None]:
    labels = dim_labels(graph_input)
    name = graph_input.name
    if requested is None:
        if is_static(graph_input):
            return [int(d) for d in labels], None
        symbolic = [label for label in labels if not isinstance(label, int)]
        reason = f"no size given for its dynamic dims {symbolic} (shape {labels})"
        return None, UnsupportedNode(name, "graph input", "", reason, PATTERN_INPUT_SIZE)
    sizes = [int(d) for d in requested]
    if len(sizes) != len(labels):
        reason = f"asked for rank {len(sizes)} {sizes} but the input has rank {len(labels)} {labels}"
        return None, UnsupportedNode(name, "graph input", "", reason, PATTERN_INPUT_SIZE)
    for axis, (size, label) in enumerate(zip(sizes, labels, strict=True)):
        if size < 0:
            return None, UnsupportedNode(
                name, "graph input", "", f"negative size {size} on axis {axis}", PATTERN_INPUT_SIZE
            )
        if isinstance(label, int) and label != size:
            reason = f"asked for {sizes} but axis {axis} is fixed to {label} in the graph (shape {labels})"
            return None, UnsupportedNode(name, "graph input", "", reason, PATTERN_INPUT_SIZE)
    return sizes, None


def _set_shape(value_info: onnx.ValueInfoProto, sizes: Sequence[int]) -> None:
    shape = value_info.type.tensor_type.shape
    shape.ClearField("dim")
    for size in sizes:
        shape.dim.add().dim_value = int(size)


def _forget_inferred_shapes(model: onnx.ModelProto) -> None:
    # Stale symbolic dims would be merged with (and win over) the new static ones.
    for graph in iter_graphs(model.graph):
        del graph.value_info[:]
        is_top = graph is model.graph
        for output in graph.output:
            if output.type.HasField("tensor_type") and not is_static(output):
                output.type.tensor_type.ClearField("shape")
        if not is_top:
            for graph_input in graph.input:
                if graph_input.type.HasField("tensor_type") and not is_static(graph_input):
                    graph_input.type.tensor_type.ClearField("shape")


def _type_passthrough_outputs(model: onnx.ModelProto) -> bool:
    """Give subgraph outputs that are enclosing-scope values (a branch returning an input as is) that
    value's type, which ONNX inference does not carry into the subgraph. Return whether any changed."""
    changed = False
    scopes: list[tuple[onnx.GraphProto, dict[str, onnx.ValueInfoProto]]] = [(model.graph, {})]
    while scopes:
        graph, outer = scopes.pop()
        known = dict(outer)
        known.update({vi.name: vi for vi in list(graph.input) + list(graph.value_info) + list(graph.output)})
        for node in graph.node:
            for sub in subgraphs_of(node):
                for output in sub.output:
                    source = known.get(output.name)
                    if source is not None and is_static(source) and not is_static(output):
                        output.type.CopyFrom(source.type)
                        changed = True
                scopes.append((sub, known))
    return changed


def refresh_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Drop every inferred shape (keeping graph inputs) and infer them again from the inputs."""
    _forget_inferred_shapes(model)
    type_runtime_operator_outputs(model)  # ONNX's inference does not know onnxruntime's fused operators
    model = infer_shapes(model, propagate_data=True)
    if _type_passthrough_outputs(model):
        model = infer_shapes(model, propagate_data=True)
    return model


def fix_input_shapes(
    model: onnx.ModelProto, input_shapes: Mapping[str, Sequence[int]]
) -> dict[str, list[int]]:
    """Write the requested static shapes onto the graph inputs in place; return every input's shape."""
    initializer_names = {init.name for init in model.graph.initializer}
    graph_inputs = [i for i in model.graph.input if i.name not in initializer_names]
    known = {i.name for i in graph_inputs}
    problems: list[UnsupportedNode] = [
        UnsupportedNode(
            name,
            "graph input",
            "",
            f"not an input of this graph (inputs: {sorted(known)})",
            PATTERN_INPUT_SIZE,
        )
        for name in input_shapes
        if name not in known
    ]
    fixed: dict[str, list[int]] = {}
    for graph_input in graph_inputs:
        sizes, problem = _check_request(graph_input, input_shapes.get(graph_input.name))
        if problem is not None:
            problems.append(problem)
        elif sizes is not None:
            fixed[graph_input.name] = sizes
    if problems:
        raise LegalizationError("The graph inputs cannot be given static shapes.", problems, _SHAPE_HINTS)
    for graph_input in graph_inputs:
        _set_shape(graph_input, fixed[graph_input.name])
    return fixed


class FixShapes(GraphPass):
    """Replace every dynamic input dimension by the requested size and infer all tensor shapes."""

    name = "fix_shapes"
    guarantee = "every graph input has the requested static shape; shapes are inferred from them"

    def run(self, model: onnx.ModelProto, ctx: PassContext) -> onnx.ModelProto:
        self.notes = []
        dynamic_before = [i.name for i in model.graph.input if not is_static(i)]
        fix_input_shapes(model, ctx.input_shapes)
        model = refresh_shapes(model)
        dynamic_outputs = [o.name for o in model.graph.output if not is_static(o)]
        if dynamic_before:
            self.notes.append(f"fixed {len(dynamic_before)} dynamic input(s)")
        if dynamic_outputs:
            self.notes.append(f"{len(dynamic_outputs)} output(s) still dynamic until folding")
        return model
