"""Packing for encoders: several sequences share one row, as a graph rewrite applied only where proven.

Packing lays sequences out one after another in a row of ``L`` tokens. Segment ids mark which sequence each
token belongs to; attention becomes block-diagonal (a token attends to its own sequence only); positions
restart per sequence; pooled outputs (a [CLS] pooler, a classification head reading token 0) are gathered
at each sequence's first token. Graphcore's PackedBERT writes this into the model by hand; here it is a
rewrite of the exported ONNX, found by dataflow and evaluation (dimension names are labels, never facts):

1. Mask: the tensor that broadcasts the attention mask to ``[B, 1, 1, S]`` (found by evaluating the graph
   on a test mask) is replaced by the block mask ``seg[b, q] == seg[b, k]`` of shape ``[B, 1, S, S]``, in
   that tensor's dtype; what follows (Expand, Cast, Sub, Where ...) broadcasts unchanged.
2. Positions: an input-free tensor equal to ``arange(L) + c`` along its token axis (found by evaluation at
   two lengths), that reaches the values through something not translation-invariant (a position table),
   is replaced by ``POSITION_IDS + c``. A relative-position bias (MPNet's buckets of ``k - q``) is left as
   it is: the proof checks that it is translation-invariant, hence the same for every segment start.
3. A CumSum along the token axis becomes a segmented CumSum, exact in integers:
   ``CumSum(x)[t] - CumSum(x, exclusive)[t - POSITION_IDS[t]]``; RoBERTa's positions (a CumSum of
   ``input_ids != pad``) stay exact with pad tokens inside a sequence.
4. Pooled reads: ``Gather(x, i, axis=token)`` with a constant ``i >= 0`` becomes a gather at
   ``SEGMENT_STARTS + i``, so ``[B, ...]`` becomes ``[B, K, ...]``; a Gemm after it becomes MatMul + Add.

The result is then proven (``compiler.analysis.segments``): every output element of a real segment must
equal the unpacked computation of that segment. Anything the rewrite does not cover, or the proof cannot
follow, is refused with a ``PackingRefused`` naming the node that stops it.

The runtime lays rows out fully: a token that belongs to no sequence has segment id 0, the pad token id
and position 0.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from optimum_ipu_backend.compiler.analysis.segments import (
    BLOCK_MASK,
    POOLED_GATHER,
    REWRITE_PREFIX,
    SEGMENTED_CUMSUM,
    Axes,
    PackingRefused,
    SegmentProof,
    constants_of,
    follow,
    input_dependencies,
    prove_segments,
    run_all,
    translation_invariant,
)
from optimum_ipu_backend.compiler.external_data import is_external, read_weight
from optimum_ipu_backend.compiler.graphs import attribute, infer_shapes

PACKING_FORMAT = 1  # raise when the packed graph can differ
SEGMENT_IDS = "ipu_segment_ids"  # [rows, tokens] int64: 0 = empty slot, 1..K = k-th sequence in the row
POSITION_IDS = "ipu_position_ids"  # [rows, tokens] int64: the token's position inside its sequence
SEGMENT_STARTS = "ipu_segment_starts"  # [rows, segments] int64: each segment's first token; unused slots 0
ROWS_DIM, TOKENS_DIM, SEGMENTS_DIM = "batch_size", "sequence_length", "ipu_segments"

# The roles the proof gives the packing inputs.
_ROLES = {SEGMENT_IDS: "segment_ids", POSITION_IDS: "position_ids", SEGMENT_STARTS: "segment_starts"}
# (rows, tokens) of the two evaluations of the export that find the mask broadcast and the positions.
_DISCOVERY_SIZES = ((3, 7), (5, 11))
_FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)


@dataclass(frozen=True)
class PackedEncoder:
    """A packed encoder and how its inputs and outputs are laid out."""

    model: onnx.ModelProto  # dynamic dims ROWS_DIM/TOKENS_DIM/SEGMENTS_DIM; same opset as the input
    mask_input: str  # the export's attention mask, which the packed graph no longer takes
    token_inputs: tuple[str, ...]  # export inputs kept as [rows, tokens] (input_ids, token_type_ids, ...)
    token_outputs: dict[str, int]  # output -> its token axis (axis 0 = rows); e.g. last_hidden_state: 1
    pooled_outputs: dict[str, int]  # output -> its segment axis (axis 0 = rows); e.g. logits [rows, K, C]: 1


class _Refused(Exception):
    def __init__(self, node: onnx.NodeProto | None, reason: str) -> None:
        super().__init__(reason)
        self.refused = PackingRefused(node.name if node else "", node.op_type if node else "", reason)


# ----------------------------------------------------------------------------------------------------
# Finding the mask input
# ----------------------------------------------------------------------------------------------------


def _find_mask(graph: onnx.GraphProto) -> str:
    """The one 2-D input that reaches a Softmax without passing a MatMul or Gemm (its additive operand)."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    found = []
    for value in graph.input:
        if len(value.type.tensor_type.shape.dim) != 2:
            continue
        seen, todo = {value.name}, [value.name]
        reaches = False
        while todo and not reaches:
            for node in consumers.get(todo.pop(), ()):
                if node.op_type in ("MatMul", "Gemm", "Shape", "Size"):
                    continue
                if node.op_type == "Softmax":
                    reaches = True
                    break
                for name in node.output:
                    if name not in seen:
                        seen.add(name)
                        todo.append(name)
        if reaches:
            found.append(value.name)
    if len(found) != 1:
        raise _Refused(
            None,
            f"expected exactly one attention-mask input reaching a Softmax's additive operand, found {found}",
        )
    return found[0]


