"""The end-of-sentence selection of a sequence-classification head, computed densely.

BART's and MBart's classification heads read the decoder's hidden state at each row's last
end-of-sentence token. The export writes that as a selection whose size is known only at run time::

    mask = Equal(input_ids, eos_id)                      [batch, seq] (perhaps Cast to bool)
    picked = GatherND(hidden, Transpose(NonZero(mask)))  [eos tokens in the batch, hidden]
    rows = Reshape(picked, [Shape(hidden)[0], -1, Shape(hidden)[-1]])
    features = Gather(rows, -1, axis=1)                  [batch, hidden]

``select_last_eos`` replaces it with a static computation of the same value: each row's last matching
position as a one-hot ``last = mask AND (nothing matches after it)``, where "nothing after" is a reverse
exclusive CumSum of the mask equal to 0, and ``features = MatMul(Unsqueeze(last, 1), hidden)`` squeezed:
``1 * h`` plus exact zeros (hidden states are finite), so the same bits as the gather. Every operator is in
PopART's opset-11 table once the graph is lowered, and padding the sequence on the right keeps it exact
where the pad id is not the end-of-sentence id (padded positions never match, hold 0 in the CumSum, and
weigh 0 in the MatMul).

The two are equal under the condition PyTorch's head checks and the export lost: every row holds the same
number, at least one, of end-of-sentence tokens (``BartForSequenceClassification`` raises "All examples
must have the same number of <eos> tokens."). Where counts differ, the original graph mixes rows up (or
fails in its Reshape); the rewritten graph would return each row's own last token. So the rewrite records
that condition (``SameTokenCount``) and the runtime checks it on every call before running, raising an
error where it does not hold. Any other data-dependent selection is left alone, for the caller to refuse.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from optimum_ipu_backend.compiler.graphs import (
    GraphView,
    NameAllocator,
    attribute,
    node_reads,
    reach,
    shape_view,
)
from optimum_ipu_backend.compiler.padding.evaluate import EvaluationError, Evaluator

_logger = logging.getLogger(__name__)

_INTEGER_TYPES = frozenset(
    {TensorProto.INT64, TensorProto.INT32, TensorProto.INT16, TensorProto.INT8, TensorProto.UINT8}
)
# Operators the Reshape target may be built with: each moves elements of the shape vector or constants
# and computes nothing, so its value is the same arrangement of the data's sizes for every size.
_SHAPE_PROJECTIONS = frozenset(
    {"Shape", "Gather", "Slice", "Squeeze", "Unsqueeze", "Concat", "Cast", "Identity"}
)
# Sizes the Reshape target is evaluated at: distinct, and far from any constant the target may hold.
_PROBE_SIZES = (1000003, 1000033, 1000037)


@dataclass(frozen=True)
class SameTokenCount:
    """What the rewrite needs of each call: every row of ``input`` holds the same number, at least one,
    of tokens equal to ``token_id``, and the inputs in ``same_sizes`` have its sizes.

    ``same_sizes`` lists ``(other input, its axis, axis of input)`` for the inputs that declare the same
    dimension as the input's batch or sequence axis: the proof that the hidden state has the input's
    first two axes took those dimensions to be one, so a call must give them one size.
    """

    input: str
    token_id: int
    same_sizes: tuple[tuple[str, int, int], ...] = ()

    def to_json(self) -> list[Any]:
        return [self.input, self.token_id, [list(entry) for entry in self.same_sizes]]

    @classmethod
    def from_json(cls, entry: list[Any]) -> SameTokenCount:
        name, token_id, same_sizes = entry
        return cls(name, int(token_id), tuple((str(o), int(a), int(b)) for o, a, b in same_sizes))


@dataclass
class EosSelection:
    """The rewritten graph and what each call must satisfy for it to equal the export."""

    model: onnx.ModelProto
    #: The NonZero nodes replaced, by name.
    nodes: list[str]
    preconditions: list[SameTokenCount]

    @property
    def note(self) -> str:
        rows = "; ".join(
            f"each row's last token equal to {check.token_id} in {check.input!r}"
            for check in self.preconditions
        )
        return (
            f"end-of-sentence selection {', '.join(repr(n) for n in self.nodes)} computed densely ({rows}); "
            "every call must hold the same number of those tokens, at least one, in every row, as the "
            "model's PyTorch head requires (checked before each call runs)"
        )


@dataclass(frozen=True)
class _Match:
    nonzero: onnx.NodeProto
    mask: str  # the boolean mask NonZero reads
    input: str  # the graph input compared with the token id
    token_id: int
    hidden: str  # the [batch, seq, hidden] tensor GatherND reads
    removed: tuple[onnx.NodeProto, ...]  # NonZero, Transpose, GatherND, Reshape, Gather
    output: str  # the [batch, hidden] features


def _eos_mask_of(facts: GraphView, nonzero: onnx.NodeProto) -> tuple[str, int] | None:
    """(graph input, token id) when ``nonzero`` reads ``Equal(input, scalar integer constant)``, perhaps
    cast to bool; None for any other NonZero."""
    if nonzero.op_type != "NonZero":
        return None
    source = nonzero.input[0]
    node = facts.producer.get(source)
    if node is not None and node.op_type == "Cast" and attribute(node, "to") == TensorProto.BOOL:
        node = facts.producer.get(node.input[0])
    if node is None or node.op_type != "Equal":
        return None
    first, second = node.input
    for data, other in ((first, second), (second, first)):
        if data not in facts.graph_inputs or facts.elem_type(data) not in _INTEGER_TYPES:
            continue
        if facts.rank(data) != 2:
            continue
        value = facts.constant(other)
        if value is not None and value.size == 1 and np.issubdtype(value.dtype, np.integer):
            return data, int(value.reshape(-1)[0])
    return None


def select_last_eos(model: onnx.ModelProto) -> EosSelection | None:
    """A copy of ``model`` with every end-of-sentence selection computed densely; None when the graph
    has none (no NonZero over ``Equal(graph input, integer constant)``).

    Raises ValueError naming the node when a NonZero starts like one but the rest is not the pattern
    above: it is then not served, never guessed at. ``model`` itself is not modified.
    """
    if not any(node.op_type == "NonZero" for node in model.graph.node):
        return None  # most graphs: no shape inference spent on them
    facts = GraphView.of_model(model)
    candidates = [node for node in facts.nodes if _eos_mask_of(facts, node) is not None]
    if not candidates:
        return None
    matches = [_match(model, facts, node) for node in candidates]
    symbolic = _symbolic_dims(model)
    for match in matches:
        _check_hidden_axes(facts, symbolic, match)

    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    names = NameAllocator.for_model(model)
    removed = {id(node) for match in matches for node in match.removed}
    emitted: dict[int, list[onnx.NodeProto]] = {}
    for match in matches:
        gather = match.removed[-1]
        emitted[id(gather)] = _dense_selection(match, facts.elem_type(match.hidden), names)
    nodes: list[onnx.NodeProto] = []
    for node in facts.nodes:
        if id(node) in removed:
            nodes.extend(emitted.get(id(node), []))
        else:
            nodes.append(node)
    del rewritten.graph.node[:]
    removed_nodes = [node for match in matches for node in match.removed]
    rewritten.graph.node.extend(
        _without_dead_nodes(nodes, removed_nodes, {o.name for o in model.graph.output})
    )
    preconditions = [
        SameTokenCount(match.input, match.token_id, _same_sizes(model, match.input)) for match in matches
    ]
    unique = list(dict.fromkeys(preconditions))
    return EosSelection(rewritten, [m.nonzero.name for m in matches], unique)


# ----------------------------------------------------------------------------------------------------
# The pattern
# ----------------------------------------------------------------------------------------------------


def _only_consumer(facts: GraphView, name: str, op_type: str, slot: int, what: str) -> onnx.NodeProto:
    readers = facts.consumers.get(name, [])
    if (
        len(readers) != 1
        or readers[0][0].op_type != op_type
        or readers[0][1] != slot
        or name in facts.graph_outputs
        or name in facts.subgraph_reads
    ):
        found = ", ".join(f"{node.op_type} {node.name!r}" for node, _ in readers) or "nothing"
        raise _NotThePattern(f"{what} should be read by one {op_type} only, and is read by {found}")
    return readers[0][0]


class _NotThePattern(ValueError):
    pass


def _match(model: onnx.ModelProto, facts: GraphView, nonzero: onnx.NodeProto) -> _Match:
    found = _eos_mask_of(facts, nonzero)
    assert found is not None
    name, token_id = found
    try:
        transpose = _only_consumer(facts, nonzero.output[0], "Transpose", 0, "its positions")
        if list(attribute(transpose, "perm", [])) != [1, 0]:
            raise _NotThePattern("its positions are not transposed to (row, position) pairs")
        gather_nd = _only_consumer(facts, transpose.output[0], "GatherND", 1, "its (row, position) pairs")
        if attribute(gather_nd, "batch_dims", 0) != 0:
            raise _NotThePattern("its GatherND has batch_dims")
        hidden = gather_nd.input[0]
        if facts.rank(hidden) != 3:
            raise _NotThePattern(f"the tensor it selects from, {hidden!r}, is not of rank 3")
        reshape = _only_consumer(facts, gather_nd.output[0], "Reshape", 0, "the selected states")
        _check_reshape_target(model, facts, reshape, hidden)
        gather = _only_consumer(facts, reshape.output[0], "Gather", 0, "the states per row")
        index = facts.constant(gather.input[1])
        if attribute(gather, "axis", 0) != 1 or index is None or index.shape != () or int(index) != -1:
            raise _NotThePattern(
                "it does not take the last selected state of each row (Gather axis 1, index -1)"
            )
    except _NotThePattern as reason:
        raise ValueError(
            f"NonZero node {nonzero.name!r} selects the positions of token {token_id} in {name!r}, but is "
            f"not the end-of-sentence selection of a classification head, which is computed densely: {reason}"
        ) from None
    mask = nonzero.input[0]
    return _Match(
        nonzero,
        mask,
        name,
        token_id,
        hidden,
        (nonzero, transpose, gather_nd, reshape, gather),
        gather.output[0],
    )


def _check_reshape_target(
    model: onnx.ModelProto, facts: GraphView, reshape: onnx.NodeProto, hidden: str
) -> None:
    """The Reshape target must be ``[Shape(hidden)[0], -1, Shape(hidden)[-1]]``: shown by evaluating it,
    at sizes no constant can be mistaken for, from shape projections of ``hidden`` alone."""
    cone: list[onnx.NodeProto] = []

    def computed_from(name: str) -> list[str]:
        if facts.constant(name) is not None:
            return []
        node = facts.producer.get(name)
        if node is None or node.op_type not in _SHAPE_PROJECTIONS:
            raise _NotThePattern("its row shape is not computed from the selected tensor's shape alone")
        cone.append(node)
        if node.op_type != "Shape":
            return list(node.input)
        if node.input[0] != hidden:
            raise _NotThePattern("its row shape is computed from another tensor's shape")
        return []

    reach([reshape.input[1]], computed_from)
    cone.sort(key=lambda node: facts.position[id(node)])
    evaluator = Evaluator(model)
    values: dict[str, np.ndarray] = {}
    probe = np.broadcast_to(np.zeros((), np.float32), _PROBE_SIZES)  # shaped, holds no memory
    try:
        for node in cone:
            inputs = []
            for name in node.input:
                if not name:
                    inputs.append(None)
                elif name in values:
                    inputs.append(values[name])
                elif name == hidden:
                    inputs.append(probe)
                else:
                    inputs.append(facts.constant(name))
            values.update(zip(node.output, evaluator.run(node, inputs), strict=False))
        target = facts.constant(reshape.input[1])
        target = values[reshape.input[1]] if target is None else target
    except (EvaluationError, KeyError) as error:
        raise _NotThePattern(f"its row shape could not be evaluated ({error})") from None
    expected = [_PROBE_SIZES[0], -1, _PROBE_SIZES[2]]
    if [int(v) for v in np.asarray(target).reshape(-1)] != expected:
        raise _NotThePattern("its rows are not reshaped to [batch, -1, hidden] of the selected tensor")


def _symbolic_dims(model: onnx.ModelProto) -> dict[str, list[Any]] | None:
    """Every tensor's dimensions that onnxruntime's symbolic shape inference finds (the export's dimension
    names as symbols), or None when it cannot run. onnx's own inference loses the sequence axis of a
    decoder fed ``shift_tokens_right(input_ids)``; the symbolic one keeps it.

    Its steps are driven here rather than through ``SymbolicShapeInference.infer_shapes``, which saves the
    model into the working directory whenever some tensor stays unknown; what it did find is all that is
    needed.
    """
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    try:
        inference = SymbolicShapeInference(2**31 - 1, False, False, 0)  # int_max, auto_merge, guess, verbose
        inference._preprocess(shape_view(model))
        while inference.run_:
            inference._infer_impl()
        known = dict(inference.known_vi_)
    except Exception as error:  # it raises plain Exceptions on graphs it cannot follow
        _logger.info("symbolic shape inference failed: %s", error)
        return None
    dims: dict[str, list[Any]] = {}
    for name, value in known.items():
        shape = value.type.tensor_type.shape
        dims[name] = [
            d.dim_param if d.HasField("dim_param") else d.dim_value if d.HasField("dim_value") else None
            for d in shape.dim
        ]
    return dims


def _check_hidden_axes(facts: GraphView, symbolic: dict[str, list[Any]] | None, match: _Match) -> None:
    """The selected tensor's first two axes are the input's, as shape inference derives them: the one-hot
    MatMul would otherwise broadcast a batch of one where the gather fails."""
    wanted = symbolic.get(match.input) if symbolic is not None else None
    found = symbolic.get(match.hidden) if symbolic is not None else None
    if (
        not wanted
        or not found
        or len(found) != 3
        or None in wanted
        or found[:2] != wanted[:2]
        or "" in wanted
    ):
        raise ValueError(
            f"NonZero node {match.nonzero.name!r} selects the positions of token {match.token_id} in "
            f"{match.input!r}, but shape inference does not show that the tensor it selects from, "
            f"{match.hidden!r} ({found}), has the batch and sequence axes of {match.input!r} ({wanted}), so "
            "it cannot be computed densely"
        )


def _same_sizes(model: onnx.ModelProto, name: str) -> tuple[tuple[str, int, int], ...]:
    """Other inputs' axes that declare the same dimension name as an axis of input ``name``."""
    initializers = {init.name for init in model.graph.initializer}
    declared = {
        value.name: [d.dim_param for d in value.type.tensor_type.shape.dim]
        for value in model.graph.input
        if value.name not in initializers
    }
    own = declared[name]
    found = []
    for other, dims in declared.items():
        if other == name:
            continue
        for axis, dim in enumerate(dims):
            for own_axis, own_dim in enumerate(own):
                if dim and dim == own_dim:
                    found.append((other, axis, own_axis))
    return tuple(found)


