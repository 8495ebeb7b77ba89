"""Make a raw-audio encoder (wav2vec2, HuBERT, WavLM, SEW, Data2VecAudio) exact on right-padded samples.

optimum exports the wav2vec2 family with ``input_values`` ``[batch, samples]`` only: no attention mask.
Padding the samples then adds frames that the attention sees, that the positional convolution reads
next to the last real frames, and that a classification head averages over.

:func:`add_audio_frame_mask` works on the exported graph (dynamic axes, before legalization). It adds one
input, ``ipu_sample_mask`` ``[batch, samples]`` (int64, 1 = real sample, 0 = padding), for samples padded
on the RIGHT, and derives from it, inside the graph, a mask over the frames of every frame rate the graph
has: through each convolution over samples or frames, a frame is kept when it is what the unpadded input
computes there (its window reads only kept positions, or positions the unpadded run's own zero padding
covers). Then:

* every convolution over frames that reads past its input's end (wav2vec2's positional convolution) gets
  its input multiplied by the mask, so the frames it reads past the last real one are 0, as the
  unpadded run's zero padding is;
* every Softmax over key frames gets ``Where(keep, scores, lowest)``, so padded keys weigh exactly 0;
* every ReduceMean over frames (a classification head's pooling) becomes a sum over kept frames divided
  by their number.

With a mask of ones (no padding) the graph computes what it computed before. Where frames go is
followed by dataflow from the audio input; an op this pass does not understand ends the path, and
nothing below it is changed. Whether padding is then invisible is the padding proof's decision, never
this pass's: normalisation over time (wav2vec2-base's GroupNorm) stays visible, and the proof names it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from optimum_ipu_backend.compiler.graphs import GraphView, NodeSplice, attribute, infer_shapes, shape_view
from optimum_ipu_backend.compiler.padding.evaluate import EvaluationError, Evaluator
from optimum_ipu_backend.compiler.padding.rules import reshape_groups
from optimum_ipu_backend.compiler.passes.rewrites.common import FLOAT_TYPES

MASK_INPUT = "ipu_sample_mask"
PADDING_SIDE = "right"

#: Sample counts and batch sizes at which shapes are inferred to check where frames go. Two probes
#: with different batches and lengths: an axis follows the frames only where both agree it does.
_PROBES = ((2, 16000), (3, 23917))

_SAME_LAYOUT = frozenset(
    {
        "Identity",
        "Cast",
        "Erf",
        "Relu",
        "Sigmoid",
        "Tanh",
        "Sqrt",
        "Exp",
        "Log",
        "Neg",
        "Abs",
        "Softplus",
        "Gelu",
        "Reciprocal",
        "Not",
        "LeakyRelu",
        "Elu",
        "Dropout",
    }
)
_BROADCASTING = frozenset(
    {"Add", "Sub", "Mul", "Div", "Pow", "Where", "Min", "Max", "Equal", "Less", "Greater", "And", "Or"}
)
_INDEX_TYPES = frozenset({TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL})
#: Integer tensors up to this many elements are evaluated while probing shapes (sizes, reshape targets).
_SMALL = 64
# Ops that read no values: their outputs are sizes, the same whatever the data.
_SHAPE_ONLY = frozenset({"Shape", "Size"})

# An axis label: the factors an axis is made of, outermost first. "B" is the batch, "T<k>" frames of
# kind k, an int a fixed-size factor merged with them (heads); () for an axis with neither.
Label = tuple[object, ...]


@dataclass(frozen=True)
class AudioFrameMaskRewrite:
    """An audio encoder that accepts right-padded samples plus :attr:`mask_input`, and what was changed."""

    model: onnx.ModelProto
    #: Graph input ``[batch, samples]``, int64: 1 for a real sample, 0 for padding.
    mask_input: str
    #: The ``dim_param`` of the audio input's samples axis (axis 1), e.g. ``"sequence_length"``.
    samples_dim: str
    #: The ``dim_param`` of the audio input's batch axis.
    batch_dim: str
    #: The audio input the mask describes.
    audio_input: str
    #: Where the padding goes: always ``"right"`` (real samples first).
    padding_side: str = PADDING_SIDE
    #: Convolutions over frames whose input is now multiplied by the frame mask.
    zeroed_convs: tuple[str, ...] = field(default=())
    #: Softmax nodes over key frames whose input is now masked.
    masked_softmaxes: tuple[str, ...] = field(default=())
    #: ReduceMean nodes over frames replaced by a mean over the kept frames (names of the replaced nodes;
    #: their output keeps its name).
    masked_means: tuple[str, ...] = field(default=())


def add_audio_frame_mask(model: onnx.ModelProto) -> AudioFrameMaskRewrite | None:
    """Return a copy of ``model`` that takes a mask over right-padded samples, or None when it needs none.

    None means the graph has no rank-2 float input read as the spatial axis of a convolution (no raw
    audio), already has an input over the samples (a mask of its own), or has nothing the mask would
    change. Raises ValueError naming what it could not find when the audio input's axes are not named
    dynamic axes. ``model`` itself is not modified.
    """
    graph = model.graph
    if any(vi.name == MASK_INPUT for vi in graph.input):
        return None
    initializers = {init.name for init in graph.initializer}
    if not any(
        vi.name not in initializers
        and vi.type.tensor_type.elem_type in FLOAT_TYPES
        and len(vi.type.tensor_type.shape.dim) == 2
        for vi in graph.input
    ):
        return None  # no rank-2 float input: no raw audio, and no shape inference spent to find out
    facts = GraphView.of_model(model)
    audio = _audio_input(facts)
    if audio is None:
        return None
    dims = audio.type.tensor_type.shape.dim
    if not dims[0].dim_param or not dims[1].dim_param:
        raise ValueError(
            f"the audio input {audio.name!r} has axes {[d.dim_param or d.dim_value for d in dims]}; "
            "add_audio_frame_mask needs [batch, samples] exported as named dynamic axes"
        )
    batch_dim, samples_dim = dims[0].dim_param, dims[1].dim_param
    if _has_mask_over_samples(graph, audio.name, samples_dim):
        return None
    plan = _Tracker(model, facts, audio.name).run()
    if not (plan.convs or plan.softmaxes or plan.means):
        return None
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    _Rewriter(rewritten, facts, batch_dim, samples_dim).apply(plan)
    return AudioFrameMaskRewrite(
        model=rewritten,
        mask_input=MASK_INPUT,
        samples_dim=samples_dim,
        batch_dim=batch_dim,
        audio_input=audio.name,
        zeroed_convs=tuple(site.node.name for site in plan.convs),
        masked_softmaxes=tuple(site.node.name for site in plan.softmaxes),
        masked_means=tuple(site.node.name for site in plan.means),
    )


# ----------------------------------------------------------------------------------------------------
# The audio input
# ----------------------------------------------------------------------------------------------------


def _audio_input(facts: GraphView) -> onnx.ValueInfoProto | None:
    """The rank-2 float graph input that reaches, through Unsqueeze and elementwise ops with constants, a
    Conv as its spatial axis (axis 1 of the input, the batch on axis 0)."""
    found = []
    for vi in facts.graph.input:
        if vi.name not in facts.graph_inputs:
            continue
        tensor_type = vi.type.tensor_type
        if tensor_type.elem_type not in FLOAT_TYPES or len(tensor_type.shape.dim) != 2:
            continue
        if _reaches_conv_as_samples(facts, vi.name):
            found.append(vi)
    if len(found) > 1:
        raise ValueError(f"more than one input reads as raw audio: {[vi.name for vi in found]}")
    return found[0] if found else None


def _reaches_conv_as_samples(facts: GraphView, name: str) -> bool:
    frontier = [(name, (0, 1))]  # (tensor, (batch axis, samples axis))
    while frontier:
        current, (batch, samples) = frontier.pop()
        for node, index in facts.consumers.get(current, []):
            if node.op_type == "Conv" and index == 0:
                if (batch, samples) == (0, 2) and facts.rank(current) == 3:
                    return True
                continue
            if node.op_type == "Unsqueeze" and index == 0:
                axes = _constant_axes(facts, node)
                out_rank = (facts.rank(current) or 2) + len(axes or [])
                if axes is None:
                    continue
                axes = sorted(a % out_rank for a in axes)
                moved = []
                for axis in (batch, samples):
                    for inserted in axes:
                        if inserted <= axis:
                            axis += 1
                    moved.append(axis)
                frontier.append((node.output[0], (moved[0], moved[1])))
            elif node.op_type in ("Cast", "Identity") or (
                node.op_type in ("Mul", "Div", "Add", "Sub")
                and all(facts.is_constant(i) for j, i in enumerate(node.input) if j != index)
                and facts.rank(node.output[0]) == facts.rank(current)
            ):
                frontier.append((node.output[0], (batch, samples)))
    return False


def _has_mask_over_samples(graph: onnx.GraphProto, audio: str, samples_dim: str) -> bool:
    """Whether another input of rank 2 spans the samples (an exported attention mask)."""
    for vi in graph.input:
        dims = vi.type.tensor_type.shape.dim
        if vi.name != audio and len(dims) == 2 and dims[1].dim_param == samples_dim:
            return True
    return False


def _constant_axes(facts: GraphView, node: onnx.NodeProto) -> list[int] | None:
    axes = attribute(node, "axes")
    if axes is not None:
        return list(axes)
    if len(node.input) > 1 and node.input[1]:
        value = facts.constant(node.input[1])
        return None if value is None else [int(v) for v in np.asarray(value).reshape(-1)]
    return None


# ----------------------------------------------------------------------------------------------------
# Following the frames
# ----------------------------------------------------------------------------------------------------


@dataclass
class _Kind:
    """One frame rate (or one set of kept frames) and how its mask is made from its parent's."""

    sizes: tuple[int, int]  # the axis length at the two probes
    how: str  # "samples", "window", "shift", "slice", "both"
    parents: tuple[int, ...] = ()
    node: onnx.NodeProto | None = None
    kernel: int = 1
    stride: int = 1
    shift: int = 0  # "shift": kept positions are those whose index minus this is kept in the parent