# ----------------------------------------------------------------------------------------------------
# Graph editing
# ----------------------------------------------------------------------------------------------------


class _Editor:
    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.graph = model.graph
        self.counter = itertools.count()
        self.uses_inputs: set[str] = set()
        self.new_nodes: list[onnx.NodeProto] = []

    def const(self, value: np.ndarray, hint: str) -> str:
        name = f"ipu_packing_const_{next(self.counter)}_{hint}"
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(self, op: str, inputs: list[str], name: str, doc: str = "", output: str = "", **attrs) -> str:
        output = output or f"{name}_output"
        made = helper.make_node(op, inputs, [output], name=name, **attrs)
        if doc:
            made.doc_string = doc
        self.new_nodes.append(made)
        for item in inputs:
            if item in _ROLES:
                self.uses_inputs.add(item)
        return output

    def redirect(self, old: str, new: str, skip_ops: tuple[str, ...] = ()) -> None:
        for node in self.graph.node:
            if node.op_type in skip_ops:
                continue
            for i, name in enumerate(node.input):
                if name == old:
                    node.input[i] = new

    def insert(self, before_consumers_of: set[str]) -> None:
        """Insert ``new_nodes`` before the first node reading any of the given names (or at the end)."""
        at = len(self.graph.node)
        for i, node in enumerate(self.graph.node):
            if any(name in before_consumers_of for name in node.input):
                at = i
                break
        nodes = list(self.graph.node)
        nodes[at:at] = self.new_nodes
        del self.graph.node[:]
        self.graph.node.extend(nodes)
        self.new_nodes = []


def _prune(graph: onnx.GraphProto) -> None:
    """Drop nodes nothing reads and initializers no node reads."""
    while True:
        read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
        keep = [node for node in graph.node if any(name in read for name in node.output)]
        if len(keep) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(keep)
    read = {name for node in graph.node for name in node.input}
    kept = [t for t in graph.initializer if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def _topological_sort(graph: onnx.GraphProto) -> None:
    available = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""} | set(_ROLES)
    pending = list(graph.node)
    ordered = []
    while pending:
        rest = []
        for node in pending:
            if all(name in available for name in node.input):
                ordered.append(node)
                available.update(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):
            raise _Refused(rest[0], "cannot be ordered after the rewrite (a cycle)")
        pending = rest
    del graph.node[:]
    graph.node.extend(ordered)


# ----------------------------------------------------------------------------------------------------
# The rewrite
# ----------------------------------------------------------------------------------------------------


