"""Make a seq2seq decoder-with-past exact on a zero-padded key/value cache, so past lengths can be bucketed.

An IPU runs executables of fixed shapes, so the runtime serves ``generate()`` from a few compiled past
lengths by padding the cache. GPT-2's export takes an ``attention_mask`` over past + current positions and
needs nothing. optimum's seq2seq ``decoder_with_past_model.onnx`` (T5, BART, Whisper, ...) takes no
self-attention mask, so a zero-padded past key still gets softmax weight, and BART and Whisper index their
learned position embedding with the past length (the shape of the past tensors).

:func:`add_past_padding_mask` works on the exported graph (opset 18, dynamic axes), before legalization. It
adds one input, ``ipu_past_mask`` ``[batch, past_len]`` (int64, 1 = real, 0 = padding), for a past padded on
the LEFT (zeros first, real positions last), and makes two changes:

* every self-attention Softmax over the past keys gets ``Where(keep, scores, lowest)`` as its input, with
  ``keep = [mask, 1 for each current token]``, so padded keys get weight exactly 0;
* every learned position embedding looked up with the cache position (``Range(past_len, past_len + seq)``
  through index-preserving ops) gets its indices shifted down by the number of padded positions.

Left padding keeps relative positions exact: with real keys at ``P - L .. P - 1`` and the query at ``P``,
key minus query positions are ``-L .. 0`` exactly as without padding, so T5's relative attention bias and
every causal mask computed from the cache position need no change. The embedding shift is one scalar for
the whole batch, the largest real length of any row: generation steps a rectangular cache, so every row
has the same real past length.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

from optimum_ipu_backend.compiler.graphs import GraphView, NodeSplice, attribute, reach

MASK_INPUT = "ipu_past_mask"
PADDING_SIDE = "left"

_PAST_SELF_ATTENTION = re.compile(r"^past_key_values\.(\d+)\.decoder\.(key|value)$")
# Names of learned absolute position tables; only a safety net against position lookups this pass
# does not recognise, never used to decide what to rewrite.
_POSITION_TABLE = re.compile(r"position|wpe", re.IGNORECASE)

_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Where"})
_SAME_LAYOUT = frozenset({"Cast", "Identity"})
# Ops that carry a position index unchanged but for broadcasting, so a shifted input shifts the output.
_INDEX_PRESERVING = frozenset({"Unsqueeze", "Squeeze", "Reshape", "Expand", "Tile", "Cast", "Identity"})
_SHIFTABLE_INDEX_TYPES = frozenset({TensorProto.INT64, TensorProto.INT32})


@dataclass(frozen=True)
class PastPaddingRewrite:
    """A decoder that accepts a left-padded past plus :attr:`mask_input`, and what was changed in it."""

    model: onnx.ModelProto
    #: Graph input ``[batch, past_dim]``, int64: 1 for a real past position, 0 for padding.
    mask_input: str
    #: The ``dim_param`` of the past key/value sequence axis, e.g. ``"past_decoder_sequence_length"``.
    past_dim: str
    #: Where the padding goes in the past tensors: always ``"left"`` (zeros first, real positions last).
    padding_side: str = PADDING_SIDE
    #: Names of the self-attention Softmax nodes whose input is now masked.
    masked_softmaxes: tuple[str, ...] = field(default=())
    #: Names of the position-embedding Gather nodes whose indices now count real past positions only.
    shifted_position_lookups: tuple[str, ...] = field(default=())


def add_past_padding_mask(model: onnx.ModelProto) -> PastPaddingRewrite | None:
    """Return a copy of ``model`` made exact on a left-padded past, or None when it needs no change.

    None means the graph has no past self-attention inputs (``past_key_values.N.decoder.key/value``), or
    already has an input over the past positions (GPT-2's ``attention_mask`` of ``past + current``).
    Raises ValueError naming the pattern it could not find; it never returns a graph it cannot vouch for.
    ``model`` itself is not modified.
    """
    graph = model.graph
    past_inputs = _past_self_attention_inputs(graph)
    if not past_inputs:
        return None
    batch_dim, past_dim = _past_dims(past_inputs)
    if _has_mask_over_past(graph, past_dim):
        return None

    facts = GraphView.of_model(model)
    keys = [vi.name for vi in past_inputs if vi.name.endswith(".key")]
    masked = [_find_masked_softmax(facts, key) for key in keys]
    if len({id(site.softmax) for site in masked}) != len(masked):
        raise ValueError(f"two past keys lead to the same Softmax: {[site.softmax.name for site in masked]}")
    lookups = _find_position_lookups(facts, {vi.name for vi in past_inputs})

    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    _Rewriter(rewritten, facts, batch_dim, past_dim).apply(masked, lookups)
    return PastPaddingRewrite(
        model=rewritten,
        mask_input=MASK_INPUT,
        past_dim=past_dim,
        masked_softmaxes=tuple(site.softmax.name for site in masked),
        shifted_position_lookups=tuple(node.name for node in lookups),
    )


# ----------------------------------------------------------------------------------------------------
# What the graph is: inputs, types, producers and consumers
# ----------------------------------------------------------------------------------------------------


def _past_self_attention_inputs(graph: onnx.GraphProto) -> list[onnx.ValueInfoProto]:
    return [vi for vi in graph.input if _PAST_SELF_ATTENTION.match(vi.name)]


def _dim_param(value_info: onnx.ValueInfoProto, axis: int) -> str:
    dims = value_info.type.tensor_type.shape.dim
    if len(dims) != 4:
        raise ValueError(
            f"{value_info.name} has rank {len(dims)}; expected [batch, heads, past_len, head_dim]"
        )
    dim = dims[axis]
    if not dim.dim_param:
        raise ValueError(
            f"axis {axis} of {value_info.name} is not a named dynamic axis ({dim}); export the decoder with "
            "dynamic axes so its past length can be padded"
        )
    return dim.dim_param


def _past_dims(past_inputs: list[onnx.ValueInfoProto]) -> tuple[str, str]:
    batch_dims = {_dim_param(vi, 0) for vi in past_inputs}
    past_dims = {_dim_param(vi, 2) for vi in past_inputs}
    if len(batch_dims) != 1 or len(past_dims) != 1:
        raise ValueError(
            f"the past self-attention inputs disagree on their batch / past axes: {sorted(batch_dims)}, "
            f"{sorted(past_dims)}"
        )
    return batch_dims.pop(), past_dims.pop()


def _has_mask_over_past(graph: onnx.GraphProto, past_dim: str) -> bool:
    """Whether some non-cache input of rank 2 spans the past positions (its last axis names past_dim)."""
    mentions_past = re.compile(rf"(?<![\w.]){re.escape(past_dim)}(?![\w.])")
    for vi in graph.input:
        if vi.name.startswith("past_key_values"):
            continue
        dims = vi.type.tensor_type.shape.dim
        if len(dims) == 2 and mentions_past.search(dims[1].dim_param or ""):
            return True
    return False


# ----------------------------------------------------------------------------------------------------
# Finding the self-attention Softmax over each past key
# ----------------------------------------------------------------------------------------------------


@dataclass
class _MaskSite:
    """A Softmax to mask, and the current keys joined to the past on its path (their length is needed)."""

    softmax: onnx.NodeProto
    new_key: str  # the Concat input holding the current positions' keys
    key_axis: int  # the key-position axis of the new key (and of the Concat output)


@dataclass(frozen=True)
class _Tracked:
    """A tensor on the path from a past key, with where its batch and key-position axes are."""

    name: str
    batch_axis: int
    key_axis: int


def _find_masked_softmax(facts: GraphView, past_key: str) -> _MaskSite:
    """Walk the values computed from ``past_key`` to the one Softmax that normalizes over its positions.

    Every op on the way must be one whose effect on the batch and key-position axes is known, so the
    Softmax is proven to run over the key positions with the batch first; Shape and Size read no values
    and end a path. Anything else on the path is reported, never guessed at.
    """
    if not facts.consumers.get(past_key):
        in_subgraph = past_key in facts.subgraph_reads
        where = " (it is read inside an If/Loop subgraph: a merged decoder)" if in_subgraph else ""
        raise ValueError(
            f"{past_key} feeds no node of the main graph{where}; add_past_padding_mask needs the "
            "unmerged decoder_with_past_model.onnx"
        )
    rank = facts.rank(past_key) or 4
    queue = deque([_Tracked(past_key, 0, rank - 2)])
    seen: set[str] = {past_key}
    softmaxes: list[tuple[onnx.NodeProto, _Tracked]] = []
    concats: list[tuple[onnx.NodeProto, str, int]] = []
    while queue:
        tracked = queue.popleft()
        for node, index in facts.consumers.get(tracked.name, []):
            if node.op_type in ("Shape", "Size"):
                continue
            if node.op_type == "Softmax":
                softmaxes.append((node, tracked))
                continue
            if node.op_type == "Concat":
                concats.append(_key_concat(facts, node, index, tracked, past_key))
            output = _track_through(facts, node, index, tracked, past_key)
            if output.name not in seen:
                seen.add(output.name)
                queue.append(output)
    if len(softmaxes) != 1:
        found = [node.name for node, _ in softmaxes] or "none"
        raise ValueError(
            f"expected exactly one self-attention Softmax computed from {past_key}, found {found}"
        )
    if len(concats) != 1:
        raise ValueError(
            f"expected {past_key} to be concatenated with the current keys exactly once before its Softmax, "
            f"found {len(concats)} Concat nodes"
        )
    softmax, scores = softmaxes[0]
    _check_softmax(facts, softmax, scores, past_key)
    _, new_key, key_axis = concats[0]
    return _MaskSite(softmax=softmax, new_key=new_key, key_axis=key_axis)


def _key_concat(
    facts: GraphView, node: onnx.NodeProto, index: int, tracked: _Tracked, past_key: str
) -> tuple[onnx.NodeProto, str, int]:
    rank = facts.rank(tracked.name)
    axis = attribute(node, "axis")
    if rank is not None:
        axis %= rank
    if axis != tracked.key_axis or index != 0 or len(node.input) != 2:
        raise ValueError(
            f"Concat {node.name!r} joins {past_key} along axis {axis} at input {index} of {len(node.input)}; "
            f"expected [past, current] along the key-position axis {tracked.key_axis}"
        )
    return node, node.input[1], axis


def _track_through(
    facts: GraphView, node: onnx.NodeProto, index: int, tracked: _Tracked, past_key: str
) -> _Tracked:
    """Where the batch and key-position axes of ``node``'s input ``index`` end up in its output."""

    def unsupported(reason: str) -> ValueError:
        return ValueError(
            f"{node.op_type} node {node.name!r} on the path from {past_key} to its attention Softmax "
            f"{reason}; add_past_padding_mask cannot prove where the key positions go"
        )

    in_rank = facts.rank(tracked.name)
    out_rank = facts.rank(node.output[0])
    if in_rank is None or out_rank is None:
        raise unsupported("has an input or output of unknown rank")
    axes = (tracked.batch_axis, tracked.key_axis)
    if node.op_type in _SAME_LAYOUT or node.op_type == "Concat":
        moved = axes
    elif node.op_type in _ELEMENTWISE:
        moved = tuple(axis + out_rank - in_rank for axis in axes)
    elif node.op_type == "Transpose":
        perm = list(attribute(node, "perm", range(in_rank - 1, -1, -1)))
        moved = tuple(perm.index(axis) for axis in axes)
    elif node.op_type == "MatMul":
        if in_rank < 2 or in_rank != out_rank:
            raise unsupported(f"multiplies rank {in_rank} into rank {out_rank}")
        contracted = in_rank - 1 if index == 0 else in_rank - 2
        if contracted in axes:
            raise unsupported("contracts the batch or key-position axis")
        moved = axes
    else:
        raise unsupported("is not an op whose axes this pass follows")
    return _Tracked(node.output[0], moved[0], moved[1])


def _check_softmax(facts: GraphView, softmax: onnx.NodeProto, scores: _Tracked, past_key: str) -> None:
    rank = facts.rank(scores.name)
    axis = attribute(softmax, "axis", -1)
    if rank is None:
        raise ValueError(f"the rank of Softmax {softmax.name!r}'s input is unknown")
    if axis % rank != scores.key_axis or scores.key_axis != rank - 1 or scores.batch_axis != 0:
        raise ValueError(
            f"Softmax {softmax.name!r} over {past_key}'s scores runs over axis {axis % rank} of rank {rank} "
            f"with the keys on axis {scores.key_axis} and the batch on axis {scores.batch_axis}; expected "
            "the keys last and the batch first"
        )
    if facts.elem_type(scores.name) not in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE):
        raise ValueError(
            f"Softmax {softmax.name!r} has input type {facts.elem_type(scores.name)}; expected a float type"
        )


