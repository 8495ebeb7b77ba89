"""Mixture-of-experts layers computed densely, so that their shapes no longer depend on the routing.

optimum exports a top-k mixture of experts (Mixtral, Qwen-MoE, ...) as one selection per expert: a
``NonZero`` over that expert's one-hot routing mask ``[top_k, tokens]`` yields the (slot, token) pairs
routed to it (DeepSeek-V3's layer, and those written like it, take the mask as ``[tokens, top_k]`` and
get (token, slot) pairs: the same selection with its axes swapped); the expert runs on just those
tokens, its outputs are weighted by the router's weight of each pair (gathered at
``token * top_k + slot``) and scattered back into a zero tensor. How many tokens an expert gets is known
only at run time, which no static-shape device can compile.

``densify_experts`` replaces each such ``NonZero`` with one (slot, token) pair for *every* token, in the
order of the mask's axes: the
slot is where the token's mask holds 1 (a token selects an expert at most once), and the router weight
of the pair is multiplied by whether the token was routed there at all (1 or 0). The expert then runs
on every token, tokens not routed to it contribute exactly ``expert(x) * 0 = 0``, and every shape is
static. The result equals the sparse computation (the same products, summed in the same order, plus
exact zeros), at the cost of running every expert on every token: ``num_experts / top_k`` times the
expert compute of the routed model. A selection that does not follow this pattern is reported with the
layer it belongs to, never guessed at.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from optimum_ipu_backend.compiler.graphs import GraphView, NameAllocator, attribute
from optimum_ipu_backend.compiler.op_table import default_opset

_SELECTIONS = frozenset({"NonZero", "Compress", "Unique"})
# Constants up to this size are read (an expert count, a k); anything larger is no such count.
_SMALL = 16
_REDUCE_AXES_INPUT_SINCE = 18


@dataclass(frozen=True)
class DataDependentSelection:
    """A node that selects elements at run time, with where it sits in the exported model."""

    node: str
    op_type: str
    layer: str  # the node's name path without its last part, e.g. "/model/layers.0/mlp"

    @property
    def reason(self) -> str:
        return (
            f"{self.op_type} node {self.node!r} in layer {self.layer!r} selects elements at run time from "
            "values computed from the inputs, so the shapes after it are known only while the model runs, "
            "and an IPU executable has fixed shapes"
        )


@dataclass
class DenseExperts:
    """The rewritten graph, and what the rewrite costs."""

    model: onnx.ModelProto
    layers: list[str] = field(default_factory=list)
    num_experts: int | None = None
    top_k: int | None = None

    @property
    def cost(self) -> str:
        experts = self.num_experts if self.num_experts is not None else "all"
        factor = (
            f"{self.num_experts / self.top_k:g}x the expert compute of top-{self.top_k} routing"
            if self.num_experts and self.top_k
            else "more expert compute than the routed model"
        )
        return (
            f"mixture of experts in {', '.join(self.layers)} computed densely: {experts} experts run on "
            f"every token ({factor}) so that every shape is static; results are the routed model's"
        )


def data_dependent_selections(model: onnx.ModelProto) -> list[DataDependentSelection]:
    """Nodes of the main graph whose output shape depends on the values of the graph's inputs."""
    graph = model.graph
    initializers = {init.name for init in graph.initializer}
    data = {vi.name for vi in graph.input if vi.name not in initializers}
    found = []
    for node in graph.node:
        if node.op_type == "Shape" or not any(name in data for name in node.input):
            continue
        data.update(output for output in node.output if output)
        if node.op_type in _SELECTIONS:
            layer = node.name.rsplit("/", 1)[0] or node.name
            found.append(DataDependentSelection(node.name, node.op_type, layer))
    return found