def _discovery_runs(model: onnx.ModelProto, mask: str) -> tuple[list[dict[str, np.ndarray]], list[dict]]:
    rng = np.random.default_rng(0)
    feeds_all = []
    for rows, tokens in _DISCOVERY_SIZES:
        feeds = {}
        for value in model.graph.input:
            dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
            if value.name == mask:
                m = rng.integers(0, 2, size=(rows, tokens))
                m[:, 0] = 1
                feeds[value.name] = m.astype(dtype)
            elif np.issubdtype(dtype, np.integer):
                feeds[value.name] = rng.integers(0, 2, size=(rows, tokens)).astype(dtype)
            else:
                feeds[value.name] = rng.standard_normal((rows, tokens)).astype(dtype)
        feeds_all.append(feeds)
    return run_all(model, feeds_all), feeds_all


class _Rewrite:
    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.graph = model.graph
        self.edit = _Editor(model)
        for value in self.graph.input:
            if "past" in value.name or len(value.type.tensor_type.shape.dim) != 2:
                raise _Refused(None, f"input {value.name!r} is not a [batch, sequence] token input (no past)")
        self.mask = _find_mask(self.graph)
        self.runs, self.feeds = _discovery_runs(model, self.mask)
        self.deps = input_dependencies(self.graph)
        self.constants = constants_of(self.graph)
        self.producer = {name: node for node in self.graph.node for name in node.output}

    def values(self, name: str) -> list[np.ndarray]:
        if name in self.constants and name not in self.runs[0]:
            return [self.constants[name]] * len(self.runs)
        return [run[name] for run in self.runs]

    def axes(self, name: str) -> Axes:
        shapes = [np.shape(v) for v in self.values(name)]
        return Axes(
            rows=follow(shapes, [s[0] for s in _DISCOVERY_SIZES]),
            tokens=follow(shapes, [s[1] for s in _DISCOVERY_SIZES]),
            segments=(),
        )

    def ancestors(self, name: str) -> set[str]:
        seen, todo = set(), [name]
        while todo:
            node = self.producer.get(todo.pop())
            if node is None:
                continue
            for item in node.input:
                if item and item not in seen:
                    seen.add(item)
                    todo.append(item)
        return seen

    # -- 1. the mask --
    def replace_mask(self) -> None:
        candidates = []
        for name in self.runs[0]:
            if self.deps.get(name) != frozenset([self.mask]) or name == self.mask:
                continue
            ok = True
            for run, feeds in zip(self.runs, self.feeds, strict=True):
                value, m = run[name], feeds[self.mask]
                expected = m[:, None, None, :]
                if value.shape != expected.shape or not np.array_equal(
                    value.astype(np.float64), expected.astype(value.dtype).astype(np.float64)
                ):
                    ok = False
                    break
            if ok:
                candidates.append(name)
        upstream = [c for c in candidates if not (self.ancestors(c) & set(candidates))]
        if not upstream:
            raise _Refused(
                None,
                f"no tensor broadcasts the mask {self.mask!r} to [batch, 1, 1, sequence]; the block mask has "
                "no place to go",
            )
        for i, name in enumerate(upstream):
            prefix = f"{REWRITE_PREFIX}block_mask_{i}"
            q = self.edit.node(
                "Unsqueeze", [SEGMENT_IDS, self.edit.const(np.array([1, 3]), "q")], f"{prefix}/q"
            )
            k = self.edit.node(
                "Unsqueeze", [SEGMENT_IDS, self.edit.const(np.array([1, 2]), "k")], f"{prefix}/k"
            )
            same = self.edit.node("Equal", [q, k], f"{prefix}/equal")
            dtype = helper.np_dtype_to_tensor_dtype(self.runs[0][name].dtype)
            block = self.edit.node(
                "Cast", [same], f"{prefix}/cast", doc=REWRITE_PREFIX + BLOCK_MASK, to=dtype
            )
            self.edit.insert({name})
            self.edit.redirect(name, block)
        # The mask's shape is the segment ids' shape.
        for node in self.graph.node:
            if node.op_type in ("Shape", "Size"):
                for j, item in enumerate(node.input):
                    if item == self.mask:
                        node.input[j] = SEGMENT_IDS
        _prune(self.graph)
        for node in self.graph.node:
            if self.mask in node.input:
                raise _Refused(node, f"reads the attention mask {self.mask!r} other than by its broadcast")
        self.edit.uses_inputs.add(SEGMENT_IDS)

    # -- 2. positions --
    def arange_offset(self, name: str) -> int | None:
        axes = self.axes(name)
        if len(axes.tokens) != 1:
            return None
        offsets = set()
        for value in self.values(name):
            if not np.issubdtype(value.dtype, np.integer):
                return None
            (axis,) = axes.tokens
            if any(size != 1 for i, size in enumerate(value.shape) if i != axis):
                return None
            diff = value.reshape(-1) - np.arange(value.shape[axis])
            if len(np.unique(diff)) != 1:
                return None
            offsets.add(int(diff[0]))
        return offsets.pop() if len(offsets) == 1 else None

    def replace_positions(self) -> None:
        chosen: set[str] = set()
        for node in self.graph.node:
            if not any(self.deps.get(name) for name in node.output):
                continue
            for frontier in node.input:
                if not frontier or self.deps.get(frontier) or frontier not in self.runs[0]:
                    continue
                axes = self.axes(frontier)
                if not axes.tokens or translation_invariant(self.values(frontier), axes):
                    continue
                # Only a lookup of a position table is an absolute position to renumber; an arange that
                # indexes the data itself (ConvBERT's unfold) reads neighbours, which the proof refuses.
                table = self.producer.get(frontier)
                if table is None or table.op_type != "Gather" or table.input[0] not in self.constants:
                    continue
                pool = (self.ancestors(frontier) | {frontier}) & set(self.runs[0])
                aranges = {n for n in pool if self.arange_offset(n) is not None}
                chosen |= {a for a in aranges if not any(a in self.ancestors(b) for b in aranges if b != a)}
        for i, name in enumerate(sorted(chosen)):
            value = self.runs[0][name]
            (axis,) = self.axes(name).tokens
            if axis == 0:
                continue  # no rows slot; the proof refuses the absolute position it leaves
            prefix = f"packing_positions_{i}"
            out = POSITION_IDS
            if value.dtype != np.int64:
                out = self.edit.node(
                    "Cast", [out], f"{prefix}/cast", to=helper.np_dtype_to_tensor_dtype(value.dtype)
                )
            offset = self.arange_offset(name)
            if offset:
                out = self.edit.node(
                    "Add", [out, self.edit.const(np.array(offset, value.dtype), "c")], f"{prefix}/add"
                )
            extra = [a for a in range(value.ndim) if a not in (0, axis)]
            if axis != 1 or extra:
                # POSITION_IDS is [rows, tokens]: put rows first and the tokens where the arange had them.
                out = self.edit.node(
                    "Unsqueeze", [out, self.edit.const(np.array(extra), "ax")], f"{prefix}/unsq"
                )
            self.edit.insert({name})
            self.edit.redirect(name, out, skip_ops=("Shape", "Size"))
            self.edit.uses_inputs.add(POSITION_IDS)
        _prune(self.graph)

    # -- 3. CumSum --
    def segment_cumsums(self) -> None:
        for i, node in enumerate([n for n in self.graph.node if n.op_type == "CumSum"]):
            x = node.input[0]
            if not self.deps.get(x):
                continue
            rank = np.ndim(self.runs[0][x])
            axis = int(np.asarray(self.values(node.input[1])[0]).reshape(-1)[0])
            axis = axis + rank if axis < 0 else axis
            axes = self.axes(x)
            if axis not in axes.tokens:
                continue
            if attribute(node, "exclusive", 0) or attribute(node, "reverse", 0):
                raise _Refused(
                    node, "is an exclusive or reverse CumSum along the token axis, not segmented yet"
                )
            if not np.issubdtype(self.runs[0][x].dtype, np.integer):
                raise _Refused(
                    node, "sums floats along the token axis; a segmented float CumSum is not exact"
                )
            if rank != 2 or axis != 1 or axes.rows != (0,):
                raise _Refused(node, "sums along the token axis of a tensor that is not [rows, tokens]")
            prefix = f"{REWRITE_PREFIX}segmented_cumsum_{i}"
            e = self.edit
            inclusive = e.node("CumSum", [x, node.input[1]], f"{prefix}/inclusive")
            exclusive = e.node("CumSum", [x, node.input[1]], f"{prefix}/exclusive", exclusive=1)
            shape = e.node("Shape", [x], f"{prefix}/shape")
            length = e.node(
                "Gather", [shape, e.const(np.array(1, np.int64), "one")], f"{prefix}/length", axis=0
            )
            tokens = e.node(
                "Range",
                [e.const(np.array(0, np.int64), "zero"), length, e.const(np.array(1, np.int64), "step")],
                f"{prefix}/range",
            )
            first = e.node("Sub", [tokens, POSITION_IDS], f"{prefix}/first")
            base = e.node("GatherElements", [exclusive, first], f"{prefix}/base", axis=1)
            e.node(
                "Sub",
                [inclusive, base],
                f"{prefix}/sum",
                doc=f"{REWRITE_PREFIX}{SEGMENTED_CUMSUM}:{x}",
                output=node.output[0],
            )
            self.graph.node.remove(node)
            self.edit.insert(set(node.output))
            self.edit.uses_inputs.add(POSITION_IDS)

    # -- 4. pooled reads --
    def pool(self) -> set[str]:
        pooled: set[str] = set()
        for i, node in enumerate([n for n in self.graph.node if n.op_type == "Gather"]):
            data, indices = node.input
            if not self.deps.get(data) or indices not in self.constants:
                continue
            rank = np.ndim(self.runs[0][data])
            axis = attribute(node, "axis", 0)
            axis = axis + rank if axis < 0 else axis
            axes = self.axes(data)
            if axis not in axes.tokens:
                continue
            index = np.asarray(self.constants[indices])
            if index.ndim != 0:
                continue  # left for the proof to refuse
            if int(index) < 0:
                raise _Refused(
                    node, "reads the last tokens (a negative index); packed pooling of those is not built"
                )
            if axis != 1 or axes.rows != (0,):
                raise _Refused(node, "pools a tensor whose rows and tokens are not its first two axes")
            prefix = f"{REWRITE_PREFIX}pooled_gather_{i}"
            e = self.edit
            at = SEGMENT_STARTS
            if int(index):
                at = e.node("Add", [at, e.const(np.array(int(index), np.int64), "i")], f"{prefix}/offset")
            at = e.node("Unsqueeze", [at, e.const(np.array([-1]), "last")], f"{prefix}/indices")
            e.node(
                "GatherND",
                [data, at],
                f"{prefix}/gather",
                doc=f"{REWRITE_PREFIX}{POOLED_GATHER}:{data}",
                output=node.output[0],
                batch_dims=1,
            )
            self.graph.node.remove(node)
            self.edit.insert(set(node.output))
            self.edit.uses_inputs.add(SEGMENT_STARTS)
            pooled.add(node.output[0])
        # What follows a pooled read gains the segment axis; Gemm takes 2-D only and becomes MatMul + Add.
        reach = set(pooled)
        for node in list(self.graph.node):
            if not any(name in reach for name in node.input):
                continue
            reach.update(node.output)
            if node.op_type != "Gemm":
                continue
            if (
                attribute(node, "transA", 0)
                or attribute(node, "alpha", 1.0) != 1.0
                or attribute(node, "beta", 1.0) != 1.0
            ):
                raise _Refused(
                    node, "is a Gemm after a pooled read with transA, alpha or beta; not rewritten"
                )
            a, b = node.input[0], node.input[1]
            e = self.edit
            if attribute(node, "transB", 0):
                b = e.node("Transpose", [b], f"{node.name}/packing_transpose_b", perm=[1, 0])
            has_bias = len(node.input) > 2 and node.input[2]
            product = e.node(
                "MatMul", [a, b], f"{node.name}/packing_matmul", output="" if has_bias else node.output[0]
            )
            if has_bias:
                e.node("Add", [product, node.input[2]], f"{node.name}/packing_bias", output=node.output[0])
            index = list(self.graph.node).index(node)
            nodes = list(self.graph.node)
            nodes[index : index + 1] = e.new_nodes
            e.new_nodes = []
            del self.graph.node[:]
            self.graph.node.extend(nodes)
        return pooled

    # -- the packed graph's interface --
    def finish(self) -> None:
        graph = self.graph
        _prune(graph)
        _topological_sort(graph)
        kept = [v for v in graph.input if v.name != self.mask]
        for name in (SEGMENT_IDS, POSITION_IDS, SEGMENT_STARTS):
            if name in self.edit.uses_inputs and any(name in n.input for n in graph.node):
                dims = [ROWS_DIM, SEGMENTS_DIM if name == SEGMENT_STARTS else TOKENS_DIM]
                kept.append(helper.make_tensor_value_info(name, TensorProto.INT64, dims))
        del graph.input[:]
        graph.input.extend(kept)
        del graph.value_info[:]
        for output in graph.output:
            output.type.tensor_type.ClearField("shape")