# ----------------------------------------------------------------------------------------------------
# The dense form
# ----------------------------------------------------------------------------------------------------


def _dense_selection(match: _Match, hidden_type: int | None, names: NameAllocator) -> list[onnx.NodeProto]:
    """Nodes computing ``match.output`` as ``MatMul(one-hot of each row's last match, hidden)``."""
    hint = match.nonzero.name or "NonZero"

    def fresh(suffix: str) -> str:
        return names.fresh(f"{hint}/dense_{suffix}")

    def constant(value: np.ndarray, suffix: str) -> tuple[onnx.NodeProto, str]:
        return names.constant_node(value, f"{hint}/dense_{suffix}")

    axis_node, axis = constant(np.array(1, np.int64), "sequence_axis")
    axes_node, axes = constant(np.array([1], np.int64), "row_axes")
    zero_node, zero = constant(np.array(0, np.int32), "zero")
    counts, later, none_later, last, weights, row, picked = (
        fresh(s)
        for s in ("mask_counts", "matches_after", "none_after", "last", "weights", "weights_row", "picked")
    )
    return [
        axis_node,
        axes_node,
        zero_node,
        helper.make_node("Cast", [match.mask], [counts], name=fresh("count"), to=TensorProto.INT32),
        # How many matches lie strictly after each position: 0 at the last match and after it.
        helper.make_node("CumSum", [counts, axis], [later], name=fresh("after"), exclusive=1, reverse=1),
        helper.make_node("Equal", [later, zero], [none_later], name=fresh("none_after")),
        helper.make_node("And", [match.mask, none_later], [last], name=fresh("is_last")),
        helper.make_node(
            "Cast", [last], [weights], name=fresh("one_hot"), to=hidden_type or TensorProto.FLOAT
        ),
        helper.make_node("Unsqueeze", [weights, axes], [row], name=fresh("as_row")),
        helper.make_node("MatMul", [row, match.hidden], [picked], name=fresh("pick")),
        helper.make_node("Squeeze", [picked, axes], [match.output], name=fresh("features")),
    ]


def _without_dead_nodes(
    nodes: list[onnx.NodeProto], removed: list[onnx.NodeProto], graph_outputs: set[str]
) -> list[onnx.NodeProto]:
    """``nodes`` less those that fed only the ``removed`` ones (the selection's shape arithmetic, its
    index constants), transitively; nodes that were unused before are none of this rewrite's business."""
    producer = {output: node for node in nodes for output in node.output if output}
    readers: dict[str, int] = {}
    for node in nodes:
        for name in node_reads(node):
            readers[name] = readers.get(name, 0) + 1
    dead: set[int] = set()
    pending = [name for node in removed for name in node.input if name]
    while pending:
        name = pending.pop()
        node = producer.get(name)
        if node is None or id(node) in dead:
            continue
        if any(readers.get(out, 0) or out in graph_outputs for out in node.output if out):
            continue
        dead.add(id(node))
        for read in node_reads(node):
            readers[read] -= 1
            pending.append(read)
    return [node for node in nodes if id(node) not in dead]