def densify_experts(model: onnx.ModelProto) -> DenseExperts | None:
    """A copy of ``model`` with every top-k expert selection made dense; None when it has no selection.

    Raises ValueError saying which node and layer select at run time when one is not of that pattern.
    """
    selections = data_dependent_selections(model)
    if not selections:
        return None
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    graph = rewritten.graph
    view = GraphView.of_model(rewritten)
    nodes = view.nodes
    names = NameAllocator.for_model(rewritten)
    result = DenseExperts(rewritten)
    # ReduceMax takes its axes as an input from opset 18, as an attribute before
    reduce_axes_as_input = (default_opset(rewritten) or 0) >= _REDUCE_AXES_INPUT_SINCE
    replace: dict[int, list[onnx.NodeProto]] = {}  # node index -> nodes that take its place
    after: dict[int, list[onnx.NodeProto]] = defaultdict(list)  # node index -> nodes right after it
    position = {node.output[0]: index for index, node in enumerate(nodes)}
    for selection in selections:
        index = next(
            i for i, n in enumerate(nodes) if n.name == selection.node and n.op_type == selection.op_type
        )
        node = nodes[index]
        match = _match_expert_selection(node, view)
        if isinstance(match, str):
            raise ValueError(
                f"{selection.reason}. It is not the top-k mixture-of-experts selection that can be computed "
                f"densely ({match}), nor the end-of-sentence selection of a classification head (a NonZero "
                "over input tokens equal to a constant id); export the model with static routing or serve it "
                "on another provider"
            )
        weight_gather, experts, top_k, token_axis = match
        result.num_experts = experts if experts is not None else result.num_experts
        result.top_k = top_k if top_k is not None else result.top_k
        if selection.layer not in result.layers:
            result.layers.append(selection.layer)
        dense_nodes, routed = _dense_pairs(node, names, token_axis, reduce_axes_as_input)
        replace[index] = dense_nodes
        # The gathered router weight of each pair, times whether the token was routed here at all.
        sparse = names.fresh(f"{weight_gather.output[0]}/before_routing_mask")
        weight_index = position[weight_gather.output[0]]
        kept = weight_gather.output[0]
        nodes[weight_index].output[0] = sparse
        routed_as_weight = names.fresh(f"{node.name}/routed_as_weight")
        # The gathered weights are [tokens, *rest of the table's axes]: the 0/1 factor gets those axes too.
        # The view infers types once, at the first call: the router tables lie upstream of every edit.
        trailing = _rank(view, weight_gather.input[0]) - 1
        routed_column = routed
        column = []
        if trailing:
            axes = names.fresh(f"{node.name}/trailing_axes")
            routed_column = names.fresh(f"{node.name}/routed_column")
            column = [
                helper.make_node(
                    "Constant",
                    [],
                    [axes],
                    name=names.fresh(f"{node.name}/trailing_axes_node"),
                    value=numpy_helper.from_array(np.arange(1, trailing + 1, dtype=np.int64), axes),
                ),
                helper.make_node(
                    "Unsqueeze", [routed, axes], [routed_column], name=names.fresh(f"{node.name}/column")
                ),
            ]
        after[weight_index].extend(
            [
                *column,
                _cast_like_weights(
                    routed_column,
                    sparse,
                    view.elem_type(weight_gather.input[0]),
                    routed_as_weight,
                    names.fresh(f"{node.name}/cast"),
                ),
                helper.make_node(
                    "Mul",
                    [sparse, routed_as_weight],
                    [kept],
                    name=names.fresh(f"{node.name}/weight_if_routed"),
                ),
            ]
        )
    rebuilt = []
    for index, node in enumerate(nodes):
        rebuilt.extend(replace.get(index, [node]))
        rebuilt.extend(after.get(index, []))
    del graph.node[:]
    graph.node.extend(rebuilt)
    return result


def _dense_pairs(
    nonzero: onnx.NodeProto, names: NameAllocator, token_axis: int, reduce_axes_as_input: bool
) -> tuple[list[onnx.NodeProto], str]:
    """Nodes computing, in place of ``NonZero(mask)`` over a ``[slots, tokens]`` mask (``token_axis`` 1),
    the pairs ``[argmax over slots, token]`` for every token (``[token, argmax over slots]`` for a
    ``[tokens, slots]`` mask, ``token_axis`` 0), and the name of a ``[tokens]`` 0/1 tensor saying whether
    the token's mask holds a 1 at all."""
    slot_axis = 1 - token_axis
    hint = nonzero.name or "NonZero"
    mask = nonzero.input[0]

    def fresh(suffix: str) -> str:
        return names.fresh(f"{hint}/dense_{suffix}")

    def constant(value: np.ndarray, suffix: str) -> tuple[onnx.NodeProto, str]:
        return names.constant_node(value, f"{hint}/dense_{suffix}")

    as_int = fresh("mask_int")
    slot = fresh("slot")
    slot_row = fresh("slot_row")
    shape = fresh("mask_shape")
    count = fresh("token_count")
    tokens = fresh("tokens")
    tokens_row = fresh("tokens_row")
    routed = fresh("routed")
    one_node, one = constant(np.array(1, np.int64), "one")
    token_axis_node, token_axis_index = constant(np.array(token_axis, np.int64), "token_axis")
    slot_axis_node, slot_axis_list = constant(np.array([slot_axis], np.int64), "slot_axis")
    zero_node, zero = constant(np.array(0, np.int64), "zero")
    axis0_node, axis0 = constant(np.array([0], np.int64), "axis0")
    # the rows of NonZero's output follow the mask's axes
    rows = [slot_row, tokens_row] if token_axis == 1 else [tokens_row, slot_row]
    nodes = [
        one_node,
        zero_node,
        axis0_node,
        token_axis_node,
        slot_axis_node,
        helper.make_node("Cast", [mask], [as_int], name=fresh("cast"), to=TensorProto.INT32),
        helper.make_node("ArgMax", [as_int], [slot], name=fresh("argmax"), axis=slot_axis, keepdims=0),
        helper.make_node("Unsqueeze", [slot, axis0], [slot_row], name=fresh("slot_unsqueeze")),
        helper.make_node("Shape", [mask], [shape], name=fresh("shape")),
        helper.make_node("Gather", [shape, token_axis_index], [count], name=fresh("count"), axis=0),
        helper.make_node("Range", [zero, count, one], [tokens], name=fresh("range")),
        helper.make_node("Unsqueeze", [tokens, axis0], [tokens_row], name=fresh("unsqueeze")),
        helper.make_node("Concat", rows, [nonzero.output[0]], name=fresh("pairs"), axis=0),
        helper.make_node("ReduceMax", [as_int, slot_axis_list], [routed], name=fresh("routed"), keepdims=0)
        if reduce_axes_as_input
        else helper.make_node(
            "ReduceMax", [as_int], [routed], name=fresh("routed"), keepdims=0, axes=[slot_axis]
        ),
    ]
    return nodes, routed