# ----------------------------------------------------------------------------------------------------
# Finding the learned position embeddings indexed by the past length
# ----------------------------------------------------------------------------------------------------


def _find_position_lookups(facts: GraphView, past_inputs: set[str]) -> list[onnx.NodeProto]:
    """The Gathers that read a constant table at ``Range(past_len, ...)`` through index-preserving ops.

    Shapes of the cache flow elsewhere too (causal masks, T5's relative positions): those stay as they
    are, because left padding keeps every key-minus-query difference of a real position exact.
    """
    past_lengths = _past_length_scalars(facts, past_inputs)
    lookups: list[onnx.NodeProto] = []
    seen_nodes: set[str] = set()
    for range_node in _ranges_starting_at(facts, past_lengths):
        queue = deque([range_node.output[0]])
        visited = {range_node.output[0]}
        while queue:
            name = queue.popleft()
            for node, index in facts.consumers.get(name, []):
                if node.op_type == "Gather" and index == 1 and facts.is_constant(node.input[0]):
                    if node.output[0] not in seen_nodes:
                        seen_nodes.add(node.output[0])
                        lookups.append(node)
                    continue
                if not _preserves_index(facts, node, index):
                    continue
                if node.output[0] not in visited:
                    visited.add(node.output[0])
                    queue.append(node.output[0])
    for node in lookups:
        if facts.elem_type(node.input[1]) not in _SHIFTABLE_INDEX_TYPES:
            raise ValueError(
                f"position lookup {node.name!r} has indices of type {facts.elem_type(node.input[1])}"
            )
    _refuse_unrecognised_position_tables(facts, past_lengths, {node.output[0] for node in lookups})
    return lookups


