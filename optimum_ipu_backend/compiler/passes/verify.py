"""VerifyPopartReady: the graph is something PopART SDK 3.4 can compile, or an error says why not."""

from __future__ import annotations

import onnx

from ..errors import (
    DEFAULT_HINTS,
    PATTERN_CUSTOM_DOMAIN,
    PATTERN_DEVICE_DTYPE,
    PATTERN_DYNAMIC_SHAPE,
    PATTERN_INVALID_GRAPH,
    PATTERN_MISSING_OPERATOR,
    PATTERN_OPSET,
    PATTERN_RUNTIME_OPERAND,
    PATTERN_SHAPE_INFERENCE,
    LegalizationError,
    UnsupportedNode,
    branch_binding_hint,
)
from ..graphs import GraphView, attribute, infer_shapes, iter_graphs, iter_nodes
from ..op_table import (
    COMPILE_TIME_OPERANDS,
    DEFAULT_DOMAINS,
    FORBIDDEN_DTYPES,
    INT64_ONLY_OPERANDS,
    POPART_INT32_OUTPUTS,
    POPART_MAX_OPSET,
    POPART_MISSING_OPSET11_OPS,
    POPART_OPSET11_OPS,
    branch_inputs,
    dtype_name,
)
from .base import GraphPass, PassContext
from .fix_shapes import dim_labels, is_static

_MAX_PROTO_BYTES = 2**31 - 1


def _strict_inference(
    model: onnx.ModelProto, problems: list[UnsupportedNode]
) -> tuple[onnx.ModelProto, bool]:
    try:
        inferred = infer_shapes(model, strict=True, propagate_data=True)
    except Exception as error:  # onnx raises several unrelated types here
        problems.append(
            UnsupportedNode(
                "<graph>",
                "shape inference",
                "",
                f"strict shape inference failed: {error}",
                PATTERN_SHAPE_INFERENCE,
            )
        )
        return model, False
    return inferred, True


def _check(model: onnx.ModelProto, problems: list[UnsupportedNode]) -> None:
    if model.ByteSize() > _MAX_PROTO_BYTES:
        return  # the checker needs a path for such models; strict inference above covers the types
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as error:
        reason = str(error).strip().splitlines()[0]
        # the full check ends with strict shape inference, whose failure may be the sizes'; the rest of
        # the checker's findings are faults of the graph's structure
        pattern = (
            PATTERN_SHAPE_INFERENCE
            if isinstance(error, onnx.shape_inference.InferenceError)
            else PATTERN_INVALID_GRAPH
        )
        problems.append(UnsupportedNode("<graph>", "onnx.checker", "", reason, pattern))


def _opset_problems(model: onnx.ModelProto) -> list[UnsupportedNode]:
    problems = []
    for opset in model.opset_import:
        if opset.domain in DEFAULT_DOMAINS:
            if opset.version > POPART_MAX_OPSET:
                reason = (
                    f"imports ai.onnx opset {opset.version}; PopART accepts opsets 6 to {POPART_MAX_OPSET}"
                )
                problems.append(
                    UnsupportedNode("<model>", "opset_import", opset.domain, reason, PATTERN_OPSET)
                )
        else:
            reason = f"imports custom domain {opset.domain!r} version {opset.version}"
            problems.append(UnsupportedNode("<model>", "opset_import", opset.domain, reason, PATTERN_OPSET))
    for function in model.functions:
        problems.append(
            UnsupportedNode(
                function.name,
                "model-local function",
                function.domain,
                "PopART does not inline functions",
                PATTERN_INVALID_GRAPH,
            )
        )
    return problems


def _tensor_problems(
    value_info: onnx.ValueInfoProto | None, name: str, allowed_int64: set[str]
) -> list[tuple[str, str]]:
    """(reason, pattern) for each thing PopART cannot take about one tensor."""
    if value_info is None or not value_info.type.HasField("tensor_type"):
        return [(f"tensor {name!r} has no inferred type and shape", PATTERN_DYNAMIC_SHAPE)]
    problems = []
    elem_type = value_info.type.tensor_type.elem_type
    if elem_type in FORBIDDEN_DTYPES and not (elem_type == onnx.TensorProto.INT64 and name in allowed_int64):
        reason = f"tensor {name!r} is {dtype_name(elem_type)}, which Poplar cannot hold"
        problems.append((reason, PATTERN_DEVICE_DTYPE))
    if not is_static(value_info):
        problems.append(
            (f"tensor {name!r} has a dynamic shape {dim_labels(value_info)}", PATTERN_DYNAMIC_SHAPE)
        )
    return problems


def _narrowed_where_produced(graph: onnx.GraphProto, view: GraphView) -> set[str]:
    """int64-typed outputs PopART computes as INT32 whose every reader is a Cast to int32: no int64 value
    exists on the device (``op_table.POPART_INT32_OUTPUTS``)."""
    narrowed = set()
    for node in iter_nodes(graph):
        for index, name in enumerate(node.output):
            if not name or (node.op_type, index) not in POPART_INT32_OUTPUTS or name in view.graph_outputs:
                continue
            readers = view.consumers.get(name, [])
            if readers and all(
                reader.op_type == "Cast" and attribute(reader, "to") == onnx.TensorProto.INT32
                for reader, _ in readers
            ):
                narrowed.add(name)
    return narrowed


