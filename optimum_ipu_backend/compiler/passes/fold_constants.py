"""FoldConstants: constant subexpressions, including whole shape and mask subgraphs, become initializers.

Folding is delegated to onnxslim (onnx-graphsurgeon's folder, which evaluates each constant subgraph
with onnxruntime, plus exact eliminations of redundant Reshape/Transpose/Slice/Concat/Unsqueeze). See
docs/compiler.md for the comparison with onnxscript's optimizer that led to this choice.

onnxslim cannot fold inside control flow (it fails on optimum's merged decoders), so every subgraph of a
top-level If/Loop/Scan is folded as a model of its own: the outer-scope values it reads become its graph
inputs (or, for outer initializers, its initializers, so that shape constants still fold), and the
folded nodes are put back into the branch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx
from numpy.typing import ArrayLike
from onnx import numpy_helper

from ..graphs import (
    GraphView,
    attribute,
    constant_node_value,
    has_subgraphs,
    iter_nodes,
    names_defined,
    names_read,
    subgraphs_of,
)
from ..op_table import default_opset
from .base import GraphPass, PassContext
from .fix_shapes import refresh_shapes

# MatMul+Add -> Reshape+Gemm+Reshape adds nodes and rounds differently; PopART runs MatMul natively.
_SKIPPED_FUSIONS = ["FusionGemm", "FusionGemmMul", "FusionGemmAdd"]
# onnxslim's shape inference returns None (not a model, and no error) below ai.onnx opset 7.
_SLIM_SHAPE_INFERENCE_SINCE_OPSET = 7


def _slim_infers_shapes_right(model: onnx.ModelProto) -> bool:
    """Whether onnxslim's shape inference may run on the model (else slim folds on the shapes it has).

    Below opset 7 it returns no model. Its Resize handler takes `sizes` (or zips `scales`) as the whole
    output shape, ignoring Resize-18's `axes` and `keep_aspect_ratio_policy`: a wrong shape, which slim
    then fails to reconcile with the declared output (IndexError), or passes on downstream.
    """
    opset = default_opset(model)
    if opset is None or opset < _SLIM_SHAPE_INFERENCE_SINCE_OPSET:
        return False
    return not any(
        node.op_type == "Resize"
        and (
            attribute(node, "axes") is not None
            or attribute(node, "keep_aspect_ratio_policy", b"stretch") != b"stretch"
        )
        for node in iter_nodes(model.graph)
    )


def _slim(model: onnx.ModelProto) -> onnx.ModelProto:
    import onnxslim  # heavy import (onnx-graphsurgeon, sympy): only when a pass runs

    # onnxslim logs every pattern it applies at INFO; the pass report already says what changed.
    slim_logger = logging.getLogger("onnxslim")
    previous_level = slim_logger.level
    slim_logger.setLevel(logging.WARNING)
    try:
        return onnxslim.slim(
            model,
            skip_fusion_patterns=list(_SKIPPED_FUSIONS),
            no_shape_infer=not _slim_infers_shapes_right(model),
        )
    finally:
        slim_logger.setLevel(previous_level)


def _fold_subgraph(
    branch: onnx.GraphProto,
    outer_types: dict[str, onnx.ValueInfoProto],
    outer_initializers: dict[str, onnx.TensorProto],
    model: onnx.ModelProto,
) -> onnx.GraphProto:
    """Fold a subgraph that has no inputs of its own (an If branch) as a standalone model."""
    outer_refs = sorted(names_read(branch) - names_defined(branch))
    missing = [name for name in outer_refs if name not in outer_types and name not in outer_initializers]
    if missing or len(branch.input) > 0:
        # A Loop/Scan body, or an outer value without a known type: leave it as it is.
        return branch
    standalone = onnx.helper.make_graph(
        nodes=list(branch.node),
        name=branch.name or "subgraph",
        inputs=[outer_types[name] for name in outer_refs if name not in outer_initializers],
        outputs=list(branch.output),
        initializer=list(branch.initializer)
        + [outer_initializers[n] for n in outer_refs if n in outer_initializers],
        value_info=list(branch.value_info),
    )
    sub_model = onnx.helper.make_model(
        standalone, opset_imports=list(model.opset_import), ir_version=model.ir_version
    )
    folded = _slim(sub_model).graph
    kept_initializers = []
    for init in folded.initializer:
        outer = outer_initializers.get(init.name)
        if outer is not None and outer.SerializeToString() == init.SerializeToString():
            continue  # still the outer tensor: resolved from the enclosing scope
        kept_initializers.append(init)
    shadowing = {init.name for init in kept_initializers if init.name in outer_initializers}
    if shadowing:
        # A folded value that kept an outer name would shadow it, which ONNX forbids.
        return branch
    result = onnx.GraphProto()
    result.name = branch.name
    result.node.extend(folded.node)
    result.initializer.extend(kept_initializers)
    result.output.extend(folded.output)
    result.value_info.extend(folded.value_info)
    return result


def fold_control_flow(model: onnx.ModelProto) -> None:
    """Fold, in place, the subgraphs held by the top-level graph's nodes."""
    graph = model.graph
    outer_types = {vi.name: vi for vi in list(graph.input) + list(graph.value_info) + list(graph.output)}
    outer_initializers = {init.name: init for init in graph.initializer}
    for node in graph.node:
        for sub in subgraphs_of(node):
            sub.CopyFrom(_fold_subgraph(sub, outer_types, outer_initializers, model))