def _match_expert_selection(
    nonzero: onnx.NodeProto,
    view: GraphView,
) -> tuple[onnx.NodeProto, int | None, int | None, int] | str:
    """The router-weight Gather of a top-k expert selection, with the number of experts, k and the mask's
    token axis; or why ``nonzero`` is not one."""
    producer = view.producer
    if nonzero.op_type != "NonZero":
        return f"{nonzero.op_type} is not a NonZero"
    mask = _through(producer, nonzero.input[0], ("Cast", "Identity"))
    gather = producer.get(mask)
    if gather is None or gather.op_type != "Gather" or attribute(gather, "axis", 0) != 0:
        return "its mask is not one expert's row of a routing table"
    table = _through(producer, gather.input[0], ("Cast", "Identity"))
    transpose = producer.get(table)
    # one_hot(selected) is [tokens, top_k, experts]; each expert's row of the table is its mask
    token_axes = {(2, 1, 0): 1, (2, 0, 1): 0}  # [experts, top_k, tokens] or [experts, tokens, top_k]
    perm = tuple(attribute(transpose, "perm", [])) if transpose is not None else ()
    if transpose is None or transpose.op_type != "Transpose" or perm not in token_axes:
        return (
            "its routing table is not the one-hot of the selected experts transposed to "
            "[experts, top_k, tokens] or [experts, tokens, top_k]"
        )
    token_axis = token_axes[perm]
    one_hot = producer.get(_through(producer, transpose.input[0], ("Cast", "Identity")))
    if one_hot is None or one_hot.op_type != "OneHot":
        return "its routing table is not a one-hot of the selected experts"
    depth = view.constant(one_hot.input[1], max_elements=_SMALL)
    experts = int(np.asarray(depth).reshape(-1)[0]) if depth is not None else None
    top_k_node = producer.get(one_hot.input[0])
    top_k = None
    k = None if top_k_node is None else view.constant(top_k_node.input[1], max_elements=_SMALL)
    if top_k_node is not None and top_k_node.op_type == "TopK" and k is not None:
        top_k = int(np.asarray(k).reshape(-1)[0])
    # NonZero -> Transpose -> Split -> (slot, token) or (token, slot), each perhaps squeezed.
    pairs = [c for c in _readers(view, nonzero.output[0]) if c.op_type == "Transpose"]
    splits = [c for p in pairs for c in _readers(view, p.output[0]) if c.op_type == "Split"]
    if len(splits) != 1 or len(splits[0].output) != 2:
        return "its (slot, token) pairs are not split into a slot and a token"
    slot = _squeezed(view, splits[0].output[1 - token_axis])
    token = _squeezed(view, splits[0].output[token_axis])
    for multiply in _readers(view, token):
        if multiply.op_type != "Mul":
            continue
        for add in _readers(view, multiply.output[0]):
            if add.op_type == "Add" and set(add.input) == {slot, multiply.output[0]}:
                for weight in _readers(view, add.output[0]):
                    if weight.op_type == "Gather" and weight.input[1] == add.output[0]:
                        return weight, experts, top_k, token_axis
    return "no router weight is gathered at token * top_k + slot"


def _cast_like_weights(
    routed: str, weights: str, weights_type: int | None, output: str, name: str
) -> onnx.NodeProto:
    """The 0/1 routed factor in the router weights' type: a Cast where the type is known (CastLike exists
    from opset 15 only), a CastLike otherwise."""
    if weights_type:
        return helper.make_node("Cast", [routed], [output], name=name, to=weights_type)
    return helper.make_node("CastLike", [routed, weights], [output], name=name)


def _rank(view: GraphView, name: str) -> int:
    """The rank of tensor ``name`` (Flatten outputs directly, anything else from the view)."""
    node = view.producer.get(name)
    if node is not None and node.op_type == "Flatten":
        return 2
    rank = view.rank(name)
    if rank is None:
        raise ValueError(f"the rank of the router weights {name!r} is unknown")
    return rank


def _readers(view: GraphView, name: str) -> list[onnx.NodeProto]:
    return [node for node, _ in view.consumers.get(name, ())]


def _squeezed(view: GraphView, name: str) -> str:
    squeezes = [c for c in _readers(view, name) if c.op_type == "Squeeze"]
    return squeezes[0].output[0] if len(squeezes) == 1 else name


def _through(producer: dict[str, onnx.NodeProto], name: str, op_types: tuple[str, ...]) -> str:
    while (node := producer.get(name)) is not None and node.op_type in op_types:
        name = node.input[0]
    return name