def find_unsupported_nodes(model: onnx.ModelProto) -> list[UnsupportedNode]:
    """Everything that keeps ``model`` from being PopART-ready; an empty list means it is ready."""
    return _verify(model)[0]


def _verify(model: onnx.ModelProto) -> tuple[list[UnsupportedNode], onnx.ModelProto]:
    """The problems found, and the model with every shape inferred (strictly, when that succeeded)."""
    problems = _opset_problems(model)
    inferred, inference_ok = _strict_inference(model, problems)
    _check(model, problems)

    view = GraphView(inferred.graph, subgraphs=True)
    constants: set[str] = set()
    types: dict[str, onnx.ValueInfoProto] = {}
    for graph in iter_graphs(inferred.graph):
        constants.update(init.name for init in graph.initializer)
        constants.update(node.output[0] for node in graph.node if node.op_type == "Constant" and node.output)
        for value_info in list(graph.input) + list(graph.value_info) + list(graph.output):
            types.setdefault(value_info.name, value_info)
    allowed_int64 = {name for name in constants if view.only_feeds(name, INT64_ONLY_OPERANDS)}
    allowed_int64 |= _narrowed_where_produced(inferred.graph, view)

    untyped: set[str] = set()  # outputs with no type, reported once at the node that lost it
    for graph in iter_graphs(inferred.graph):
        scope = "graph" if graph is inferred.graph else f"subgraph {graph.name}"
        for init in graph.initializer:
            if init.data_type in FORBIDDEN_DTYPES and init.name not in allowed_int64:
                reason = f"initializer is {dtype_name(init.data_type)}, which Poplar cannot hold"
                problems.append(UnsupportedNode(init.name, "initializer", "", reason, PATTERN_DEVICE_DTYPE))
        for boundary, values in (("input", graph.input), ("output", graph.output)):
            for value_info in values:
                for reason, pattern in _tensor_problems(value_info, value_info.name, allowed_int64):
                    problems.append(
                        UnsupportedNode(value_info.name, f"{scope} {boundary}", "", reason, pattern)
                    )
        # Graph outputs were checked above; checking them again as node outputs would list them twice.
        boundary_names = {value_info.name for value_info in graph.output}
        for node in graph.node:
            problems.extend(
                _node_problems(node, types, constants, allowed_int64, inference_ok, untyped, boundary_names)
            )
    return problems, inferred


def _node_problems(
    node: onnx.NodeProto,
    types: dict[str, onnx.ValueInfoProto],
    constants: set[str],
    allowed_int64: set[str],
    check_outputs: bool,
    untyped: set[str],
    boundary_names: set[str],
) -> list[UnsupportedNode]:
    node_name = node.name or (node.output[0] if node.output else "<unnamed>")
    found = []

    def report(reason: str, pattern: str) -> None:
        found.append(UnsupportedNode(node_name, node.op_type, node.domain, reason, pattern))

    if node.domain not in DEFAULT_DOMAINS:
        report(
            f"custom domain {node.domain!r}: PopART only runs ai.onnx (and its own ai.graphcore) operators",
            PATTERN_CUSTOM_DOMAIN,
        )
    elif node.op_type not in POPART_OPSET11_OPS:
        if node.op_type in POPART_MISSING_OPSET11_OPS:
            report("an opset-11 operator that PopART 3.4 does not implement", PATTERN_MISSING_OPERATOR)
        else:
            report("not an operator of opset 11 as PopART implements it", PATTERN_MISSING_OPERATOR)
    for index, name in enumerate(node.input):
        if name and (node.op_type, index) in COMPILE_TIME_OPERANDS and name not in constants:
            report(
                f"input {index} ({name!r}) is computed at run time; PopART needs it as a constant",
                PATTERN_RUNTIME_OPERAND,
            )
    # Types are lost downstream of an unknown op or of an untyped tensor: say so only where it starts.
    inherits_unknown = bool(found) or any(name in untyped for name in node.input)
    for name in node.output if check_outputs else ():
        if not name or name in boundary_names:
            continue
        if types.get(name) is None or not types[name].type.HasField("tensor_type"):
            untyped.add(name)
            if inherits_unknown:
                continue
        for reason, pattern in _tensor_problems(types.get(name), name, allowed_int64):
            report(reason, pattern)
    return found


class VerifyPopartReady(GraphPass):
    """Check the graph against everything PopART needs; raise LegalizationError listing each problem."""

    name = "verify"
    guarantee = "onnx-valid, opset <= 11, only PopART ops, static shapes, no dtype Poplar lacks"

    def run(self, model: onnx.ModelProto, ctx: PassContext) -> onnx.ModelProto:
        self.notes = []
        problems, inferred = _verify(model)
        if problems:
            hints = None
            choosing = branch_inputs(model)
            if choosing:
                hints = [branch_binding_hint(choosing), *DEFAULT_HINTS]
            raise LegalizationError("The graph is not PopART-ready.", problems, hints)
        self.notes.append("PopART-ready")
        return inferred