def _preserves_index(facts: GraphView, node: onnx.NodeProto, index: int) -> bool:
    if node.op_type in _INDEX_PRESERVING:
        return index == 0  # the other inputs are axes / shapes / repeats
    if node.op_type == "Add":
        return facts.is_constant(node.input[1 - index])
    if node.op_type == "Sub":
        return index == 0 and facts.is_constant(node.input[1])
    return False


def _past_length_scalars(facts: GraphView, past_inputs: set[str]) -> set[str]:
    """Tensors holding the past length: ``Gather(Shape(past), 2)`` or ``Shape(past, start=2, end=3)``."""
    lengths: set[str] = set()
    for past in past_inputs:
        rank = facts.rank(past) or 4
        for shape_node, _ in facts.consumers.get(past, []):
            if shape_node.op_type != "Shape":
                continue
            start = attribute(shape_node, "start", 0) % rank
            end = attribute(shape_node, "end", rank)
            end = end % rank if end < 0 else min(end, rank)
            if (start, end) == (2, 3):
                lengths.add(shape_node.output[0])
                continue
            for gather, index in facts.consumers.get(shape_node.output[0], []):
                if gather.op_type != "Gather" or index != 0:
                    continue
                position = facts.constant(gather.input[1])
                if position is None or position.size != 1:
                    continue
                index_in_shape = int(position.reshape(()))
                if index_in_shape < 0:
                    index_in_shape += end - start
                if start + index_in_shape == 2:
                    lengths.add(gather.output[0])
    return lengths