@dataclass
class _Site:
    node: onnx.NodeProto
    kind: int  # frame kind of the masked axis
    axis: int  # the masked axis (key axis, conv spatial axis, mean axis)
    batch_axis: int
    rank: int


@dataclass
class _Plan:
    kinds: list[_Kind]
    convs: list[_Site]
    softmaxes: list[_Site]
    means: list[_Site]


class _Tracker:
    """Walks the graph in order and labels, per tensor computed from the audio, its batch and frame axes."""

    def __init__(self, model: onnx.ModelProto, facts: GraphView, audio: str) -> None:
        self.facts = facts
        self.audio = audio
        probes = [_probe_shapes(model, audio, probe) for probe in _PROBES]
        self.shapes = [shapes for shapes, _ in probes]
        self.values = [values for _, values in probes]
        self.labels: dict[str, list[Label]] = {}
        self.tainted: set[str] = {audio}  # computed from the audio, labelled or not
        self.kinds: list[_Kind] = [_Kind((_PROBES[0][1], _PROBES[1][1]), "samples")]
        self.combined: dict[tuple[int, int], int] = {}
        self.plan = _Plan(self.kinds, [], [], [])

    def run(self) -> _Plan:
        self.labels[self.audio] = [("B",), ("T0",)]
        for node in self.facts.nodes:
            read = [i for i in node.input if i in self.tainted]
            if not read:
                continue
            if node.op_type in _SHAPE_ONLY:
                continue
            outputs = self._follow(node)
            for output in node.output:
                if output:
                    self.tainted.add(output)
            if outputs is not None:
                for output, labels in zip(node.output, outputs, strict=False):
                    if output and labels is not None and self._probe_rank(output) == len(labels):
                        self.labels[output] = labels
        return self.plan

    # -- probe facts -------------------------------------------------------------------------------

    def _probe(self, name: str) -> list[tuple[int, ...]] | None:
        shapes = [found.get(name) for found in self.shapes]
        if any(shape is None for shape in shapes):
            return None
        return shapes  # type: ignore[return-value]

    def _probe_rank(self, name: str) -> int | None:
        shapes = self._probe(name)
        return None if shapes is None else len(shapes[0])

    def _sizes(self, name: str, axis: int) -> tuple[int, int] | None:
        shapes = self._probe(name)
        if shapes is None:
            return None
        return shapes[0][axis], shapes[1][axis]

    def _factor_sizes(self, factor: object) -> tuple[int, int]:
        if factor == "B":
            return _PROBES[0][0], _PROBES[1][0]
        if isinstance(factor, str):
            return self.kinds[int(factor[1:])].sizes
        return int(factor), int(factor)  # type: ignore[call-overload]

    def _usable(self, name: str) -> bool:
        """An operand that is labelled, or holds no audio-dependent values (weights, positions)."""
        return name in self.labels or name not in self.tainted

    # -- per op ------------------------------------------------------------------------------------

    def _follow(self, node: onnx.NodeProto) -> list[list[Label] | None] | None:
        op = node.op_type
        data = node.input[0] if node.input else ""
        if op in _SAME_LAYOUT:
            return [self.labels[data]] if data in self.labels else None
        if op in _BROADCASTING:
            return self._broadcast(node)
        if op == "Transpose":
            labels = self.labels.get(data)
            if labels is None:
                return None
            perm = attribute(node, "perm", list(range(len(labels)))[::-1])
            return [[labels[p] for p in perm]]
        if op in ("Unsqueeze", "Squeeze"):
            return self._unsqueeze(node)
        if op in ("LayerNormalization", "InstanceNormalization", "GroupNormalization"):
            return self._normalization(node)
        if op == "MatMul":
            return self._matmul(node)
        if op == "Gemm":
            return self._gemm(node)
        if op == "Reshape":
            return self._reshape(node)
        if op == "Slice":
            return self._slice(node)
        if op == "Split":
            return self._split(node)
        if op == "Softmax":
            return self._softmax(node)
        if op == "ReduceMean" or op == "ReduceSum":
            return self._reduce(node)
        if op == "Conv":
            return self._conv(node)
        return None

    def _broadcast(self, node: onnx.NodeProto) -> list[list[Label] | None] | None:
        operands = [i for i in node.input if i]
        if not all(self._usable(i) for i in operands):
            return None
        out = self._probe(node.output[0])
        if out is None:
            return None
        rank = len(out[0])
        labels: list[Label] = [()] * rank
        for operand in operands:
            own = self.labels.get(operand)
            if own is None:
                continue
            shapes = self._probe(operand)
            if shapes is None:
                return None
            offset = rank - len(own)
            for axis, label in enumerate(own):
                target = axis + offset
                if not label or shapes[0][axis] == 1 or shapes[1][axis] == 1:
                    continue
                if (shapes[0][axis], shapes[1][axis]) != (out[0][target], out[1][target]):
                    return None
                merged = self._merge_labels(labels[target], label)
                if merged is None:
                    return None
                labels[target] = merged
        return [labels]

    def _merge_labels(self, left: Label, right: Label) -> Label | None:
        if not left or left == right:
            return right
        if not right:
            return left
        # The same frames kept by two masks (the positional convolution's output added back): keep
        # only frames both keep.
        if len(left) == len(right) == 1 and str(left[0]).startswith("T") and str(right[0]).startswith("T"):
            a, b = int(str(left[0])[1:]), int(str(right[0])[1:])
            if self.kinds[a].sizes != self.kinds[b].sizes:
                return None
            key = (min(a, b), max(a, b))
            if key not in self.combined:
                self.kinds.append(_Kind(self.kinds[a].sizes, "both", key))
                self.combined[key] = len(self.kinds) - 1
            return (f"T{self.combined[key]}",)
        return None

    def _unsqueeze(self, node: onnx.NodeProto) -> list[list[Label] | None] | None:
        labels = self.labels.get(node.input[0])
        axes = _constant_axes(self.facts, node)
        out_rank = self._probe_rank(node.output[0])
        if labels is None or out_rank is None:
            return None
        result = list(labels)
        if node.op_type == "Unsqueeze":
            if axes is None:
                return None
            for axis in sorted(a % out_rank for a in axes):
                result.insert(axis, ())
        else:
            in_shapes = self._probe(node.input[0])
            if in_shapes is None:
                return None
            if axes is None:
                axes = [a for a, s in enumerate(in_shapes[0]) if s == 1 and in_shapes[1][a] == 1]
            for axis in sorted((a % len(labels) for a in axes), reverse=True):
                if result[axis]:
                    return None
                del result[axis]
        return [result]

    def _normalization(self, node: onnx.NodeProto) -> list[list[Label] | None] | None:
        labels = self.labels.get(node.input[0])
        if labels is None or not all(self._usable(i) for i in node.input[1:] if i):
            return None
        if node.op_type == "LayerNormalization":
            first = attribute(node, "axis", -1) % len(labels)
            if any(labels[a] for a in range(first, len(labels))):
                return None
        # Instance/GroupNormalization normalise over the spatial (frame) axis: the layout is kept, and
        # the padding proof decides (and names this node) when padding shows.
        return [labels]

    def _matmul(self, node: onnx.NodeProto) -> list[list[Label] | None] | None:
        a, b = node.input[0], node.input[1]
        if not (self._usable(a) and self._usable(b)):
            return None
        la, lb = self.labels.get(a), self.labels.get(b)
        ra, rb = self._probe_rank(a), self._probe_rank(b)
        if ra is None or rb is None or ra < 2 or rb < 2:
            return None
        la = la or [()] * ra
        lb = lb or [()] * rb
        if la[-1] != lb[-2]:
            return None  # a sum over frames in one operand only
        if la[-1] and not (len(la[-1]) == 1 and str(la[-1][0]).startswith("T")):
            return None
        rank = max(ra, rb)
        batch: list[Label] = []
        for axis in range(rank - 2):
            own_a = la[axis - (rank - ra)] if axis >= rank - ra else ()
            own_b = lb[axis - (rank - rb)] if axis >= rank - rb else ()
            merged = self._merge_labels(own_a, own_b)
            if merged is None:
                return None
            batch.append(merged)
        return [[*batch, la[-2], lb[-1]]]

    def _gemm(self, node: onnx.NodeProto) -> list[list[Label] | None] | None:
        labels = self.labels.get(node.input[0])
        if labels is None or any(i in self.tainted for i in node.input[1:] if i):
            return None
        if attribute(node, "transA", 0):
            return None
        if labels[1]:
            return None
        return [[labels[0], ()]]

    def _reshape(self, node: onnx.NodeProto) -> list[list[Label] | None] | None:
        labels = self.labels.get(node.input[0])
        shapes_in, shapes_out = self._probe(node.input[0]), self._probe(node.output[0])
        if labels is None or shapes_in is None or shapes_out is None:
            return None
        groups = reshape_groups(shapes_in[0], shapes_in[1], shapes_out[0], shapes_out[1])
        if groups is None:
            return None
        result: list[Label] = [()] * len(shapes_out[0])
        for in_axes, out_axes in groups:
            if len(in_axes) == 1 and len(out_axes) == 1:
                result[out_axes[0]] = labels[in_axes[0]]
                continue
            factors: list[object] = []
            for axis in in_axes:
                if labels[axis]:
                    factors.extend(labels[axis])
                elif shapes_in[0][axis] != shapes_in[1][axis]:
                    return None  # an axis that changes with the input, of unknown meaning
                elif shapes_in[0][axis] != 1:
                    factors.append(shapes_in[0][axis])
            if not any(isinstance(f, str) for f in factors):
                continue
            # Hand the factors out to the output axes of the group, outermost first.
            position = 0
            for axis in out_axes:
                wanted = (shapes_out[0][axis], shapes_out[1][axis])
                taken: list[object] = []
                size = (1, 1)
                while size != wanted and position < len(factors):
                    factor = factors[position]
                    factor_sizes = self._factor_sizes(factor)
                    ratio = (wanted[0] // size[0], wanted[1] // size[1])
                    if (
                        isinstance(factor, int)
                        and ratio[0] == ratio[1]
                        and factor % ratio[0] == 0 < factor // ratio[0]
                    ):
                        if ratio[0] < factor and ratio[0] * size[0] == wanted[0]:
                            # A fixed factor split in two (hidden size into heads x head size).
                            factors[position] = factor // ratio[0]
                            factor, factor_sizes = ratio[0], (ratio[0], ratio[0])
                            position -= 1
                    size = (size[0] * factor_sizes[0], size[1] * factor_sizes[1])
                    taken.append(factor)
                    position += 1
                if size != wanted:
                    return None
                result[axis] = tuple(taken) if any(isinstance(f, str) for f in taken) else ()
            if position != len(factors):
                return None
        return [result]

    def _slice(self, node: onnx.NodeProto) -> list[list[Label] | None] | None:
        labels = self.labels.get(node.input[0])
        if labels is None or any(i in self.tainted for i in node.input[1:] if i):
            return None
        controls = [self._control(i) if i else (None, None) for i in node.input[1:5]]
        controls += [(None, None)] * (4 - len(controls))
        if any((a is None) != (b is None) for a, b in controls):
            return None
        starts, ends, axes, steps = (a for a, _ in controls)
        if starts is None or ends is None or not np.array_equal(axes, controls[2][1]):
            return None
        rank = len(labels)
        axes_list = list(range(len(starts))) if axes is None else [int(a) % rank for a in axes.reshape(-1)]
        result = list(labels)
        for position, axis in enumerate(axes_list):
            label = labels[axis]
            if not label:
                continue
            step = 1 if steps is None else int(steps.reshape(-1)[position])
            start = int(starts.reshape(-1)[position])
            other_steps, other_starts = controls[3][1], controls[0][1]
            if (other_steps is not None and int(other_steps.reshape(-1)[position]) != step) or int(
                other_starts.reshape(-1)[position]
            ) != start:
                return None
            sizes = self._sizes(node.output[0], axis)
            if (
                len(label) != 1
                or not str(label[0]).startswith("T")
                or step != 1
                or start != 0
                or sizes is None
            ):
                return None
            # Keeping a prefix of the frames: the mask is cut the same way.
            parent = int(str(label[0])[1:])
            parent_sizes = self.kinds[parent].sizes
            if sizes == parent_sizes:
                continue
            if sizes[0] - parent_sizes[0] != sizes[1] - parent_sizes[1] or sizes[0] >= parent_sizes[0]:
                return None  # only a fixed number of frames cut off the end is followed
            self.kinds.append(_Kind(sizes, "slice", (parent,)))
            result[axis] = (f"T{len(self.kinds) - 1}",)
        return [result]

    def _control(self, name: str) -> tuple[np.ndarray | None, np.ndarray | None]:
        """A small integer operand's value at the two probes (a constant, or computed from sizes)."""
        constant = self.facts.constant(name)
        if constant is not None:
            return constant, constant
        if name in self.tainted:
            return None, None
        return self.values[0].get(name), self.values[1].get(name)

    def _split(self, node: onnx.NodeProto) -> list[list[Label] | None] | None:
        labels = self.labels.get(node.input[0])
        if labels is None or any(i in self.tainted for i in node.input[1:] if i):
            return None
        axis = attribute(node, "axis", 0) % len(labels)
        if labels[axis]:
            return None
        return [labels for _ in node.output]

    def _batch_axis(self, labels: Sequence[Label]) -> int | None:
        found = [axis for axis, label in enumerate(labels) if label == ("B",)]
        return found[0] if len(found) == 1 else None

    def _softmax(self, node: onnx.NodeProto) -> list[list[Label] | None] | None:
        labels = self.labels.get(node.input[0])
        if labels is None:
            return None
        axis = attribute(node, "axis", -1) % len(labels)
        label = labels[axis]
        if not label:
            return [labels]
        batch = self._batch_axis(labels)
        if len(label) != 1 or not str(label[0]).startswith("T") or batch is None:
            return None
        kind = int(str(label[0])[1:])
        self.plan.softmaxes.append(_Site(node, kind, axis, batch, len(labels)))
        return [labels]

    def _reduce(self, node: onnx.NodeProto) -> list[list[Label] | None] | None:
        labels = self.labels.get(node.input[0])
        if labels is None or any(i in self.tainted for i in node.input[1:] if i):
            return None
        axes = _constant_axes(self.facts, node)
        rank = len(labels)
        if axes is None or not axes:
            return None
        axes = sorted({a % rank for a in axes})
        labelled = [a for a in axes if labels[a]]
        keepdims = attribute(node, "keepdims", 1)
        remaining = [() if a in axes else labels[a] for a in range(rank)]
        if not keepdims:
            remaining = [labels[a] for a in range(rank) if a not in axes]
        if not labelled:
            return [remaining]
        batch = self._batch_axis(labels)
        label = labels[labelled[0]]
        if (
            node.op_type != "ReduceMean"
            or len(labelled) != 1
            or len(label) != 1
            or not str(label[0]).startswith("T")
            or batch is None
        ):
            return None
        self.plan.means.append(_Site(node, int(str(label[0])[1:]), labelled[0], batch, rank))
        return [remaining]

    def _conv(self, node: onnx.NodeProto) -> list[list[Label] | None] | None:
        labels = self.labels.get(node.input[0])
        if labels is None or len(labels) != 3 or labels[0] != ("B",) or labels[1]:
            return None
        if any(i in self.tainted for i in node.input[1:] if i):
            return None
        label = labels[2]
        if len(label) != 1 or not str(label[0]).startswith("T"):
            return None
        sizes = self._sizes(node.output[0], 2)
        weight = self.facts.type_of(node.input[1])
        kernel = attribute(node, "kernel_shape", None)
        if kernel is None and weight is not None and weight.tensor_type.HasField("shape"):
            kernel = [d.dim_value for d in weight.tensor_type.shape.dim[2:]]
        if sizes is None or not kernel or attribute(node, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            return None
        k = int(kernel[0])
        stride = int(attribute(node, "strides", [1])[0])
        dilation = int(attribute(node, "dilations", [1])[0])
        begin, end = (int(p) for p in attribute(node, "pads", [0, 0]))
        parent = int(str(label[0])[1:])
        if begin == end == 0 and dilation == 1:
            # A frame is kept when every position its window reads is kept.
            self.kinds.append(_Kind(sizes, "window", (parent,), node, kernel=k, stride=stride))
        elif stride == 1 and begin + end >= dilation * (k - 1):
            # Reads past the end: zero what is not kept, so those reads see 0 as the unpadded run's
            # own zero padding does. Output j is then kept when j - shift is (the last window position
            # it reads, minus the padding past the end, is a kept position).
            shift = begin + end - dilation * (k - 1)
            self.kinds.append(_Kind(sizes, "shift", (parent,), node, shift=shift))
            self.plan.convs.append(_Site(node, parent, 2, 0, 3))
        else:
            return None
        return [[("B",), (), (f"T{len(self.kinds) - 1}",)]]


def _probe_shapes(
    model: onnx.ModelProto, audio: str, probe: tuple[int, int]
) -> tuple[dict[str, tuple[int, ...]], dict[str, np.ndarray]]:
    """Every tensor's static shape with the audio input at ``probe`` (batch, samples).

    onnx's shape inference first; where it loses track (a reshape target computed from sizes by ops its
    data propagation does not follow), node by node, with the small integer tensors computed from
    sizes and constants evaluated, so each node's inference sees concrete targets.
    """
    view = shape_view(model)
    for vi in view.graph.input:
        if vi.name == audio:
            for dim, size in zip(vi.type.tensor_type.shape.dim, probe, strict=True):
                dim.Clear()
                dim.dim_value = size
    inferred = infer_shapes(view, propagate_data=True)
    shapes: dict[str, tuple[int, ...]] = {}
    types: dict[str, int] = {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        tensor_type = vi.type.tensor_type
        types[vi.name] = tensor_type.elem_type
        if tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in tensor_type.shape.dim):
            shapes[vi.name] = tuple(d.dim_value for d in tensor_type.shape.dim)
    values: dict[str, np.ndarray] = {}
    for init in model.graph.initializer:
        shapes[init.name] = tuple(init.dims)
        types[init.name] = init.data_type
        if init.data_type in _INDEX_TYPES and int(np.prod(init.dims)) <= _SMALL:
            values[init.name] = numpy_helper.to_array(init)
    evaluator = Evaluator(model)
    opsets = list(model.opset_import)
    for node in model.graph.node:
        inputs = [i for i in node.input if i]
        if node.op_type == "Shape" and node.input[0] in shapes:
            start = attribute(node, "start", 0)
            end = attribute(node, "end", None)
            values[node.output[0]] = np.array(shapes[node.input[0]][start:end], np.int64)
        elif node.op_type == "Constant" or (inputs and all(i in values for i in inputs)):
            try:
                results = evaluator.run(node, [values[i] if i else None for i in node.input])
            except EvaluationError:
                results = []
            for output, result in zip(node.output, results, strict=False):
                if result.size <= _SMALL and result.dtype.kind in "iub":
                    values[output] = result
                shapes[output] = tuple(result.shape)
        if all(o in shapes for o in node.output if o):
            continue
        if not all(i in shapes for i in inputs):
            continue
        shapes.update(_infer_node(node, shapes, types, values, opsets))
    return shapes, values


def _infer_node(
    node: onnx.NodeProto,
    shapes: dict[str, tuple[int, ...]],
    types: dict[str, int],
    values: dict[str, np.ndarray],
    opsets: list[onnx.OperatorSetIdProto],
) -> dict[str, tuple[int, ...]]:
    """One node's output shapes by onnx's inference, its small integer inputs given as constants."""
    inputs, initializers = [], []
    for name in dict.fromkeys(i for i in node.input if i):
        if name in values:
            initializers.append(numpy_helper.from_array(values[name], name))
        else:
            inputs.append(
                helper.make_tensor_value_info(name, types.get(name) or TensorProto.FLOAT, shapes[name])
            )
    outputs = [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in node.output if o]
    graph = helper.make_graph([node], "probe", inputs, outputs, initializers)
    try:
        inferred = infer_shapes(helper.make_model(graph, opset_imports=opsets), propagate_data=True)
    except Exception:  # a node onnx cannot infer alone: its outputs stay unknown, and are not followed
        return {}
    found = {}
    for vi in [*inferred.graph.output, *inferred.graph.value_info]:
        tensor_type = vi.type.tensor_type
        if tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in tensor_type.shape.dim):
            found[vi.name] = tuple(d.dim_value for d in tensor_type.shape.dim)
            types.setdefault(vi.name, tensor_type.elem_type)
    return found


# ----------------------------------------------------------------------------------------------------
# The rewrite
# ----------------------------------------------------------------------------------------------------


class _Rewriter(NodeSplice):
    """Adds the mask input, the frame masks and the masked sites to ``model`` (a copy the caller owns)."""

    def __init__(self, model: onnx.ModelProto, facts: GraphView, batch_dim: str, samples_dim: str) -> None:
        super().__init__(model, "/ipu_sample_mask/")
        self.facts = facts
        self.batch_dim = batch_dim
        self.samples_dim = samples_dim
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 18)
        self._masks: dict[int, str] = {}
        self._broadcasts: dict[tuple, str] = {}

    def _axes_node(
        self,
        where,
        op_type: str,
        inputs: list[str],
        axes: Sequence[int],
        hint: str,
        output=None,
        **attributes,
    ) -> str:
        """Unsqueeze/Squeeze/ReduceSum/ReduceMax with ``axes`` as the opset wants them."""
        since = {"Unsqueeze": 13, "Squeeze": 13, "ReduceSum": 13, "ReduceMax": 18}[op_type]
        if self.opset >= since:
            axes_name = self.constant(np.array(list(axes), np.int64), f"{hint}_axes")
            return self.node(where, op_type, [*inputs, axes_name], hint, output, **attributes)
        return self.node(where, op_type, inputs, hint, output, axes=list(axes), **attributes)

    def apply(self, plan: _Plan) -> None:
        self.graph.input.append(
            helper.make_tensor_value_info(MASK_INPUT, TensorProto.INT64, [self.batch_dim, self.samples_dim])
        )
        self.kinds = plan.kinds
        position = self.facts.position
        for site in plan.convs:
            index = position[id(site.node)]
            mask = self._broadcast(site, TensorProto.FLOAT)
            self.renamed_input[(index, 0)] = self.node(
                self.before[index], "Mul", [site.node.input[0], mask], "zeroed_frames"
            )
        for site in plan.softmaxes:
            index = position[id(site.node)]
            keep = self._broadcast(site, TensorProto.BOOL)
            scores = site.node.input[0]
            dtype = helper.tensor_dtype_to_np_dtype(self.facts.elem_type(scores) or TensorProto.FLOAT)
            # The lowest finite value, as HF's own masks use: its softmax weight next to a real score is 0.
            lowest = self.constant(np.array(np.finfo(dtype).min, dtype), "lowest")
            self.renamed_input[(index, 0)] = self.node(
                self.before[index], "Where", [keep, scores, lowest], "masked_scores"
            )
        for site in plan.means:
            self._masked_mean(site)
        self.splice()

    # -- the frame masks -----------------------------------------------------------------------------

    def _mask(self, kind: int) -> str:
        """The float mask ``[batch, frames]`` of frame kind ``kind`` (1 kept, 0 not), built up front."""
        if kind in self._masks:
            return self._masks[kind]
        spec = self.kinds[kind]
        front = self.front
        if spec.how == "samples":
            mask = self.node(front, "Cast", [MASK_INPUT], "samples", to=TensorProto.FLOAT)
        elif spec.how == "window":
            # kept = 1 - MaxPool(1 - parent): a frame is kept when no position its window reads is not.
            parent = self._mask(spec.parents[0])
            one = self.constant(np.array(1.0, np.float32), "one")
            dropped = self.node(front, "Sub", [one, parent], "dropped")
            dropped = self._axes_node(front, "Unsqueeze", [dropped], [1], "dropped_channel")
            pooled = self.node(
                front,
                "MaxPool",
                [dropped],
                "dropped_window",
                kernel_shape=[spec.kernel],
                strides=[spec.stride],
            )
            pooled = self._axes_node(front, "Squeeze", [pooled], [1], "dropped_frames")
            mask = self.node(front, "Sub", [one, pooled], "kept_frames")
        elif spec.how == "shift":
            # Output j is kept when j - shift is kept in the parent (or j - shift < 0): the parent
            # shifted right by ``shift`` with ones in front; as long as the output, stride 1.
            parent = self._mask(spec.parents[0])
            pads = self.constant(np.array([0, spec.shift, 0, 0], np.int64), "shift_pads")
            ones = self.constant(np.array(1.0, np.float32), "one")
            mask = self.node(front, "Pad", [parent, pads, ones], "shifted_frames", mode="constant")
        elif spec.how == "slice":
            parent = self._mask(spec.parents[0])
            # A prefix of the parent's frames, as long as the sliced tensor's frame axis: the tensor's
            # frame count is taken from the sliced mask's own length at run time by the same Slice.
            start = self.constant(np.array([0], np.int64), "slice_start")
            axis = self.constant(np.array([1], np.int64), "slice_axis")
            end = self.constant(
                np.array([spec.sizes[0] - self.kinds[spec.parents[0]].sizes[0]], np.int64), "slice_end"
            )
            mask = self.node(front, "Slice", [parent, start, end, axis], "sliced_frames")
        else:  # "both"
            left, right = (self._mask(p) for p in spec.parents)
            mask = self.node(front, "Mul", [left, right], "kept_by_both")
        self._masks[kind] = mask
        return mask

    def _broadcast(self, site: _Site, elem_type: int) -> str:
        """The mask of ``site``'s kind shaped to broadcast over its tensor, as ``elem_type``."""
        key = (site.kind, site.batch_axis, site.axis, site.rank, elem_type)
        if key in self._broadcasts:
            return self._broadcasts[key]
        mask = self._mask(site.kind)
        front = self.front
        if site.batch_axis > site.axis:
            mask = self.node(front, "Transpose", [mask], "frames_first", perm=[1, 0])
        others = [a for a in range(site.rank) if a not in (site.batch_axis, site.axis)]
        if others:
            mask = self._axes_node(front, "Unsqueeze", [mask], others, "mask_broadcast")
        if elem_type != TensorProto.FLOAT:
            mask = self.node(front, "Cast", [mask], "mask_cast", to=elem_type)
        self._broadcasts[key] = mask
        return mask

    def _masked_mean(self, site: _Site) -> None:
        """``ReduceMean(x, frames)`` as ``ReduceSum(x * mask, frames) / ReduceSum(mask, frames)``."""
        index = self.facts.position[id(site.node)]
        node = site.node
        before = self.before[index]
        mask = self._broadcast(site, TensorProto.FLOAT)
        keepdims = attribute(node, "keepdims", 1)
        axes = _constant_axes(self.facts, node) or []
        axes = sorted({a % site.rank for a in axes})
        masked = self.node(before, "Mul", [node.input[0], mask], "masked_frames")
        total = self._axes_node(before, "ReduceSum", [masked], axes, "frame_sum", keepdims=keepdims)
        count = self._axes_node(before, "ReduceSum", [mask], axes, "frame_count", keepdims=keepdims)
        self.node(before, "Div", [total, count], "frame_mean", output=node.output[0])
        self.replaced.add(index)