def bind_constant_inputs(model: onnx.ModelProto, values: Mapping[str, ArrayLike]) -> onnx.ModelProto:
    """A copy of ``model`` where the named graph inputs are constants with the given values.

    With ``{"use_cache_branch": True}`` an optimum merged decoder becomes the plain decoder-with-past:
    FoldStaticIfs then inlines the If branch taken, and the graph can be static (the two branches of a
    merged decoder return present key/values of different lengths, so the If itself never is).
    """
    bound = onnx.ModelProto()
    bound.CopyFrom(model)
    inputs = {graph_input.name: graph_input for graph_input in bound.graph.input}
    unknown = sorted(set(values) - set(inputs))
    if unknown:
        raise ValueError(f"not graph inputs: {unknown}; inputs are {sorted(inputs)}")
    kept = [graph_input for graph_input in bound.graph.input if graph_input.name not in values]
    del bound.graph.input[:]
    bound.graph.input.extend(kept)
    for name, value in values.items():
        elem_type = inputs[name].type.tensor_type.elem_type
        dims = [d.dim_value for d in inputs[name].type.tensor_type.shape.dim]
        array = np.asarray(value, dtype=onnx.helper.tensor_dtype_to_np_dtype(elem_type))
        if all(dims) and array.size == int(np.prod(dims)):
            array = array.reshape(dims)
        bound.graph.initializer.append(numpy_helper.from_array(array, name))
    return bound


# Operators whose value is not a function of their inputs: folding would fix one draw for every run.
_RANDOM_OPS = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli", "Multinomial"}
)


#: The largest value the top-level folder writes into the graph: a larger one (a ConstantOfShape of a
#: big shape) would cost more to hold than to compute.
_FOLDED_VALUE_MAX_BYTES = 1 << 20


def fold_top_level(model: onnx.ModelProto, *, everywhere: bool) -> int:
    """Replace, in place, top-level nodes whose values are known by Constant nodes holding them: a Shape or
    Size of a tensor whose shape is static, and a node that computes from constants only (evaluated with
    onnxruntime, as onnxslim evaluates the rest). Random operators and nodes holding subgraphs are kept.

    Without ``everywhere`` only nodes that produce graph outputs are folded: onnxslim, which folds the
    rest, keeps a node whose output is a graph output, so a constant result (an EyeLike of constants, the
    Shape of an input) would reach PopART as an operator it lacks or an int64 it cannot hold. With
    ``everywhere`` (a graph holding control flow, which onnxslim cannot fold) every such node is folded, in
    order, so shape chains around a Scan or Loop become constants; Constants nothing reads any more are
    dropped. Returns how many nodes were folded."""
    graph = model.graph
    stored = {
        init.name: init for init in graph.initializer if init.data_location != onnx.TensorProto.EXTERNAL
    }
    known: dict[str, np.ndarray] = {}  # values read so far: an initializer is converted when first needed

    def value_of(name: str) -> np.ndarray | None:
        if name not in known and name in stored:
            known[name] = numpy_helper.to_array(stored[name])
        return known.get(name)

    outputs = {value.name for value in graph.output}
    view: GraphView | None = None
    nodes, folded = [], 0
    for node in graph.node:
        if node.op_type == "Constant":
            value = constant_node_value(node)
            if value is not None:
                known[node.output[0]] = value
            nodes.append(node)
            continue
        if not (everywhere or outputs.intersection(node.output)):
            nodes.append(node)
            continue
        if node.op_type in ("Shape", "Size"):
            view = view or GraphView.of_model(model)
            shape_value = static_shape_value(node, view.shape(node.input[0]))
            values = None if shape_value is None else [shape_value]
        else:
            values = evaluated_outputs(node, value_of, model.opset_import)
        if values is None:
            nodes.append(node)
            continue
        names = [name for name in node.output if name]
        for name, value in zip(names, values, strict=True):
            known[name] = np.asarray(value)
            nodes.append(
                onnx.helper.make_node(
                    "Constant", [], [name], value=numpy_helper.from_array(known[name], name)
                )
            )
        folded += 1
    if folded:
        del graph.node[:]
        graph.node.extend(nodes)
        if everywhere:
            _drop_unread_constants(graph)
    return folded


