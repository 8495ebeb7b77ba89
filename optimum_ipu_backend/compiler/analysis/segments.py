"""The proof that a packed encoder computes each segment exactly as the unpacked encoder would.

Packing (``compiler.graph_rewrites.packing``) lays several sequences out in one row, marked by segment ids.
This analysis reads the packed graph and decides, node by node, whether every output element of a real
segment equals the unpacked computation of that segment (up to the order of float sums), or names the node
that stops it.

It is an abstract interpretation over tensors. Axes are found by execution, never by dimension names: the
graph runs on onnxruntime twice, at (rows, tokens, segments) sizes that are distinct primes, with every
intermediate tensor kept, and an axis is a token axis where its size follows the token count in both runs
(likewise rows and segments). Each tensor then gets a class:

- ``CONST``: no token axis (or, for a value that depends on no input, one that is translation-invariant
  along its token axes and the same at both lengths: a buffer of zeros, a relative-position bias);
- ``SEG``: the element at token ``t`` is a function of ``t``'s own segment, exactly as unpacked at
  position ``t - start`` (the token inputs, ``POSITION_IDS``, per-token arithmetic on them);
- ``PAIR``: two token axes ``q, k``, exact on same-segment pairs, finite elsewhere (attention scores);
- ``BLOCK``: a value of the segment ids only, a function of ``seg[q] == seg[k]``; its same-segment value
  is the unpacked one by construction (the rewrite put it where the broadcast mask was, holding 1), and its
  cross-segment value is followed concretely, so ``Where``/``Sub``/``Mul`` chains stay exact;
- ``MASKED``: a ``PAIR`` plus a bias whose cross-segment value is at most -1e30;
- ``PROBS``: ``Softmax`` of ``MASKED`` over ``k``: cross entries underflow to exactly 0, so
  ``MatMul(PROBS[.., q, k], SEG[.., k, d])`` is ``SEG`` again;
- ``POOLED``: a segment axis, whose element ``j`` is the unpacked pooled value of segment ``j``;
- ``POS``: a value that depends on no input but varies along a token axis (an absolute position); it may
  only feed other input-free values.

What mixes along a token axis otherwise (an unsegmented CumSum, a reduction or normalization over tokens,
a convolution, a Slice or Gather that reads fixed positions, a Reshape that merges a token axis, a MatMul
contracting tokens without ``PROBS``, an absolute position reaching data) is refused, naming the node. The
rewrite's own constructions (the segmented CumSum, the pooled gather, the block mask) are nodes named
``ipu_packing/<kind>_<n>/...``; their last node carries the class by construction and the others are
internal. Run-time checks back the claims the classes make about values: ``MASKED`` cross entries are at
most -1e30 and ``PROBS`` cross entries exactly 0 in both runs, and every float tensor is finite.

The proof is by evaluation at two sizes for what depends on no input (translation invariance, agreement
between the two lengths) and by the operator rules above for the rest.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from optimum_ipu_backend.compiler.graphs import attribute, constant_node_value, infer_shapes

#: Node-name prefix of everything the packing rewrite builds; the proof knows those constructions.
REWRITE_PREFIX = "ipu_packing/"
#: doc_string of the last node of a construction: "<REWRITE_PREFIX><kind>", the kind's class follows.
SEGMENTED_CUMSUM = "segmented_cumsum"
POOLED_GATHER = "pooled_gather"
BLOCK_MASK = "block_mask"

# (rows, tokens, segments) of the two proof runs: distinct primes, so that no fixed dimension follows a
# role in both runs and no axis follows two roles.
PROOF_SIZES: tuple[tuple[int, int, int], ...] = ((2, 13, 5), (3, 17, 7))
_MASKED_LIMIT = -1e30


@dataclass(frozen=True)
class PackingRefused:
    """Why an encoder is not packed: the node that stops it ("" when the inputs do) and the reason."""

    node: str
    op_type: str
    reason: str

    def __str__(self) -> str:
        if not self.node:
            return f"the graph is not packed: {self.reason}"
        return f"node {self.node!r} ({self.op_type}) {self.reason}"


class Class(enum.Enum):
    CONST = "const"
    SEG = "seg"
    PAIR = "pair"
    BLOCK = "block"
    MASKED = "masked"
    PROBS = "probs"
    POOLED = "pooled"
    POS = "pos"
    INTERNAL = "internal"


@dataclass(frozen=True)
class Axes:
    """Which axes of a tensor follow the rows, tokens and segments (the same in both runs)."""

    rows: tuple[int, ...]
    tokens: tuple[int, ...]
    segments: tuple[int, ...]


@dataclass(frozen=True)
class SegmentProof:
    """The proof's result: each graph output's class and axes."""

    classes: Mapping[str, Class]
    axes: Mapping[str, Axes]
    shapes: Mapping[str, tuple[int, ...]]  # in the first proof run
    token_outputs: dict[str, int] = field(default_factory=dict)
    pooled_outputs: dict[str, int] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------
# Evaluation with every intermediate tensor kept
# ----------------------------------------------------------------------------------------------------


def run_all(model: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """Every tensor of ``model`` (inputs and node outputs; not initializers) for each of ``feeds``, on
    onnxruntime CPU with graph optimizations off so that each node's own output is what comes back. One
    session serves all the feeds."""
    import onnxruntime as ort

    inferred = infer_shapes(model, with_weights=False)
    types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    types.update({v.name: v.type.tensor_type.elem_type for v in model.graph.output})
    outputs = [
        helper.make_tensor_value_info(name, types[name], None)
        for node in model.graph.node
        for name in node.output
        if name and types.get(name)
    ]
    kept = list(model.graph.output)
    del model.graph.output[:]
    model.graph.output.extend(outputs)
    try:
        serialized = model.SerializeToString()
    finally:
        del model.graph.output[:]
        model.graph.output.extend(kept)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(serialized, options, providers=["CPUExecutionProvider"])
    names = [value.name for value in outputs]
    found = []
    for feed in feeds:
        values = dict(zip(names, session.run(names, dict(feed)), strict=True))
        values.update({name: np.asarray(value) for name, value in feed.items()})
        found.append(values)
    return found


def constants_of(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Initializers (weights kept in files are mapped, not read) and Constant-node values, by name."""
    from optimum_ipu_backend.compiler.external_data import read_weight

    found = {t.name: read_weight(t, None) for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            value = constant_node_value(node)
            if value is not None:
                found[node.output[0]] = value
    return found


def input_dependencies(graph: onnx.GraphProto) -> dict[str, frozenset[str]]:
    """For each tensor, the graph inputs its value depends on (a Shape or Size reads no value)."""
    deps: dict[str, frozenset[str]] = {i.name: frozenset([i.name]) for i in graph.input}
    for node in graph.node:
        if node.op_type in ("Shape", "Size"):
            found: frozenset[str] = frozenset()
        else:
            found = frozenset().union(*(deps.get(name, frozenset()) for name in node.input if name))
        for name in node.output:
            deps[name] = found
    return deps


def follow(shapes: Sequence[tuple[int, ...]], sizes: Sequence[int]) -> tuple[int, ...]:
    """Axes whose size is ``sizes[r]`` in run ``r`` for every run."""
    ranks = {len(shape) for shape in shapes}
    if len(ranks) != 1:
        return ()
    return tuple(
        axis
        for axis in range(ranks.pop())
        if all(shape[axis] == size for shape, size in zip(shapes, sizes, strict=True))
    )


def axes_of(values: Sequence[np.ndarray], sizes: Sequence[tuple[int, int, int]]) -> Axes:
    shapes = [np.shape(v) for v in values]
    return Axes(
        rows=follow(shapes, [s[0] for s in sizes]),
        tokens=follow(shapes, [s[1] for s in sizes]),
        segments=follow(shapes, [s[2] for s in sizes]),
    )


def translation_invariant(values: Sequence[np.ndarray], axes: Axes) -> bool:
    """An input-free value is the same for every segment start: constant along one token axis, a function
    of ``k - q`` along two, and the smaller run's value is the larger run's on the first tokens and rows."""
    if len(axes.tokens) > 2:
        return False
    for value in values:
        if len(axes.tokens) == 1:
            axis = axes.tokens[0]
            if value.shape[axis] > 1 and not np.array_equal(
                np.take(value, range(1, value.shape[axis]), axis=axis),
                np.take(value, range(value.shape[axis] - 1), axis=axis),
            ):
                return False
        elif len(axes.tokens) == 2:
            q, k = axes.tokens
            n = value.shape[q]
            inner = np.take(np.take(value, range(1, n), axis=q), range(1, n), axis=k)
            outer = np.take(np.take(value, range(n - 1), axis=q), range(n - 1), axis=k)
            if not np.array_equal(inner, outer):
                return False
    small, large = sorted(values, key=lambda v: v.size)
    if small.ndim != large.ndim:
        return False
    corner = large[tuple(slice(0, n) for n in small.shape)]
    return corner.shape == small.shape and np.array_equal(corner, small)


def _cross(segment_ids: np.ndarray, value: np.ndarray, axes: Axes) -> np.ndarray | None:
    """A boolean array broadcast to ``value``: True at (row, q, k) with different segments; None when the
    tensor lacks a rows axis or two token axes."""
    if len(axes.tokens) != 2 or len(axes.rows) != 1:
        return None
    (r,), (q, k) = axes.rows, axes.tokens
    if not r < q < k:
        return None
    shape = [1] * value.ndim
    shape[r], shape[q], shape[k] = value.shape[r], value.shape[q], value.shape[k]
    cross = segment_ids[:, :, None] != segment_ids[:, None, :]
    return np.broadcast_to(cross.reshape(shape), value.shape)


def _block_values(segment_ids: np.ndarray, value: np.ndarray, axes: Axes) -> tuple[float, float] | None:
    """(same, cross) when ``value`` is a function of segment equality with one value each; else None."""
    cross = _cross(segment_ids, value, axes)
    if cross is None:
        return None
    same_values = np.unique(value[~cross])
    cross_values = np.unique(value[cross])
    if len(same_values) != 1 or len(cross_values) > 1:
        return None
    same = float(same_values[0])
    return same, float(cross_values[0]) if len(cross_values) else same


# ----------------------------------------------------------------------------------------------------
# Feeds for the proof runs
# ----------------------------------------------------------------------------------------------------


def segment_layout(
    rows: int, tokens: int, segments: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random segment ids, positions and starts: row 0 holds ``segments`` sequences and an empty slot, the
    others fewer; the last row is empty when there are three rows or more."""
    seg = np.zeros((rows, tokens), np.int64)
    pos = np.zeros((rows, tokens), np.int64)
    starts = np.zeros((rows, segments), np.int64)
    for row in range(rows):
        count = (
            segments if row == 0 else int(rng.integers(0 if row == rows - 1 and rows > 2 else 1, segments))
        )
        if row == rows - 1 and rows > 2:
            count = 0
        free = tokens - 1 - count
        cuts = np.sort(rng.integers(0, free + 1, size=max(count - 1, 0)))
        lengths = np.diff(np.concatenate([[0], cuts, [free]])) + 1 if count else np.array([], np.int64)
        at = 0
        for j, length in enumerate(lengths):
            seg[row, at : at + length] = j + 1
            pos[row, at : at + length] = np.arange(length)
            starts[row, j] = at
            at += int(length)
    return seg, pos, starts


def _proof_feeds(
    model: onnx.ModelProto, special: Mapping[str, str], sizes: tuple[int, int, int], seed: int
) -> dict[str, np.ndarray]:
    rows, tokens, segments = sizes
    rng = np.random.default_rng(seed)
    seg, pos, starts = segment_layout(rows, tokens, segments, rng)
    by_role = {"segment_ids": seg, "position_ids": pos, "segment_starts": starts}
    feeds = {}
    for value in model.graph.input:
        role = special.get(value.name)
        if role is not None:
            feeds[value.name] = by_role[role]
            continue
        dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        shape = [rows, tokens] + [d.dim_value or 1 for d in value.type.tensor_type.shape.dim[2:]]
        if np.issubdtype(dtype, np.integer):
            feeds[value.name] = rng.integers(0, 2, size=shape).astype(dtype)
        else:
            feeds[value.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


# ----------------------------------------------------------------------------------------------------
# The abstract interpretation
# ----------------------------------------------------------------------------------------------------

_ELEMENTWISE = frozenset(
    "Add Sub Mul Div Pow Sqrt Erf Tanh Relu Gelu Sigmoid Exp Log Neg Abs Cast CastLike Equal Not Where Less "
    "Greater LessOrEqual GreaterOrEqual And Or Xor Max Min Clip Reciprocal Identity Softplus Mod Sign Floor "
    "Ceil Round HardSigmoid HardSwish IsNaN IsInf Sin Cos Dropout Mish Elu LeakyRelu Selu PRelu".split()
)
_RESHAPING = frozenset("Reshape Flatten Squeeze Unsqueeze Transpose Expand".split())
_REDUCTIONS = frozenset(
    "ReduceMean ReduceSum ReduceMax ReduceMin ReduceProd ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp "
    "ReduceSumSquare ArgMax ArgMin".split()
)
_ORDER = {Class.CONST: 0, Class.SEG: 1, Class.PAIR: 2}


class _Refusal(Exception):
    def __init__(self, node: onnx.NodeProto, reason: str) -> None:
        super().__init__(reason)
        self.refused = PackingRefused(node.name, node.op_type, reason)


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


class _Proof:
    def __init__(
        self,
        model: onnx.ModelProto,
        special: Mapping[str, str],
        runs: Sequence[Mapping[str, np.ndarray]],
        feeds: Sequence[Mapping[str, np.ndarray]],
    ) -> None:
        self.model = model
        self.graph = model.graph
        self.special = special
        self.runs = runs
        self.seg_ids = [f[name] for f in feeds for name, role in special.items() if role == "segment_ids"]
        self.constants = constants_of(self.graph)
        self.deps = input_dependencies(self.graph)
        self.classes: dict[str, Class] = {}
        self.block: dict[str, tuple[tuple[float, float], ...]] = {}
        self.axes: dict[str, Axes] = {}
        self.role_of_input = {name: role for name, role in special.items()}

    # -- helpers --
    def values(self, name: str) -> list[np.ndarray]:
        if name in self.constants and name not in self.runs[0]:
            return [self.constants[name]] * len(self.runs)
        return [run[name] for run in self.runs]

    def axes_of(self, name: str) -> Axes:
        if name not in self.axes:
            self.axes[name] = axes_of(self.values(name), PROOF_SIZES)
        return self.axes[name]

    def value(self, name: str) -> np.ndarray:
        return self.values(name)[0]

    def cls(self, name: str) -> Class:
        return self.classes.get(name, Class.CONST)

    # -- the walk --
    def run(self) -> None:
        for value in self.graph.input:
            role = self.special.get(value.name)
            self.classes[value.name] = {
                "segment_ids": Class.INTERNAL,
                "segment_starts": Class.INTERNAL,
            }.get(role or "", Class.SEG)
        for node in self.graph.node:
            self.step(node)

    def step(self, node: onnx.NodeProto) -> None:
        outputs = [name for name in node.output if name]
        deps = frozenset().union(*(self.deps[name] for name in outputs)) if outputs else frozenset()
        if node.name.startswith(REWRITE_PREFIX):
            for name in outputs:
                self.classes[name] = Class.INTERNAL
            if node.doc_string.startswith(REWRITE_PREFIX):
                kind, _, source = node.doc_string.removeprefix(REWRITE_PREFIX).partition(":")
                self.construction(node, kind, source)
            return
        for name in node.input if node.op_type not in ("Shape", "Size") else ():
            if name and self.cls(name) is Class.INTERNAL:
                raise _Refusal(node, f"reads {name!r}, an internal tensor of the packing rewrite")
        if not deps:
            for name in outputs:
                self.classes[name] = self.input_free(name)
            return
        if deps <= {n for n, role in self.special.items() if role == "segment_ids"}:
            for name in outputs:
                self.classes[name] = self.block_class(node, name)
            return
        for name in node.input:
            if name and self.cls(name) is Class.POS:
                raise _Refusal(
                    node,
                    f"mixes an absolute position ({name!r}, a value of the token index alone) into the "
                    "sequences' values; packed, it would count from the row's start, not the sequence's",
                )
        result = self.rule(node)
        for name, found in zip(outputs, result, strict=False):
            self.classes[name] = self.normalize(found, name)

    def construction(self, node: onnx.NodeProto, kind: str, source: str) -> None:
        """The class of a rewrite-built construction's result, by construction: a segmented CumSum of a
        per-token value is per-token; a gather at the segment starts of a per-token value is pooled."""
        if kind == SEGMENTED_CUMSUM:
            if self.cls(source) not in (Class.SEG, Class.CONST):
                raise _Refusal(node, f"sums {source!r}, which is not a per-token value of its own segment")
            self.classes[node.output[0]] = Class.SEG
        elif kind == POOLED_GATHER:
            if self.cls(source) not in (Class.SEG, Class.CONST):
                raise _Refusal(node, f"pools {source!r}, which is not a per-token value of its own segment")
            self.classes[node.output[0]] = Class.POOLED
        elif kind == BLOCK_MASK:
            self.classes[node.output[0]] = self.block_class(node, node.output[0])
        else:
            raise _Refusal(node, f"is a packing construction of unknown kind {kind!r}")

    def input_free(self, name: str) -> Class:
        axes = self.axes_of(name)
        if not axes.tokens:
            return Class.CONST
        if translation_invariant(self.values(name), axes):
            return Class.SEG if len(axes.tokens) == 1 else Class.PAIR
        return Class.POS

    def block_class(self, node: onnx.NodeProto, name: str) -> Class:
        axes = self.axes_of(name)
        found = []
        for seg, value in zip(self.seg_ids, self.values(name), strict=True):
            pair = _block_values(seg, value, axes)
            if pair is None:
                raise _Refusal(
                    node,
                    "uses the segment ids as values; only a comparison of two tokens' segment ids "
                    "(the block mask) has an unpacked counterpart",
                )
            found.append(pair)
        if len(set(found)) != 1:
            raise _Refusal(node, "builds a block mask whose values differ between the proof runs")
        self.block[name] = tuple(found)
        return Class.BLOCK

    def normalize(self, found: Class, name: str) -> Class:
        axes = self.axes_of(name)
        if found is Class.SEG and len(axes.tokens) == 2:
            return Class.PAIR
        return found

    # -- operator rules --
    def rule(self, node: onnx.NodeProto) -> list[Class]:
        op = node.op_type
        ins = [name for name in node.input]
        out = node.output[0]
        out_axes = self.axes_of(out) if out in self.runs[0] else Axes((), (), ())
        classes = [self.cls(name) for name in ins if name]
        token_inputs = [name for name in ins if name and self.axes_of(name).tokens]
        self.keeps_rows_and_slots_apart(node)

        if any(c is Class.POOLED for c in classes) and op not in ("MatMul", "Gemm"):
            others = [c for c in classes if c not in (Class.POOLED, Class.CONST)]
            if others:
                raise _Refusal(node, "combines a pooled per-segment value with per-token values")
            return [Class.POOLED] * len(node.output)
        if op in _ELEMENTWISE:
            return [self.elementwise(node)] * len(node.output)
        if op in _RESHAPING:
            self.keeps_axes_whole(node, ins[0], out)
            base = self.cls(ins[0])
            return [Class.PAIR if base in (Class.MASKED, Class.PROBS) and op != "Expand" else base]
        if op in ("MatMul", "Gemm"):
            return [self.matmul(node)]
        if op in ("Softmax", "LogSoftmax"):
            rank = len(np.shape(self.value(ins[0])))
            axis = _axis(attribute(node, "axis", -1), rank)
            axes = self.axes_of(ins[0])
            if axis in axes.tokens:
                if self.cls(ins[0]) is not Class.MASKED or axis != axes.tokens[-1] or op != "Softmax":
                    raise _Refusal(
                        node,
                        "normalizes over the token axis without a block mask that hides the other "
                        "sequences, so each token's weights would depend on its neighbours in the row",
                    )
                self.check_probs(node, out)
                return [Class.PROBS]
            return [self.join(node, classes)]
        if op in ("LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization"):
            rank = len(np.shape(self.value(ins[0])))
            axis = _axis(attribute(node, "axis", -1), rank)
            if any(a >= axis for a in self.axes_of(ins[0]).tokens):
                raise _Refusal(node, "normalizes over the token axis, mixing the sequences of a row")
            return [self.join(node, classes[:1])] * len(node.output)
        if op in _REDUCTIONS:
            self.reduction(node)
            return [self.join(node, classes[:1])]
        if op == "Gather":
            return [self.gather(node)]
        if op == "Slice":
            self.slice(node)
            return [self.cls(ins[0])]
        if op in ("Split", "Concat"):
            rank = len(np.shape(self.value(ins[0])))
            axis = _axis(attribute(node, "axis", 0), rank)
            if any(axis in self.axes_of(name).tokens for name in ins if name):
                raise _Refusal(node, f"{'splits' if op == 'Split' else 'concatenates'} along the token axis")
            return [self.join(node, classes[:1] if op == "Split" else classes)] * len(node.output)
        if op == "CumSum":
            rank = len(np.shape(self.value(ins[0])))
            axis = _axis(int(np.asarray(self.value(ins[1])).reshape(-1)[0]), rank)
            if axis in self.axes_of(ins[0]).tokens:
                raise _Refusal(
                    node, "sums along the token axis across the sequences of a row (an unsegmented CumSum)"
                )
            return [self.join(node, classes[:1])]
        if token_inputs or out_axes.tokens:
            raise _Refusal(
                node,
                f"is a {op}, which is not known to keep the sequences of a row apart along the token axis",
            )
        return [self.join(node, classes)] * len(node.output)

    def join(self, node: onnx.NodeProto, classes: Sequence[Class]) -> Class:
        best = Class.CONST
        for found in classes:
            if found in (Class.BLOCK, Class.MASKED, Class.PROBS):
                found = Class.PAIR
            if found not in _ORDER:
                raise _Refusal(node, f"combines a {found.value} value in a way the proof does not follow")
            best = max(best, found, key=_ORDER.__getitem__)
        return best

    def elementwise(self, node: onnx.NodeProto) -> Class:
        ins = [name for name in node.input if name]
        classes = [self.cls(name) for name in ins]
        op = node.op_type
        if op in ("Add", "Sub") and len(ins) == 2:
            a, b = ins
            ca, cb = classes
            if ca is Class.MASKED and cb in _ORDER:
                return Class.MASKED
            if cb is Class.MASKED and ca in _ORDER and op == "Add":
                return Class.MASKED
            for data, mask in ((a, b), (b, a)) if op == "Add" else ((a, b),):
                if self.cls(data) in _ORDER and self.cls(mask) is Class.BLOCK:
                    if all(cross <= _MASKED_LIMIT for _, cross in self.block[mask]):
                        self.check_masked(node, node.output[0])
                        return Class.MASKED
        if op == "Where" and len(ins) == 3 and classes[0] is Class.BLOCK:
            cond, x, y = ins
            same, cross = self.block[cond][0]
            picked_same = x if same else y
            picked_cross = x if cross else y
            if self.cls(picked_same) in _ORDER and self.hidden(picked_cross):
                self.check_masked(node, node.output[0])
                return Class.MASKED
        return self.join(node, classes)

    def hidden(self, name: str) -> bool:
        """A value at most -1e30 everywhere (a constant, or a block whose both values are)."""
        found = self.cls(name)
        if found is Class.BLOCK:
            return all(max(pair) <= _MASKED_LIMIT for pair in self.block[name])
        if found is Class.CONST:
            return all(np.all(np.asarray(v) <= _MASKED_LIMIT) for v in self.values(name))
        return False

    def check_masked(self, node: onnx.NodeProto, name: str) -> None:
        for seg, value in zip(self.seg_ids, self.values(name), strict=True):
            cross = _cross(seg, value, self.axes_of(name))
            if cross is None or not np.all(value[cross] <= _MASKED_LIMIT):
                raise _Refusal(node, "masks the other sequences with values above -1e30 in the proof runs")

    def check_probs(self, node: onnx.NodeProto, name: str) -> None:
        for seg, value in zip(self.seg_ids, self.values(name), strict=True):
            cross = _cross(seg, value, self.axes_of(name))
            if cross is None or not np.all(value[cross] == 0):
                raise _Refusal(node, "gives other sequences attention weights that are not exactly 0")

    def keeps_axes_whole(self, node: onnx.NodeProto, source: str, target: str) -> None:
        before, after = self.axes_of(source), self.axes_of(target)
        for run_in, run_out in zip(self.values(source), self.values(target), strict=True):
            shape_in, shape_out = np.shape(run_in), np.shape(run_out)
            for role in ("tokens", "segments", "rows"):
                axes_in, axes_out = getattr(before, role), getattr(after, role)
                if role == "rows" and not axes_in:
                    continue
                if node.op_type == "Expand":
                    # Broadcasting keeps every axis it is given and may add new ones of size 1 -> n.
                    continue
                if len(axes_in) != len(axes_out):
                    raise _Refusal(node, f"merges or splits a {role[:-1]} axis")
                for i, j in zip(axes_in, axes_out, strict=True):
                    if node.op_type == "Transpose":
                        continue
                    if int(np.prod(shape_in[:i])) != int(np.prod(shape_out[:j])):
                        raise _Refusal(node, f"merges a {role[:-1]} axis with another axis")

    def matmul(self, node: onnx.NodeProto) -> Class:
        a, b = node.input[0], node.input[1]
        ca, cb = self.cls(a), self.cls(b)
        shape_a, shape_b = np.shape(self.value(a)), np.shape(self.value(b))
        if node.op_type == "Gemm":
            contract_a = 0 if attribute(node, "transA", 0) else len(shape_a) - 1
            contract_b = len(shape_b) - 1 if attribute(node, "transB", 0) else 0
        else:
            contract_a = len(shape_a) - 1
            contract_b = max(len(shape_b) - 2, 0)
        tokens_a, tokens_b = self.axes_of(a).tokens, self.axes_of(b).tokens
        if contract_a in tokens_a or contract_b in tokens_b:
            if node.op_type == "MatMul" and ca is Class.PROBS and cb in (Class.SEG, Class.CONST, Class.PAIR):
                if contract_a == tokens_a[-1] and contract_b in tokens_b:
                    return Class.SEG
            raise _Refusal(
                node,
                "contracts the token axis without masked attention probabilities, summing over the "
                "other sequences of the row",
            )
        if Class.POOLED in (ca, cb):
            if {ca, cb} - {Class.POOLED, Class.CONST}:
                raise _Refusal(node, "combines a pooled per-segment value with per-token values")
            return Class.POOLED
        extra = [self.cls(name) for name in node.input[2:] if name]
        return self.join(node, [ca, cb, *extra])

    def reduction(self, node: onnx.NodeProto) -> None:
        if set(self.operated_axes(node)) & set(self.axes_of(node.input[0]).tokens):
            raise _Refusal(node, "reduces over the token axis, mixing the sequences of a row")

    def operated_axes(self, node: onnx.NodeProto) -> list[int]:
        """The axes of its first input an operator reduces, normalizes, indexes, joins or sums along."""
        op, data = node.op_type, node.input[0] if node.input else ""
        if not data or (data not in self.runs[0] and data not in self.constants):
            return []
        rank = len(np.shape(self.value(data)))
        if op in ("Softmax", "LogSoftmax", "Hardmax"):
            return [_axis(attribute(node, "axis", -1), rank)]
        if op in ("Gather", "GatherElements", "Concat", "Split", "ArgMax", "ArgMin"):
            return [_axis(attribute(node, "axis", 0), rank)]
        if op == "CumSum":
            return [_axis(int(np.asarray(self.value(node.input[1])).reshape(-1)[0]), rank)]
        if op in ("LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization"):
            return list(range(_axis(attribute(node, "axis", -1), rank), rank))
        if op not in _REDUCTIONS:
            return []
        if attribute(node, "axes") is not None:
            axes = list(attribute(node, "axes"))
        elif len(node.input) > 1 and node.input[1]:
            axes = [int(a) for a in np.asarray(self.value(node.input[1])).reshape(-1)]
        else:
            axes = [] if attribute(node, "noop_with_empty_axes", 0) else list(range(rank))
        return [_axis(a, rank) for a in axes]

    def keeps_rows_and_slots_apart(self, node: onnx.NodeProto) -> None:
        """A row holds sequences of unrelated calls and a pooled value's slots unrelated sequences: no
        operator may work along the rows or the slots (the export never mixes the samples of a batch)."""
        if not node.input or not node.input[0] or node.name.startswith(REWRITE_PREFIX):
            return
        axes = self.axes_of(node.input[0]) if node.input[0] in self.runs[0] else None
        if axes is not None and set(self.operated_axes(node)) & {*axes.rows, *axes.segments}:
            raise _Refusal(
                node, "works along the rows or the segment slots, mixing the outputs of unrelated sequences"
            )

    def gather(self, node: onnx.NodeProto) -> Class:
        data, indices = node.input[0], node.input[1]
        rank = len(np.shape(self.value(data)))
        axis = _axis(attribute(node, "axis", 0), rank)
        cd, ci = self.cls(data), self.cls(indices)
        if axis in self.axes_of(data).tokens:
            raise _Refusal(
                node,
                "reads fixed positions along the token axis (a pooled read the rewrite did not replace, "
                "or a negative index), which packed would read another sequence",
            )
        if self.deps.get(data) and self.deps.get(indices):
            raise _Refusal(node, "gathers data-dependent values at data-dependent indices")
        return self.join(node, [cd, ci])

    def slice(self, node: onnx.NodeProto) -> None:
        data, out = node.input[0], node.output[0]
        before, after = self.axes_of(data), self.axes_of(out)
        if before.tokens != after.tokens:
            raise _Refusal(node, "slices along the token axis, reading fixed positions of the row")
        if before.tokens:
            rank = len(np.shape(self.value(data)))
            starts = np.asarray(self.value(node.input[1])).reshape(-1)
            axes = (
                [_axis(int(a), rank) for a in np.asarray(self.value(node.input[3])).reshape(-1)]
                if len(node.input) > 3 and node.input[3]
                else list(range(len(starts)))
            )
            steps = (
                np.asarray(self.value(node.input[4])).reshape(-1)
                if len(node.input) > 4 and node.input[4]
                else np.ones(len(starts), np.int64)
            )
            for axis, start, step in zip(axes, starts, steps, strict=True):
                if axis in before.tokens and (int(start) != 0 or int(step) != 1):
                    raise _Refusal(node, "slices along the token axis, reading fixed positions of the row")

    def finite(self) -> None:
        for node in self.graph.node:
            for name in node.output:
                for value in self.values(name) if name in self.runs[0] and self.deps.get(name) else ():
                    value = np.asarray(value)
                    if np.issubdtype(value.dtype, np.floating) and not np.all(np.isfinite(value)):
                        raise _Refusal(node, "produces values that are not finite in the proof runs")


def prove_segments(model: onnx.ModelProto, special: Mapping[str, str]) -> SegmentProof | PackingRefused:
    """Decide whether the packed ``model`` computes each real segment's outputs exactly as unpacked.

    ``special`` maps the packing inputs the graph takes to their roles: ``"segment_ids"``,
    ``"position_ids"``, ``"segment_starts"``; every other input is a [rows, tokens] token input.
    """
    feeds = [_proof_feeds(model, special, sizes, seed) for seed, sizes in enumerate(PROOF_SIZES)]
    try:
        runs = run_all(model, feeds)
    except Exception as error:  # onnxruntime raises its own types; any failure means no proof
        return PackingRefused("", "", f"the packed graph does not run on onnxruntime ({error})")
    proof = _Proof(model, special, runs, feeds)
    try:
        proof.finite()
        proof.run()
    except _Refusal as refusal:
        return refusal.refused
    token_outputs: dict[str, int] = {}
    pooled_outputs: dict[str, int] = {}
    axes = {}
    for value in model.graph.output:
        name = value.name
        found, found_axes = proof.cls(name), proof.axes_of(name)
        axes[name] = found_axes
        producer = next((n for n in model.graph.node if name in n.output), None)
        where = (producer.name, producer.op_type) if producer is not None else ("", "")
        if found is Class.POOLED and len(found_axes.segments) == 1:
            pooled_outputs[name] = found_axes.segments[0]
        elif found is Class.SEG and len(found_axes.tokens) == 1:
            token_outputs[name] = found_axes.tokens[0]
        else:
            return PackingRefused(
                *where,
                f"produces the output {name!r} as a {found.value} value with token axes {found_axes.tokens} "
                f"and segment axes {found_axes.segments}, not one value per token or per segment",
            )
    return SegmentProof(
        {v.name: proof.cls(v.name) for v in model.graph.output},
        axes,
        {v.name: tuple(np.shape(proof.value(v.name))) for v in model.graph.output},
        token_outputs,
        pooled_outputs,
    )


__all__ = [
    "PROOF_SIZES",
    "REWRITE_PREFIX",
    "Axes",
    "Class",
    "PackingRefused",
    "SegmentProof",
    "prove_segments",
    "run_all",
    "segment_layout",
]