def _ranges_starting_at(facts: GraphView, past_lengths: set[str]) -> Iterator[onnx.NodeProto]:
    for node in facts.nodes:
        if node.op_type != "Range":
            continue
        start = node.input[0]
        while start not in past_lengths:
            producer = facts.producer.get(start)
            if producer is None or producer.op_type not in ("Cast", "Identity", "Squeeze", "Reshape"):
                break
            start = producer.input[0]
        if start in past_lengths:
            yield node


def _refuse_unrecognised_position_tables(facts: GraphView, past_lengths: set[str], shifted: set[str]) -> None:
    """Fail on a position table indexed from the past length in a way this pass does not rewrite."""
    dependent = _dependents(facts, past_lengths)
    for node in facts.nodes:
        if node.op_type not in ("Gather", "Slice") or node.output[0] in shifted:
            continue
        table = node.input[0]
        if table in facts.initializers and _POSITION_TABLE.search(table) and dependent & set(node.input[1:]):
            raise ValueError(
                f"{node.op_type} {node.name!r} reads the position table {table!r} at indices computed from "
                "the past length in a form add_past_padding_mask does not recognise (expected Gather at "
                "Range(past_len, ...) through Unsqueeze/Expand/Tile/Reshape/Cast or a constant offset)"
            )


def _dependents(facts: GraphView, sources: Iterable[str]) -> set[str]:
    return reach(
        sources, lambda name: [output for node, _ in facts.consumers.get(name, []) for output in node.output]
    )


# ----------------------------------------------------------------------------------------------------
# The rewrite
# ----------------------------------------------------------------------------------------------------