def evaluated_outputs(
    node: onnx.NodeProto, value_of: Callable[[str], np.ndarray | None], opset_import: Any
) -> list[np.ndarray] | None:
    """The outputs of a node that computes from known values only, evaluated with onnxruntime; else None."""
    inputs = list(dict.fromkeys(name for name in node.input if name))
    if not inputs or node.op_type in _RANDOM_OPS or subgraphs_of(node):
        return None
    arrays = [value_of(name) for name in inputs]
    if any(array is None for array in arrays):
        return None
    import onnxruntime

    names = [name for name in node.output if name]
    alone = onnx.helper.make_graph(
        [node],
        "fold",
        [],
        [onnx.helper.make_empty_tensor_value_info(name) for name in names],
        [numpy_helper.from_array(array, name) for name, array in zip(inputs, arrays, strict=True)],
    )
    evaluated = onnx.helper.make_model(alone, opset_imports=list(opset_import))
    try:
        values = onnxruntime.InferenceSession(
            evaluated.SerializeToString(), providers=["CPUExecutionProvider"]
        ).run(None, {})
    except Exception:  # onnxruntime has no kernel for it: the device computes it, as before
        return None
    if sum(np.asarray(value).nbytes for value in values) > _FOLDED_VALUE_MAX_BYTES:
        return None
    return [np.asarray(value) for value in values]


def _drop_unread_constants(graph: onnx.GraphProto) -> None:
    """Drop top-level Constant nodes whose output nothing reads (folding left them behind)."""
    while True:
        read = names_read(graph)
        kept = [node for node in graph.node if node.op_type != "Constant" or node.output[0] in read]
        if len(kept) == len(graph.node):
            return
        del graph.node[:]
        graph.node.extend(kept)


def static_shape_value(node: onnx.NodeProto, shape: tuple[int | None, ...] | None) -> np.ndarray | None:
    """What a Shape (with its start and end) or Size node gives for an input of a static shape."""
    if shape is None or any(dim is None for dim in shape):
        return None
    dims = np.array(shape, dtype=np.int64)
    if node.op_type == "Size":
        return np.array(np.prod(dims), dtype=np.int64)
    start, end = attribute(node, "start", 0), attribute(node, "end", None)
    return dims[slice(start, end)]


def _drop_unused_initializers(graph: onnx.GraphProto) -> None:
    used = names_read(graph)
    kept = [init for init in graph.initializer if init.name in used]
    if len(kept) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(kept)


def has_foldable_node(graph: onnx.GraphProto) -> bool:
    """Whether a node of ``graph`` (no control flow) computes only from constants, or is a Shape or Size
    (every shape is static by then): what this pass's guarantee says is folded."""
    constants = {init.name for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            constants.update(node.output)
            continue
        inputs = [name for name in node.input if name]
        if node.op_type in ("Shape", "Size") or (inputs and all(name in constants for name in inputs)):
            return True
    return False


class FoldConstants(GraphPass):
    """Fold every constant subexpression (shape and mask computations included) with onnxslim.

    ``only_if_foldable`` (the cleanup after lowering): the first fold left the graph at onnxslim's
    fixpoint, so onnxslim runs again only when the lowering left something to fold. Otherwise the pass's
    guarantee already holds and the graph is kept as it is: a rerun would only remove what a lowering
    wrote redundantly (a product with a scale of ones), which PopART computes exactly, at a third of
    a legalization's time."""

    name = "fold_constants"
    guarantee = "no node computes only from constants; shape/mask subgraphs of static inputs are folded"

    def __init__(self, name: str | None = None, *, only_if_foldable: bool = False) -> None:
        super().__init__()
        if name is not None:
            self.name = name
        self.only_if_foldable = only_if_foldable

    def run(self, model: onnx.ModelProto, ctx: PassContext) -> onnx.ModelProto:
        self.notes = []
        if self.only_if_foldable and not has_subgraphs(model.graph) and not has_foldable_node(model.graph):
            return refresh_shapes(model)
        if has_subgraphs(model.graph):
            fold_control_flow(model)
            folded = fold_top_level(model, everywhere=True)
            _drop_unused_initializers(model.graph)
            self.notes.append("folded each control-flow branch as its own graph")
            if folded:
                self.notes.append(f"folded {folded} top-level node(s) around the control flow")
            return refresh_shapes(model)
        model = _slim(model)
        folded = fold_top_level(model, everywhere=False)
        if folded:
            self.notes.append(f"folded {folded} node(s) that compute a graph output from constants")
        return model