def _name_output_dims(model: onnx.ModelProto, proof: SegmentProof) -> None:
    """Give each output its dims: the packing dimension names where an axis follows a role, else sizes."""
    for output in model.graph.output:
        axes, shape = proof.axes[output.name], proof.shapes[output.name]
        dims: list[str | int] = []
        for axis, size in enumerate(shape):
            if axis in axes.rows:
                dims.append(ROWS_DIM)
            elif axis in axes.tokens:
                dims.append(TOKENS_DIM)
            elif axis in axes.segments:
                dims.append(SEGMENTS_DIM)
            else:
                dims.append(int(size))
        output.type.tensor_type.shape.CopyFrom(
            helper.make_tensor_type_proto(output.type.tensor_type.elem_type, dims).tensor_type.shape
        )


def pack_encoder(model: onnx.ModelProto, weights_dir: Path | None = None) -> PackedEncoder | PackingRefused:
    """Rewrite an exported encoder (optimum-onnx, dynamic batch and sequence, no past) for packed rows and
    prove it; return the packed encoder, or the refusal that names the node that stops it. ``weights_dir``
    is where weights kept in files lie (the model's directory); the packed graph refers to the same files."""
    packed = _with_weights_inside(model, weights_dir)
    try:
        rewrite = _Rewrite(packed)
        rewrite.replace_mask()
        rewrite.replace_positions()
        rewrite.segment_cumsums()
        rewrite.pool()
        rewrite.finish()
    except _Refused as refusal:
        return refusal.refused
    result = _proven(packed, rewrite.mask)
    if isinstance(result, PackedEncoder):
        _weights_back_in_files(result.model, model)
    return result


