"""LowerToOpset11: every ai.onnx node becomes an opset-11 operator PopART implements, with equal outputs.

``onnx.version_converter`` cannot take optimum's opset-18 exports down to 11 (it has no adapter for
LayerNormalization, Split-18 or Identity-16), so this pass does it node by node: a rewrite per operator
that changed or is missing (``rewrites/``), and for every other node a check that its operator's
version in the source opset means the same as its opset-11 version (``rewrites/reviewed_versions.py``)
and that its element types are ones the opset-11 schema allows. Subgraphs of If/Loop/Scan are lowered
the same way. Anything that cannot be lowered is reported, all nodes at once, in a LegalizationError.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

import onnx
from onnx import helper, numpy_helper

from ..errors import (
    PATTERN_CUSTOM_DOMAIN,
    PATTERN_NO_LOWERING,
    PATTERN_OPSET,
    LegalizationError,
    OpsetConversionError,
    UnsupportedNode,
)
from ..graphs import (
    WEIGHT_MIN_BYTES,
    NameAllocator,
    declared_types,
    element_bytes,
    has_shape,
    infer_shapes,
    is_runtime_operator,
    iter_graphs,
    iter_nodes,
    names_read,
    subgraphs_of,
    type_runtime_operator_outputs,
)
from ..op_table import DEFAULT_DOMAINS, POPART_OPSET11_OPS, default_opset, operator_name
from ..refused_operators import REFUSAL_REASONS
from .base import GraphPass, PassContext
from .prelu6_slope import keep_prelu6_channels
from .rewrites import REWRITE_FOR_OP, CannotLower, GraphScope
from .rewrites.reviewed_versions import NEWEST_REVIEWED_VERSION, SAME_AS_OPSET11
from .scan8_batch import restore_scan8_batch

TARGET_OPSET = 11
#: ONNX 1.6 introduced opset 11 with IR version 6: the oldest IR that can carry it, so the one the most
#: ONNX readers (PopART bundles its own) accept.
TARGET_IR_VERSION = 6

_CONVERSION_HINTS = (
    "check the model file with onnx.checker.check_model(model, full_check=True): the converter needs a valid "
    "graph",
    "export the model again at ai.onnx opset 11 or later (optimum-cli export onnx --opset 11 ...)",
    "file an issue with this message and the model so that the conversion can be fixed",
)
_HINTS = (
    "fix every input dimension and fold constants before lowering (the compiler pipeline does both)",
    "re-export the model with optimum at another opset, or with eager attention",
    "file an issue with the model id and this message so that the missing rewrite can be added",
)


def _tensor_type_string(elem_type: int) -> str:
    return f"tensor({onnx.TensorProto.DataType.Name(elem_type).lower()})"


def _type_violation(node: onnx.NodeProto, scope: GraphScope) -> str | None:
    """Why the node's element types are not allowed by the operator's opset-11 schema, if they are not."""
    schema = onnx.defs.get_schema(node.op_type, TARGET_OPSET, "")
    allowed = {
        constraint.type_param_str: set(constraint.allowed_type_strs) for constraint in schema.type_constraints
    }

    def check(names: list[str], formals: list[onnx.defs.OpSchema.FormalParameter], kind: str) -> str | None:
        for position, name in enumerate(names):
            if not name or not formals:
                continue
            formal = formals[min(position, len(formals) - 1)]
            permitted = allowed.get(formal.type_str, {formal.type_str})
            found = scope.type_of(name)
            if found is None or not found.HasField("tensor_type") or not found.tensor_type.elem_type:
                continue
            actual = _tensor_type_string(found.tensor_type.elem_type)
            if actual not in permitted:
                version = f"{node.op_type}-{schema.since_version}"
                return f"{kind} '{name}' is {actual}, which {version} (opset 11) does not accept"
        return None

    return check(list(node.input), list(schema.inputs), "input") or check(
        list(node.output), list(schema.outputs), "output"
    )


@dataclass
class _RunState:
    """What one run of the pass carries from graph to subgraph."""

    types: dict[int, dict[str, onnx.TypeProto]]  # per graph (by id), name -> inferred type
    names: NameAllocator
    source_opset: int
    listed_initializers_are_constant: bool
    #: The version the model imports of each domain besides ai.onnx (what a contrib rewrite is given).
    domain_versions: dict[str, int] = field(default_factory=dict)
    problems: list[UnsupportedNode] = field(default_factory=list)
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    #: Inputs of replaced nodes: constants among them may have lost their last reader.
    replaced_inputs: set[str] = field(default_factory=set)


class LowerToOpset11(GraphPass):
    """Rewrite every node to an opset-11 operator PopART implements, then import ai.onnx at opset 11."""

    name = "lower_opset11"
    guarantee = (
        "the model imports ai.onnx opset 11 and every node (subgraphs included) is an opset-11 operator in "
        "PopART's table whose meaning and element types are those of the source graph"
    )

    def __init__(self) -> None:
        super().__init__()
        #: How many nodes of each operator were replaced in the last run.
        self.rewritten: dict[str, int] = {}

    def run(self, model: onnx.ModelProto, ctx: PassContext) -> onnx.ModelProto:
        self.notes = []
        self.rewritten = {}
        source_opset = self._source_opset(model)
        if model.functions:
            # Function bodies would need lowering of their own; inlined, they are ordinary nodes.
            model = onnx.inliner.inline_local_functions(model)
            self.notes.append("inlined model-local functions")
        if source_opset < TARGET_OPSET:
            model = self._upgrade(model, source_opset)
            source_opset = TARGET_OPSET
        type_runtime_operator_outputs(model)
        inferred = infer_shapes(model, propagate_data=True, with_weights=False)
        types_by_graph = [declared_types(graph) for graph in iter_graphs(inferred.graph)]
        graphs = list(iter_graphs(model.graph))
        if len(graphs) != len(types_by_graph):
            raise RuntimeError("shape inference changed the number of subgraphs")
        state = _RunState(
            types={id(graph): found for graph, found in zip(graphs, types_by_graph, strict=True)},
            names=NameAllocator.for_model(model),
            source_opset=source_opset,
            listed_initializers_are_constant=model.ir_version < 4,
            domain_versions={
                o.domain: int(o.version) for o in model.opset_import if o.domain not in DEFAULT_DOMAINS
            },
        )
        self._lower_graph(model.graph, None, state)
        if state.problems:
            count = len(state.problems)
            raise LegalizationError(
                f"{count} node(s) cannot be lowered to the ai.onnx opset {TARGET_OPSET} PopART reads.",
                state.problems,
                _HINTS,
            )
        _drop_orphaned_constants(model.graph, state.replaced_inputs)
        _drop_unused_domains(model)
        for opset in model.opset_import:
            if opset.domain in DEFAULT_DOMAINS:
                opset.version = TARGET_OPSET
        model.ir_version = TARGET_IR_VERSION
        self.rewritten = dict(sorted(state.counts.items()))
        if self.rewritten:
            self.notes.append("rewrote " + ", ".join(f"{count} {op}" for op, count in self.rewritten.items()))
        return model

    @staticmethod
    def _source_opset(model: onnx.ModelProto) -> int:
        opset = default_opset(model)
        if opset is None:
            raise LegalizationError("The model imports no ai.onnx opset.", [], _HINTS)
        return opset

    def _upgrade(self, model: onnx.ModelProto, source_opset: int) -> onnx.ModelProto:
        # Going up to 11 is what the stock converter does well (its adapters exist for every old op).
        keep_prelu6_channels(model, source_opset)  # the converter gives PRelu-6's slope PRelu-7's meaning
        try:
            upgraded = onnx.version_converter.convert_version(model, TARGET_OPSET)
        except Exception as error:  # the converter raises bare RuntimeErrors
            raise OpsetConversionError(
                f"The model's ai.onnx opset {source_opset} could not be converted to {TARGET_OPSET} "
                f"(onnx.version_converter): {error}",
                [UnsupportedNode("<graph>", "opset_import", "", str(error), PATTERN_OPSET)],
                _CONVERSION_HINTS,
            ) from error
        restore_scan8_batch(model, upgraded, source_opset)  # the converter drops Scan-8's batch axis
        self.notes.append(f"converted opset {source_opset} up to {TARGET_OPSET} with onnx.version_converter")
        return upgraded

    def _lower_graph(self, graph: onnx.GraphProto, parent: GraphScope | None, state: _RunState) -> None:
        scope = GraphScope(
            graph,
            parent,
            state.types.get(id(graph), {}),
            state.names,
            listed_initializers_are_constant=state.listed_initializers_are_constant,
        )
        _complete_types(graph, scope, state.source_opset)
        lowered: list[onnx.NodeProto] = []
        for node in graph.node:
            for subgraph in subgraphs_of(node):
                self._lower_graph(subgraph, scope, state)
            try:
                replacement = self._lower_node(node, scope, state)
            except CannotLower as refusal:
                where = f" (in subgraph '{graph.name}')" if parent is not None else ""
                state.problems.append(_unsupported(node, refusal.reason + where))
                lowered.append(node)
                continue
            if replacement is None:
                lowered.append(node)
                continue
            state.counts[operator_name(node.domain, node.op_type)] += 1
            state.replaced_inputs.update(name for name in node.input if name)
            lowered.extend(scope.take_pending_nodes())
            lowered.extend(replacement)
        del graph.node[:]
        graph.node.extend(lowered)
        graph.initializer.extend(scope.new_initializers)

    def _lower_node(
        self, node: onnx.NodeProto, scope: GraphScope, state: _RunState
    ) -> list[onnx.NodeProto] | None:
        """The replacement of one node, or None to keep it; CannotLower when neither is possible."""
        source_opset = state.source_opset
        if is_runtime_operator(node):
            contrib = REWRITE_FOR_OP.get(operator_name(node.domain, node.op_type))
            replacement = None
            if contrib is not None:
                replacement = contrib.lower(node, state.domain_versions.get(node.domain, 1), scope)
            if replacement is None:
                if node.domain in DEFAULT_DOMAINS:
                    raise CannotLower(f"ai.onnx opset {source_opset} has no operator {node.op_type}")
                raise CannotLower(f"operators of domain '{node.domain}' have no opset-11 lowering")
            return replacement
        try:
            since_version = onnx.defs.get_schema(node.op_type, source_opset, "").since_version
        except onnx.defs.SchemaError:
            raise CannotLower(f"ai.onnx opset {source_opset} has no operator {node.op_type}") from None
        if since_version > NEWEST_REVIEWED_VERSION:
            raise CannotLower(f"{node.op_type}-{since_version} is newer than any version this pass reviewed")
        rewrite = REWRITE_FOR_OP.get(node.op_type)
        replacement = rewrite.lower(node, since_version, scope) if rewrite is not None else None
        if replacement is not None:
            return replacement
        if node.op_type not in POPART_OPSET11_OPS:
            why = REFUSAL_REASONS.get(node.op_type)
            raise CannotLower(
                f"{node.op_type} is not in PopART's opset-11 table and no rewrite handles it"
                + (f": {why}" if why else "")
            )
        opset11_version = onnx.defs.get_schema(node.op_type, TARGET_OPSET, "").since_version
        if since_version != opset11_version and since_version not in SAME_AS_OPSET11.get(node.op_type, ()):
            raise CannotLower(
                f"{node.op_type}-{since_version} differs from {node.op_type}-{opset11_version} (opset 11) in "
                "ways no rewrite handles"
            )
        violation = _type_violation(node, scope)
        if violation is not None:
            raise CannotLower(violation)
        return None


def _complete_types(graph: onnx.GraphProto, scope: GraphScope, source_opset: int) -> None:
    """Infer, node by node, the shapes whole-model inference left out.

    ONNX shape inference does not give a subgraph the values of outer-scope constants, so inside an If
    branch an Unsqueeze whose axes live in the main graph gets no shape, nor does anything after it. Here
    each such node is inferred alone, with the constants its inputs hold, whatever scope they live in.
    """
    opset_imports = [helper.make_opsetid("", source_opset)]
    for node in graph.node:
        if node.domain not in DEFAULT_DOMAINS or all(has_shape(scope.type_of(o)) for o in node.output if o):
            continue
        if subgraphs_of(node):
            continue
        input_types = {name: scope.type_of(name) for name in node.input if name}
        if any(found is None for found in input_types.values()):
            continue
        input_data = {}
        for name in input_types:
            # A weight's values never matter for shapes; reading one would only cost time.
            dims, elem_type = scope.static_shape(name), scope.elem_type(name)
            if (
                dims is None
                or elem_type is None
                or math.prod(dims) * element_bytes(elem_type) >= WEIGHT_MIN_BYTES
            ):
                continue
            value = scope.constant(name)
            if value is not None:
                input_data[name] = numpy_helper.from_array(value, name)
        try:
            schema = onnx.defs.get_schema(node.op_type, source_opset, "")
            inferred = onnx.shape_inference.infer_node_outputs(
                schema,
                node,
                input_types,
                input_data,
                opset_imports=opset_imports,  # type: ignore[arg-type]
            )
        except Exception:  # noqa: BLE001 - a node inference cannot do leaves its types as they were
            continue
        for name, found in inferred.items():
            if has_shape(found) and not has_shape(scope.type_of(name)):
                scope.learn_type(name, found)


def _drop_unused_domains(model: onnx.ModelProto) -> None:
    """Drop the imports of domains besides ai.onnx that no node uses (optimizers declare several)."""
    used = {node.domain for node in iter_nodes(model.graph)}
    kept = [o for o in model.opset_import if o.domain in DEFAULT_DOMAINS or o.domain in used]
    if len(kept) != len(model.opset_import):
        del model.opset_import[:]
        model.opset_import.extend(kept)


def _drop_orphaned_constants(graph: onnx.GraphProto, candidates: set[str]) -> None:
    """Remove initializers and Constant nodes that only fed replaced nodes (e.g. opset-13 axes inputs)."""
    orphaned = candidates - names_read(graph)
    if not orphaned:
        return
    for sub in iter_graphs(graph):
        kept_initializers = [init for init in sub.initializer if init.name not in orphaned]
        if len(kept_initializers) != len(sub.initializer):
            del sub.initializer[:]
            sub.initializer.extend(kept_initializers)
        kept_nodes = [
            node for node in sub.node if not (node.op_type == "Constant" and set(node.output) <= orphaned)
        ]
        if len(kept_nodes) != len(sub.node):
            del sub.node[:]
            sub.node.extend(kept_nodes)


def _unsupported(node: onnx.NodeProto, reason: str) -> UnsupportedNode:
    pattern = PATTERN_NO_LOWERING if node.domain in DEFAULT_DOMAINS else PATTERN_CUSTOM_DOMAIN
    return UnsupportedNode(
        node.name or (node.output[0] if node.output else ""), node.op_type, node.domain, reason, pattern
    )