class _Rewriter(NodeSplice):
    """Adds the mask input and the nodes that use it to ``model`` (a copy owned by the caller)."""

    def __init__(self, model: onnx.ModelProto, facts: GraphView, batch_dim: str, past_dim: str) -> None:
        super().__init__(model, "/ipu_past_mask/")
        self.facts = facts
        self.batch_dim = batch_dim
        self.past_dim = past_dim

    def apply(self, sites: list[_MaskSite], lookups: list[onnx.NodeProto]) -> None:
        self.graph.input.append(
            helper.make_tensor_value_info(MASK_INPUT, TensorProto.INT64, [self.batch_dim, self.past_dim])
        )
        if sites:
            self._mask_softmaxes(sites)
        if lookups:
            self._shift_lookups(lookups)
        self.splice()

    def _mask_softmaxes(self, sites: list[_MaskSite]) -> None:
        position = self.facts.position
        # The keep mask is built once, just before the first masked Softmax: by then the first layer's
        # current keys (whose length it takes) exist.
        first = min(position[id(site.softmax)] for site in sites)
        site = next(s for s in sites if position[id(s.softmax)] == first)
        front = self.before[first]
        past_keep = self.node(front, "Cast", [MASK_INPUT], "past_keep", to=TensorProto.BOOL)
        mask_shape = self.node(front, "Shape", [MASK_INPUT], "mask_shape")
        batch = self.node(
            front, "Gather", [mask_shape, self.constant(np.array([0], np.int64), "axis0")], "batch", axis=0
        )
        new_key_shape = self.node(front, "Shape", [site.new_key], "current_key_shape")
        current = self.node(
            front,
            "Gather",
            [new_key_shape, self.constant(np.array([site.key_axis], np.int64), "key_axis")],
            "current_length",
            axis=0,
        )
        current_shape = self.node(front, "Concat", [batch, current], "current_keep_shape", axis=0)
        current_keep = self.node(
            front,
            "ConstantOfShape",
            [current_shape],
            "current_keep",
            value=helper.make_tensor("true", TensorProto.BOOL, [1], [True]),
        )
        keep = self.node(front, "Concat", [past_keep, current_keep], "keep", axis=1)
        by_rank: dict[int, str] = {}
        for site in sites:
            index = position[id(site.softmax)]
            scores = site.softmax.input[0]
            rank = self.facts.rank(scores)
            assert rank is not None  # _check_softmax proved it
            if rank not in by_rank:
                axes = self.constant(np.arange(1, rank - 1, dtype=np.int64), "broadcast_axes")
                by_rank[rank] = self.node(front, "Unsqueeze", [keep, axes], "keep_broadcast")
            dtype = helper.tensor_dtype_to_np_dtype(self.facts.elem_type(scores))
            # The lowest finite value, as HF's own masks use: exp() of it relative to any real score is
            # exactly 0, and the fp16 pass clamps it to -65504, still far below any real score.
            lowest = self.constant(np.array(np.finfo(dtype).min, dtype), "lowest")
            masked = self.node(self.before[index], "Where", [by_rank[rank], scores, lowest], "masked_scores")
            self.renamed_input[(index, 0)] = masked

    def _shift_lookups(self, lookups: list[onnx.NodeProto]) -> None:
        position = self.facts.position
        first = min(position[id(node)] for node in lookups)
        front = self.before[first]
        real_per_row = self.node(
            front,
            "ReduceSum",
            [MASK_INPUT, self.constant(np.array([1], np.int64), "past_axis")],
            "real_past_per_row",
            keepdims=0,
        )
        # One shift for the batch: generation keeps every row's real past length equal.
        real = self.node(front, "ReduceMax", [real_per_row], "real_past_length", keepdims=0)
        padded = self.node(
            front,
            "Gather",
            [
                self.node(front, "Shape", [MASK_INPUT], "padded_shape"),
                self.constant(np.array(1, np.int64), "axis1"),
            ],
            "padded_past_length",
            axis=0,
        )
        padding = self.node(front, "Sub", [padded, real], "padding_length")
        for node in lookups:
            index = position[id(node)]
            indices = node.input[1]
            shift = padding
            if self.facts.elem_type(indices) != TensorProto.INT64:
                shift = self.node(
                    self.before[index],
                    "Cast",
                    [padding],
                    "padding_length_cast",
                    to=self.facts.elem_type(indices),
                )
            self.renamed_input[(index, 1)] = self.node(
                self.before[index], "Sub", [indices, shift], "real_positions"
            )