def _with_weights_inside(model: onnx.ModelProto, weights_dir: Path | None) -> onnx.ModelProto:
    """A copy of ``model`` with the weights it keeps in files read in: the rewrite and the proof evaluate
    the graph on onnxruntime, which refuses the absolute data locations ``compiler.external_data`` writes."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for tensor in copy.graph.initializer:
        if is_external(tensor):
            tensor.CopyFrom(
                numpy_helper.from_array(np.asarray(read_weight(tensor, weights_dir)), tensor.name)
            )
    return copy


def _weights_back_in_files(packed: onnx.ModelProto, model: onnx.ModelProto) -> None:
    """The packed graph's initializers that the export keeps in files point at those files again, so the
    packed graph is no larger than the export's."""
    stored = {tensor.name: tensor for tensor in model.graph.initializer if is_external(tensor)}
    for tensor in packed.graph.initializer:
        if tensor.name in stored:
            tensor.CopyFrom(stored[tensor.name])


def _proven(packed: onnx.ModelProto, mask: str) -> PackedEncoder | PackingRefused:
    special = {v.name: _ROLES[v.name] for v in packed.graph.input if v.name in _ROLES}
    proof = prove_segments(packed, special)
    if isinstance(proof, PackingRefused):
        return proof
    _name_output_dims(packed, proof)
    packed = infer_shapes(packed)
    return PackedEncoder(
        model=packed,
        mask_input=mask,
        token_inputs=tuple(v.name for v in packed.graph.input if v.name not in _ROLES),
        token_outputs=dict(proof.token_outputs),
        pooled_outputs=dict(proof.pooled_outputs),
    )


def describe(result: PackedEncoder | PackingRefused) -> str:
    """The packing verdict users read (``packing_verdict()``, ``compiled_executables()``, ``optimum-ipu
    check --verify-padding``): which outputs packed rows serve, or the node that stops the proof."""
    if isinstance(result, PackingRefused):
        return f"not packed: {result}"
    return f"packed rows (proven): {', '.join([*result.token_outputs, *result.pooled_outputs])}"
