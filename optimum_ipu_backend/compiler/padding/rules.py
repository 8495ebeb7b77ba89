"""How each operator carries padding: the transfer rules of the padding proof for ``Data`` operands.

A rule receives the node's inputs (``Concrete`` or ``Data``, at least one ``Data``) and returns its
outputs as ``Data``. It must be sound: an output element may be called exact only if, in the padded
run, it holds exactly what the unpadded run holds at the element its maps name. Operators that mix
positions along an axis that has padding (convolutions, reductions, cumulative sums, contractions)
are exact only where the padded elements provably contribute nothing: a zero weight times a finite
value, a masked softmax score, a sum over zeros. Everything else is reported as inexact with the node
and the reason, which is what users see when an axis cannot be padded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import onnx

from ..graphs import INTEGER_TYPES, attribute, attributes
from . import classes as C
from .evaluate import EvaluationError, Evaluator, reshape_target, slice_indices
from .values import (
    AxisMap,
    Concrete,
    Data,
    Layouts,
    agree,
    complete,
    elem_type_of,
    expand_axis,
    identity_or,
    real_coordinates,
    real_grid,
    to_data,
)

Value = Concrete | Data

#: Element-count limit for tracking single elements through index-moving operators.
ELEMENT_LIMIT = 1 << 22


class ProofAborted(Exception):
    """The proof cannot go on: a shape depends on user data, or an operator it cannot follow."""


@dataclass
class SoftmaxSite:
    """A softmax over an axis with padding whose real rows may, depending on user data, have every
    real element masked; the runtime must check its data (see ``Obligation``)."""

    node: str  # for messages
    output: str  # identifies the site (node names may be empty)
    sources: frozenset[str]
    axis: int


@dataclass
class Context:
    layouts: Layouts
    evaluator: Evaluator
    #: Softmax nodes whose inputs' classes the current run records (by their output's name).
    watched: frozenset[str] = frozenset()
    recorded: dict[str, Data] = field(default_factory=dict)
    softmax_sites: list[SoftmaxSite] = field(default_factory=list)


def describe(node: onnx.NodeProto, reason: str) -> str:
    return f"node {node.name or '<unnamed>'!r} ({node.op_type}): {reason}"


# ----------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------


def _with_rank(array: np.ndarray, rank: int) -> np.ndarray:
    return array.reshape((1,) * (rank - array.ndim) + array.shape)


def _first_blame(*values: Value) -> str | None:
    for value in values:
        if isinstance(value, Data) and value.blame:
            return value.blame
    return None


def _sources(*values: Value | None) -> frozenset[str]:
    result: frozenset[str] = frozenset()
    for value in values:
        if isinstance(value, Data):
            result |= value.sources
    return result


def _concrete(node: onnx.NodeProto, value: Value | None, what: str) -> Concrete | None:
    """A control operand (shape, axes, indices...) that must not depend on user data."""
    if value is None or isinstance(value, Concrete):
        return value
    raise ProofAborted(describe(node, f"its {what} depends on user data, so its shape is not static"))


def _ints(value: Concrete | None, run: str) -> list[int] | None:
    if value is None:
        return None
    array = value.padded if run == "p" else value.unpadded
    return [int(v) for v in np.asarray(array).reshape(-1)]


def _finite(classes: np.ndarray) -> np.ndarray:
    return C.IS_FINITE[classes]


def as_data(value: Value, ctx: Context, hints: Sequence[AxisMap] | None = None) -> Data:
    return value if isinstance(value, Data) else to_data(value, ctx.layouts, hints)


def _normalize_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _full_facts(data: Data) -> tuple[np.ndarray, np.ndarray]:
    return np.broadcast_to(data.exact, data.shape), np.broadcast_to(data.classes, data.shape)


def _reduce_classes(classes: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """Class of a sum-like combination of elements: ZERO if all are, SMALL if all are ordinary."""
    if not axes:
        return classes
    bad = ~C.IS_UNMASKED[classes]
    all_zero = np.all(classes == C.ZERO, axis=axes, keepdims=True)
    return np.where(np.any(bad, axis=axes, keepdims=True), C.ANY, np.where(all_zero, C.ZERO, C.SMALL)).astype(
        np.int8
    )


def _padded_axes(data: Data, axes: Sequence[int]) -> list[int]:
    return [axis for axis in axes if data.maps[axis] is not None and np.any(data.maps[axis] < 0)]


def _remapped_axes(data: Data, axes: Sequence[int]) -> list[int]:
    """Axes among ``axes`` whose map is not the identity (padding, or a changed order)."""
    return [axis for axis in axes if data.maps[axis] is not None]


# ----------------------------------------------------------------------------------------------------
# Elementwise operators
# ----------------------------------------------------------------------------------------------------


def elementwise(
    ctx: Context,
    node: onnx.NodeProto,
    operands: Sequence[Value],
    combine: Callable[[list[np.ndarray]], np.ndarray],
    elem_type: int | None = None,
) -> Data:
    """Broadcasting elementwise operator; ``combine`` maps the operands' class arrays to the result's."""
    rank = max(_rank(op) for op in operands)
    shapes_p = [(1,) * (rank - _rank(op)) + _shape(op, "p") for op in operands]
    shapes_u = [(1,) * (rank - _rank(op)) + _shape(op, "u") for op in operands]
    try:
        out_p = tuple(np.broadcast_shapes(*shapes_p))
        out_u = tuple(np.broadcast_shapes(*shapes_u))
    except ValueError as error:
        # The graph ties an axis the runtime pads to one it does not (SD3's transformer adds its
        # ``timestep``, axis "step", to rows of axis "batch_size"): at the probed sizes the operands do
        # not broadcast, so no padded call of this graph can run.
        raise ProofAborted(
            describe(
                node,
                f"broadcasts operands of shapes {shapes_p} padded ({shapes_u} real), which do not agree: "
                "the graph ties a padded axis to one that is not padded",
            )
        ) from error
    maps: list[AxisMap] = []
    for axis in range(rank):
        axis_map: AxisMap = None
        found = False
        for op, shape in zip(operands, shapes_p, strict=True):
            if isinstance(op, Data) and shape[axis] == out_p[axis] and out_p[axis] != 1:
                own = op.maps[axis - (rank - op.rank)]
                axis_map = own if not found else agree(axis_map, own)
                found = True
        if not found and out_p[axis] != out_u[axis]:
            axis_map = ctx.layouts.lookup(out_p[axis], out_u[axis])
        maps.append(axis_map)
    datas: list[Data] = []
    blame = _first_blame(*operands)
    for op in operands:
        if isinstance(op, Data):
            datas.append(op)
            continue
        hints = [maps[axis + rank - op.padded.ndim] for axis in range(op.padded.ndim)]
        converted = to_data(op, ctx.layouts, hints)
        if blame is None and not converted.is_exact():
            blame = describe(
                node,
                "a value computed from sizes differs at real positions between the padded and the "
                "caller's sizes (for example positions counted from the padded length)",
            )
        datas.append(converted)
    exact = np.ones((1,) * rank, bool)
    for data in datas:
        exact = exact & _with_rank(data.exact, rank)
    classes = combine([_with_rank(data.classes, rank) for data in datas])
    return Data(
        out_p,
        out_u,
        tuple(maps),
        exact,
        classes,
        elem_type if elem_type is not None else datas[0].elem_type,
        _sources(*operands),
        blame,
    )


def _rank(value: Value) -> int:
    return value.padded.ndim if isinstance(value, Concrete) else value.rank


def _shape(value: Value, run: str) -> tuple[int, ...]:
    if isinstance(value, Concrete):
        return tuple(value.padded.shape if run == "p" else value.unpadded.shape)
    return value.shape if run == "p" else value.real_shape


def _table_combine(table: np.ndarray) -> Callable[[list[np.ndarray]], np.ndarray]:
    def combine(classes: list[np.ndarray]) -> np.ndarray:
        result = classes[0]
        for other in classes[1:]:
            result = table[result.astype(np.intp), other.astype(np.intp)]
        return result.astype(np.int8)

    return combine


def _unary_combine(table: np.ndarray) -> Callable[[list[np.ndarray]], np.ndarray]:
    return lambda classes: table[classes[0].astype(np.intp)].astype(np.int8)


def rule_binary(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    table = C.BINARY[node.op_type]
    elem_type = onnx.TensorProto.BOOL if node.op_type in _COMPARISONS else None
    operands = [v for v in inputs if v is not None]
    result = elementwise(ctx, node, operands, _table_combine(table), elem_type)
    if node.op_type in _NUMERIC_COMPARISONS and len(operands) == 2:
        result = _compared_with_constant(result, node.op_type, operands[0], operands[1])
    return [result]


_COMPARISONS = frozenset({"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor"})
_NUMERIC_COMPARISONS = {
    "Equal": np.equal,
    "Less": np.less,
    "Greater": np.greater,
    "LessOrEqual": np.less_equal,
    "GreaterOrEqual": np.greater_equal,
}


def _compared_with_constant(result: Data, op_type: str, left: Value, right: Value) -> Data:
    """A comparison of Data with a Concrete tensor: where a Data element's class says its value exactly
    (ZERO is 0, ONE is 1), the comparison's outcome is known from the constant's value at that element
    (a padded token id 1 is not the end-of-sentence id 2), where the class table alone knows only that
    1 and some other ordinary value compare either way."""
    if isinstance(left, Data) == isinstance(right, Data):
        return result
    data, constant = (left, right) if isinstance(left, Data) else (right, left)
    values = np.asarray(constant.padded)
    if values.dtype == np.bool_ or data.elem_type == onnx.TensorProto.BOOL or values.size > ELEMENT_LIMIT:
        return result
    rank = result.rank
    data_classes = _with_rank(data.classes, rank)
    known = (data_classes == C.ZERO) | (data_classes == C.ONE)
    if not np.any(known):
        return result
    data_values = np.where(data_classes == C.ONE, 1, 0).astype(values.dtype)
    values = _with_rank(values, rank)
    outcome = (
        _NUMERIC_COMPARISONS[op_type](data_values, values)
        if data is left
        else _NUMERIC_COMPARISONS[op_type](values, data_values)
    )
    classes = np.where(known, np.where(outcome, C.TRUE, C.FALSE), _with_rank(result.classes, rank))
    return replace(result, classes=classes.astype(np.int8))


def rule_variadic(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    """Min, Max, Sum, Mean over any number of operands."""
    table = {"Min": C.BINARY["Min"], "Max": C.BINARY["Max"], "Sum": C.BINARY["Add"], "Mean": C.BINARY["Add"]}[
        node.op_type
    ]
    return [elementwise(ctx, node, [v for v in inputs if v is not None], _table_combine(table))]


def rule_unary(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    table = C.UNARY[node.op_type]
    elem_type = onnx.TensorProto.BOOL if node.op_type in ("Not", "IsNaN", "IsInf") else None
    outputs = [elementwise(ctx, node, [inputs[0]], _unary_combine(table), elem_type)]  # type: ignore[list-item]
    if node.op_type == "Dropout" and len(node.output) > 1:
        mask = outputs[0]
        outputs.append(
            Data(mask.shape, mask.real_shape, mask.maps, mask.exact, np.int8(C.TRUE), onnx.TensorProto.BOOL)
        )
    return outputs


def rule_cast(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    target = attributes(node)["to"] if node.op_type == "Cast" else _data_type(inputs[1])
    if target == onnx.TensorProto.BOOL:
        table = C.CAST_TO_BOOL
    elif target in INTEGER_TYPES:
        table = C.CAST_TO_INTEGER
    else:
        table = C.CAST_TO_FLOAT
    return [elementwise(ctx, node, [inputs[0]], _unary_combine(table), target)]  # type: ignore[list-item]


def _data_type(value: Value | None) -> int:
    if isinstance(value, Concrete):
        return elem_type_of(value.padded)
    if isinstance(value, Data):
        return value.elem_type
    raise ProofAborted("CastLike without a type operand")


def rule_where(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    def combine(classes: list[np.ndarray]) -> np.ndarray:
        return C.where(*np.broadcast_arrays(*classes))

    operands = [v for v in inputs if v is not None]
    elem_type = next(
        (_data_type(v) for v in operands[1:]),
        onnx.TensorProto.FLOAT,
    )
    return [elementwise(ctx, node, operands, combine, elem_type)]


def rule_clip(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    data = inputs[0]
    bounds = [b for b in inputs[1:] if b is not None]

    def combine(classes: list[np.ndarray]) -> np.ndarray:
        result = classes[0]
        for bound in classes[1:]:
            result = C.BINARY["Max"][result.astype(np.intp), bound.astype(np.intp)]
        return np.where(C.IS_UNMASKED[result], result, C.SMALL).astype(np.int8)

    return [elementwise(ctx, node, [data, *bounds], combine)]  # type: ignore[list-item]


# ----------------------------------------------------------------------------------------------------
# Operators that only move elements
# ----------------------------------------------------------------------------------------------------


def rule_identity(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Value]:
    return [inputs[0]] * len(node.output)  # type: ignore[list-item]


def rule_transpose(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    data = as_data(inputs[0], ctx)  # type: ignore[arg-type]
    perm = attributes(node).get("perm") or list(range(data.rank))[::-1]
    return [
        data.with_axes(
            tuple(data.shape[a] for a in perm),
            tuple(data.real_shape[a] for a in perm),
            tuple(data.maps[a] for a in perm),
            np.transpose(data.exact, perm),
            np.transpose(data.classes, perm),
        )
    ]


def _axes_operand(node: onnx.NodeProto, inputs: list[Value | None], index: int) -> list[int] | None:
    attrs = attributes(node)
    if "axes" in attrs:
        return list(attrs["axes"])
    if len(inputs) > index and inputs[index] is not None:
        return _ints(_concrete(node, inputs[index], "axes"), "p")
    return None


def rule_unsqueeze(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    data = as_data(inputs[0], ctx)  # type: ignore[arg-type]
    axes = _axes_operand(node, inputs, 1) or []
    rank = data.rank + len(axes)
    axes = sorted(_normalize_axis(a, rank) for a in axes)
    shape, real_shape, maps = list(data.shape), list(data.real_shape), list(data.maps)
    exact, classes = data.exact, data.classes
    for axis in axes:
        shape.insert(axis, 1)
        real_shape.insert(axis, 1)
        maps.insert(axis, None)
        exact = np.expand_dims(exact, axis)
        classes = np.expand_dims(classes, axis)
    return [data.with_axes(shape, real_shape, maps, exact, classes)]


def rule_squeeze(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    data = as_data(inputs[0], ctx)  # type: ignore[arg-type]
    axes = _axes_operand(node, inputs, 1)
    if axes is None:
        axes = [a for a in range(data.rank) if data.shape[a] == 1 and data.real_shape[a] == 1]
    axes = sorted({_normalize_axis(a, data.rank) for a in axes})
    for axis in axes:
        if data.shape[axis] != 1 or data.real_shape[axis] != 1:
            raise ProofAborted(
                describe(node, f"squeezes axis {axis} of sizes {data.shape[axis]}/{data.real_shape[axis]}")
            )
    keep = [a for a in range(data.rank) if a not in axes]
    return [
        data.with_axes(
            tuple(data.shape[a] for a in keep),
            tuple(data.real_shape[a] for a in keep),
            tuple(data.maps[a] for a in keep),
            data.exact.reshape([data.exact.shape[a] for a in keep]),
            data.classes.reshape([data.classes.shape[a] for a in keep]),
        )
    ]


def reshape_groups(
    in_p: Sequence[int], in_u: Sequence[int], out_p: Sequence[int], out_u: Sequence[int]
) -> list[tuple[list[int], list[int]]] | None:
    """Axes of the input and of the output that hold the same elements, in both runs at once."""
    groups: list[tuple[list[int], list[int]]] = []
    i = o = 0
    while i < len(in_p) or o < len(out_p):
        gi: list[int] = []
        go: list[int] = []
        pi = po = (1, 1)
        if i < len(in_p):
            gi.append(i)
            pi = (in_p[i], in_u[i])
            i += 1
        if o < len(out_p):
            go.append(o)
            po = (out_p[o], out_u[o])
            o += 1
        while pi != po:
            if pi < po:  # the input side holds fewer elements: take its next axis
                if i >= len(in_p):
                    return None
                gi.append(i)
                pi = (pi[0] * in_p[i], pi[1] * in_u[i])
                i += 1
            else:
                if o >= len(out_p):
                    return None
                go.append(o)
                po = (po[0] * out_p[o], po[1] * out_u[o])
                o += 1
        groups.append((gi, go))
    return groups


def _merge_maps(
    maps: Sequence[AxisMap], sizes_p: Sequence[int], sizes_u: Sequence[int]
) -> tuple[np.ndarray, bool]:
    """The map of the axis made of ``maps``' axes (row-major), and whether it is expressible."""
    merged = np.zeros(1, dtype=np.int64)
    for axis_map, size_p, size_u in zip(maps, sizes_p, sizes_u, strict=True):
        own = np.arange(size_p) if axis_map is None else axis_map
        merged = np.where(
            (merged[:, None] >= 0) & (own[None, :] >= 0), merged[:, None] * size_u + own[None, :], -1
        ).reshape(-1)
    return merged, True


def _split_map(axis_map: AxisMap, sizes_p: Sequence[int], sizes_u: Sequence[int]) -> list[AxisMap] | None:
    """Maps of the axes ``sizes`` that one axis with ``axis_map`` splits into (row-major), or None when the
    split does not factor (a padded position would land inside a row)."""
    if axis_map is None:
        if list(sizes_p) != list(sizes_u):
            return None
        return [None] * len(sizes_p)
    total = int(np.prod(sizes_p))
    if len(axis_map) != total:
        return None
    grid = axis_map.reshape(sizes_p)
    result: list[AxisMap] = []
    for axis, (size_p, size_u) in enumerate(zip(sizes_p, sizes_u, strict=True)):
        inner_u = int(np.prod(sizes_u[axis + 1 :]))
        outer_u = int(np.prod(sizes_u[:axis]))
        moved = np.moveaxis(grid, axis, 0).reshape(size_p, -1)
        real = moved >= 0
        coords = np.where(real, (moved // max(inner_u, 1)) % max(size_u, 1), -1)
        # each padded coordinate must stand for one unpadded coordinate along the whole slab
        first = np.where(real.any(axis=1), coords.max(axis=1), -1)
        consistent = np.all(np.where(real, coords == first[:, None], True))
        if not consistent or outer_u < 0:
            return None
        result.append(identity_or(first) if size_p == size_u else first)
    # the factors must recompose to the original map
    merged, _ = _merge_maps(result, sizes_p, sizes_u)
    if not np.array_equal(merged, np.where(axis_map >= 0, axis_map, -1)):
        return None
    return result


def rule_reshape(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    data = as_data(inputs[0], ctx)  # type: ignore[arg-type]
    if node.op_type == "Flatten":
        axis = _normalize_axis(attributes(node).get("axis", 1), data.rank)
        out_p = (int(np.prod(data.shape[:axis])), int(np.prod(data.shape[axis:])))
        out_u = (int(np.prod(data.real_shape[:axis])), int(np.prod(data.real_shape[axis:])))
    else:
        target = _concrete(node, inputs[1], "target shape")
        allowzero = attributes(node).get("allowzero", 0)
        out_p = reshape_target(data.shape, target.padded, allowzero)  # type: ignore[union-attr]
        out_u = reshape_target(data.real_shape, target.unpadded, allowzero)  # type: ignore[union-attr]
    return [reshape_data(data, out_p, out_u, node)]


def reshape_data(data: Data, out_p: tuple[int, ...], out_u: tuple[int, ...], node: onnx.NodeProto) -> Data:
    data = _compacted(data)
    groups = reshape_groups(data.shape, data.real_shape, out_p, out_u)
    if groups is None:
        return _opaque(
            data, out_p, out_u, describe(node, "reshapes the padded axis in a way the proof cannot follow")
        )
    maps: list[AxisMap] = [None] * len(out_p)
    out_exact_shape: list[int] = [1] * len(out_p)
    needs_full = False
    for in_axes, out_axes in groups:
        in_maps = [data.maps[a] for a in in_axes]
        if len(in_axes) == 1 and len(out_axes) == 1:
            maps[out_axes[0]] = in_maps[0]
            out_exact_shape[out_axes[0]] = max(data.exact.shape[in_axes[0]], data.classes.shape[in_axes[0]])
            continue
        if all(m is None for m in in_maps) and all(out_p[o] == out_u[o] for o in out_axes):
            uniform = all(data.exact.shape[a] == 1 and data.classes.shape[a] == 1 for a in in_axes)
            if not uniform:
                needs_full = True
            continue
        merged, _ = _merge_maps(
            in_maps, [data.shape[a] for a in in_axes], [data.real_shape[a] for a in in_axes]
        )
        split = _split_map(merged, [out_p[o] for o in out_axes], [out_u[o] for o in out_axes])
        if split is None:
            return _opaque(data, out_p, out_u, describe(node, "reshapes a padded axis together with others"))
        for o, axis_map in zip(out_axes, split, strict=True):
            maps[o] = axis_map
        needs_full = True
    if needs_full:
        full_exact, full_classes = _full_facts(data)
        if full_exact.size > ELEMENT_LIMIT:
            return _opaque(data, out_p, out_u, describe(node, "reshapes a tensor too large to follow"))
        exact = np.ascontiguousarray(full_exact).reshape(out_p)
        classes = np.ascontiguousarray(full_classes).reshape(out_p)
    else:
        # every group is one-to-one or uniform: facts keep their per-group sizes
        exact = np.broadcast_to(data.exact, data.exact.shape).reshape(
            [_group_size(data.exact, groups, o) for o in range(len(out_p))]
        )
        classes = data.classes.reshape([_group_size(data.classes, groups, o) for o in range(len(out_p))])
    return data.with_axes(out_p, out_u, maps, exact, classes)


def _compacted(data: Data) -> Data:
    """``data`` with its facts cut to size 1 along every axis where they do not vary, padding elements'
    exactness (which means nothing) taken as true: a large tensor computed from sizes (a relative
    position bias over frames x frames) then reshapes by its groups instead of element by element."""
    if data.exact.size <= 1 and data.classes.size <= 1:
        return data
    exact = data.exact | ~data.real_grid()
    arrays = []
    for facts in (exact, data.classes):
        for axis in range(facts.ndim):
            if facts.shape[axis] > 1 and np.all(facts == np.take(facts, [0], axis=axis)):
                facts = np.take(facts, [0], axis=axis)
        arrays.append(facts)
    return replace(data, exact=arrays[0], classes=arrays[1])


def _group_size(facts: np.ndarray, groups: list[tuple[list[int], list[int]]], out_axis: int) -> int:
    for in_axes, out_axes in groups:
        if out_axis in out_axes:
            if len(in_axes) == 1 and len(out_axes) == 1:
                return facts.shape[in_axes[0]]
            return 1
    return 1


def _opaque(data: Data, out_p: Sequence[int], out_u: Sequence[int], blame: str) -> Data:
    """A result the proof cannot follow: its shapes are known, no element is exact."""
    rank = len(out_p)
    maps = tuple(
        None if p == u else np.where(np.arange(p) < u, np.arange(p), -1)
        for p, u in zip(out_p, out_u, strict=True)
    )
    classes = np.full((1,) * rank, C.SMALL if np.all(_finite(data.classes)) else C.ANY, np.int8)
    exact = np.zeros((1,) * rank, bool)
    return data.with_axes(out_p, out_u, maps, exact, classes, blame=data.blame or blame)


def rule_expand(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    data = as_data(inputs[0], ctx)  # type: ignore[arg-type]
    target = _concrete(node, inputs[1], "target shape")
    shape_p = tuple(_ints(target, "p") or [])
    shape_u = tuple(_ints(target, "u") or [])
    rank = max(data.rank, len(shape_p))
    in_p = (1,) * (rank - data.rank) + data.shape
    in_u = (1,) * (rank - data.rank) + data.real_shape
    out_p = tuple(np.broadcast_shapes(in_p, (1,) * (rank - len(shape_p)) + shape_p))
    out_u = tuple(np.broadcast_shapes(in_u, (1,) * (rank - len(shape_u)) + shape_u))
    maps: list[AxisMap] = []
    for axis in range(rank):
        own = data.maps[axis - (rank - data.rank)] if axis >= rank - data.rank else None
        if in_p[axis] == out_p[axis] and in_p[axis] != 1:
            maps.append(own)
        else:
            maps.append(ctx.layouts.lookup(out_p[axis], out_u[axis]))
    return [data.with_axes(out_p, out_u, maps, data.exact, data.classes)]


def rule_tile(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    data = as_data(inputs[0], ctx)  # type: ignore[arg-type]
    repeats = _concrete(node, inputs[1], "repeats")
    reps_p, reps_u = _ints(repeats, "p") or [], _ints(repeats, "u") or []
    maps: list[AxisMap] = []
    exact, classes = data.exact, data.classes
    for axis, (rp, ru) in enumerate(zip(reps_p, reps_u, strict=True)):
        size_p, size_u = data.shape[axis], data.real_shape[axis]
        own = data.maps[axis]
        if rp == ru and own is None:
            maps.append(None)
        else:
            base = np.arange(size_p) if own is None else own
            copies = [np.where((base >= 0) & (copy < ru), base + copy * size_u, -1) for copy in range(rp)]
            maps.append(np.concatenate(copies) if copies else np.zeros(0, np.int64))
        if exact.shape[axis] != 1:
            exact = np.concatenate([exact] * rp, axis=axis)
        if classes.shape[axis] != 1:
            classes = np.concatenate([classes] * rp, axis=axis)
    out_p = tuple(s * r for s, r in zip(data.shape, reps_p, strict=True))
    out_u = tuple(s * r for s, r in zip(data.real_shape, reps_u, strict=True))
    return [data.with_axes(out_p, out_u, maps, exact, classes)]


def rule_concat(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    operands = [v for v in inputs if v is not None]
    rank = _rank(operands[0])
    axis = _normalize_axis(attributes(node)["axis"], rank)
    # maps of the other axes: agreement of the Data operands
    other_maps: list[AxisMap] = []
    for a in range(rank):
        found, axis_map = False, None
        for op in operands:
            if isinstance(op, Data) and a != axis and op.shape[a] != 1:
                axis_map = op.maps[a] if not found else agree(axis_map, op.maps[a])
                found = True
        other_maps.append(axis_map)
    datas = [as_data(op, ctx, [None if a == axis else other_maps[a] for a in range(rank)]) for op in operands]
    pieces_map, exact_parts, class_parts = [], [], []
    offset_u = 0
    out_shape = list(datas[0].shape)
    facts_shape = [1] * rank
    for data in datas:
        for a in range(rank):
            if a != axis:
                facts_shape[a] = max(facts_shape[a], data.exact.shape[a], data.classes.shape[a])
    for data in datas:
        own = np.arange(data.shape[axis]) if data.maps[axis] is None else data.maps[axis]
        pieces_map.append(np.where(own >= 0, own + offset_u, -1))
        offset_u += data.real_shape[axis]
        target = list(facts_shape)
        target[axis] = data.shape[axis]
        exact_parts.append(np.broadcast_to(data.exact, target))
        class_parts.append(np.broadcast_to(data.classes, target))
    out_shape[axis] = sum(d.shape[axis] for d in datas)
    real_shape = list(datas[0].real_shape)
    real_shape[axis] = offset_u
    maps = list(other_maps)
    concatenated = np.concatenate(pieces_map) if pieces_map else np.zeros(0, np.int64)
    maps[axis] = (
        None
        if out_shape[axis] == offset_u and np.array_equal(concatenated, np.arange(offset_u))
        else concatenated
    )
    return [
        Data(
            tuple(out_shape),
            tuple(real_shape),
            tuple(maps),
            np.concatenate(exact_parts, axis=axis),
            np.concatenate(class_parts, axis=axis),
            datas[0].elem_type,
            _sources(*operands),
            _first_blame(*datas),
        )
    ]


def _take_axis(data: Data, axis: int, picks_p: np.ndarray, picks_u: np.ndarray, node: onnx.NodeProto) -> Data:
    """``data`` restricted to padded coordinates ``picks_p`` (in order) along ``axis``, where the unpadded
    run keeps ``picks_u``: each kept padded coordinate stands for the unpadded output coordinate that
    holds the same unpadded element; unpadded elements the padded run drops make the result inexact."""
    own = np.arange(data.shape[axis]) if data.maps[axis] is None else data.maps[axis]
    source_u = own[picks_p] if len(picks_p) else np.zeros(0, np.int64)
    position = {int(v): k for k, v in enumerate(picks_u)}
    new_map = np.array([position.get(int(s), -1) if s >= 0 else -1 for s in source_u], dtype=np.int64)
    exact = data.exact if data.exact.shape[axis] == 1 else np.take(data.exact, picks_p, axis=axis)
    classes = data.classes if data.classes.shape[axis] == 1 else np.take(data.classes, picks_p, axis=axis)
    shape = list(data.shape)
    shape[axis] = len(picks_p)
    real_shape = list(data.real_shape)
    real_shape[axis] = len(picks_u)
    maps = list(data.maps)
    maps[axis] = identity_or(new_map) if len(picks_p) == len(picks_u) else new_map
    blame = data.blame
    if not complete(maps[axis], len(picks_u)):
        exact = np.zeros_like(exact, dtype=bool)
        blame = blame or describe(
            node,
            f"keeps elements along axis {axis} that are padding in place of real ones "
            "(e.g. it takes the last position)",
        )
    return data.with_axes(shape, real_shape, maps, exact, classes, blame=blame)


def rule_slice(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    data = as_data(inputs[0], ctx)  # type: ignore[arg-type]
    if len(inputs) == 1:
        attrs = attributes(node)
        args_p = args_u = (attrs["starts"], attrs["ends"], attrs.get("axes"), None)
    else:
        controls = [_concrete(node, v, "slice bounds") if v is not None else None for v in inputs[1:5]]
        controls += [None] * (4 - len(controls))
        args_p = tuple(None if c is None else c.padded for c in controls)
        args_u = tuple(None if c is None else c.unpadded for c in controls)
    picks_p = slice_indices(data.shape, *args_p)
    picks_u = dict(slice_indices(data.real_shape, *args_u))
    result = data
    for axis, picked in picks_p:
        result = _take_axis(result, axis, picked, picks_u[axis], node)
    return [result]


def rule_split(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    data = as_data(inputs[0], ctx)  # type: ignore[arg-type]
    attrs = attributes(node)
    axis = _normalize_axis(attrs.get("axis", 0), data.rank)
    count = len(node.output)

    def sizes(total: int, run: str) -> list[int]:
        if "split" in attrs:
            return list(attrs["split"])
        if len(inputs) > 1 and inputs[1] is not None:
            return _ints(_concrete(node, inputs[1], "split sizes"), run) or []
        parts = attrs.get("num_outputs", count)
        chunk = -(-total // parts)
        return [min(chunk, total - chunk * k) for k in range(parts)]

    sizes_p, sizes_u = sizes(data.shape[axis], "p"), sizes(data.real_shape[axis], "u")
    outputs = []
    start_p = start_u = 0
    for size_p, size_u in zip(sizes_p, sizes_u, strict=True):
        outputs.append(
            _take_axis(
                data, axis, np.arange(start_p, start_p + size_p), np.arange(start_u, start_u + size_u), node
            )
        )
        start_p += size_p
        start_u += size_u
    return outputs


def rule_gather(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    table, indices = inputs[0], inputs[1]
    rank = _rank(table)  # type: ignore[arg-type]
    axis = _normalize_axis(attributes(node).get("axis", 0), rank)
    if isinstance(indices, Concrete):
        data = as_data(table, ctx)  # type: ignore[arg-type]
        return [_gather_at(ctx, node, data, axis, indices)]
    assert isinstance(indices, Data)
    data = as_data(table, ctx)  # type: ignore[arg-type]
    if data.maps[axis] is not None:
        return [
            _opaque(
                data,
                data.shape[:axis] + indices.shape + data.shape[axis + 1 :],
                data.real_shape[:axis] + indices.real_shape + data.real_shape[axis + 1 :],
                describe(
                    node, f"gathers along axis {axis}, which has padding, at positions computed from data"
                ),
            )
        ]
    # An embedding-style lookup: each output element reads the table at its index.
    table_exact = bool(np.all(data.exact))
    table_classes = data.classes
    joined = table_classes.reshape(-1)
    table_class = joined[0]
    for c in joined[1:]:
        table_class = C.JOIN[table_class, c]
    shape = data.shape[:axis] + indices.shape + data.shape[axis + 1 :]
    real_shape = data.real_shape[:axis] + indices.real_shape + data.real_shape[axis + 1 :]
    maps = data.maps[:axis] + indices.maps + data.maps[axis + 1 :]
    exact = indices.exact.reshape((1,) * axis + indices.exact.shape + (1,) * (rank - axis - 1))
    if not table_exact:
        exact = exact & False
    return [
        Data(
            shape,
            real_shape,
            maps,
            exact,
            np.full((1,) * len(shape), table_class, np.int8),
            data.elem_type,
            _sources(table, indices),
            _first_blame(indices, data),
        )
    ]


def _gather_at(ctx: Context, node: onnx.NodeProto, data: Data, axis: int, indices: Concrete) -> Data:
    idx_p = np.where(indices.padded < 0, indices.padded + data.shape[axis], indices.padded)
    idx_u = np.where(indices.unpadded < 0, indices.unpadded + data.real_shape[axis], indices.unpadded)
    index_rank = idx_p.ndim
    index_maps = [
        None if idx_p.shape[a] == idx_u.shape[a] else ctx.layouts.lookup(idx_p.shape[a], idx_u.shape[a])
        for a in range(index_rank)
    ]
    own = np.arange(data.shape[axis]) if data.maps[axis] is None else data.maps[axis]
    source_u = own[np.clip(idx_p, 0, max(len(own) - 1, 0))] if len(own) else np.full(idx_p.shape, -1)
    # the unpadded index at the unpadded coordinate each padded index coordinate stands for
    if idx_u.size == 0:
        matches = np.ones(idx_p.shape, bool)
    else:
        gather_index = [
            np.clip(m, 0, idx_u.shape[a] - 1) if m is not None else np.arange(idx_p.shape[a])
            for a, m in enumerate(index_maps)
        ]
        expected = idx_u[np.ix_(*gather_index)] if index_rank else idx_u
        matches = source_u == expected
    real_index = real_grid(index_maps, idx_p.shape) if index_rank else np.ones((), bool)
    ok = matches | ~real_index
    blame = data.blame
    if not np.all(ok):
        blame = blame or describe(
            node,
            f"reads along axis {axis} at positions that differ between the padded and the caller's sizes",
        )

    def pick(facts: np.ndarray) -> np.ndarray:
        index = np.zeros(idx_p.shape, np.int64) if facts.shape[axis] == 1 else np.clip(idx_p, 0, None)
        return np.take(facts, index, axis=axis)

    exact_data, classes = pick(data.exact), pick(data.classes)
    ok_shaped = ok.reshape((1,) * axis + ok.shape + (1,) * (data.rank - axis - 1))
    return data.with_axes(
        data.shape[:axis] + idx_p.shape + data.shape[axis + 1 :],
        data.real_shape[:axis] + idx_u.shape + data.real_shape[axis + 1 :],
        data.maps[:axis] + tuple(index_maps) + data.maps[axis + 1 :],
        exact_data & ok_shaped,
        classes,
        blame=blame,
    )


_GATHERS = frozenset({"GatherElements", "GatherND"})


def rule_moved_elements(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    """Index-moving operators with data-independent indices (GatherElements, GatherND, ScatterND,
    ScatterElements, Trilu, Pad, ...): each element's source is found by running the operator on
    element ids in both runs."""
    carrying = _CARRIERS.get(node.op_type, (0,))
    reduction = attribute(node, "reduction", b"none")
    if reduction != b"none":
        # A scatter that reduces combines elements: run on element ids it would add (or multiply) ids
        # into other ids and fake a source, so its result is not followed.
        template = as_data(inputs[0], ctx)  # type: ignore[arg-type]
        why = describe(node, f"combines elements (reduction {reduction.decode()})")
        return [_opaque(template, template.shape, template.real_shape, why)]
    datas: dict[int, Data] = {}
    for slot, value in enumerate(inputs):
        if value is None:
            continue
        if slot in carrying:
            datas[slot] = as_data(value, ctx)
        elif isinstance(value, Data):
            template = as_data(inputs[carrying[0]], ctx)  # type: ignore[arg-type]
            # A gather's result has its indices' shape (GatherND: their leading axes and the data's
            # trailing ones), a scatter's its data's.
            if node.op_type in _GATHERS:
                out_p, out_u = _shapes_by_zeros(ctx, node, inputs)
            else:
                out_p, out_u = template.shape, template.real_shape
            return [
                _opaque(
                    template, out_p, out_u, describe(node, "moves elements to positions computed from data")
                )
            ]
    total = sum(int(np.prod(d.shape)) for d in datas.values())
    if total > ELEMENT_LIMIT:
        template = datas[carrying[0]]
        return [
            _opaque(
                template,
                template.shape,
                template.real_shape,
                describe(node, "is too large to follow element by element"),
            )
        ]
    ids_p: list[np.ndarray | None] = []
    ids_u: list[np.ndarray | None] = []
    offsets: dict[int, tuple[int, int]] = {}
    next_p = next_u = 1  # 0 marks a constant fill (Trilu's zeros, Pad's value)
    for slot, value in enumerate(inputs):
        if slot in datas:
            data = datas[slot]
            size_p, size_u = int(np.prod(data.shape)), int(np.prod(data.real_shape))
            offsets[slot] = (next_p, next_u)
            ids_p.append(np.arange(next_p, next_p + size_p, dtype=np.int64).reshape(data.shape))
            ids_u.append(np.arange(next_u, next_u + size_u, dtype=np.int64).reshape(data.real_shape))
            next_p += size_p
            next_u += size_u
        elif value is None:
            ids_p.append(None)
            ids_u.append(None)
        else:
            assert isinstance(value, Concrete)
            fill = node.op_type == "Pad" and slot == 2
            ids_p.append(np.zeros_like(value.padded, dtype=np.int64) if fill else value.padded)
            ids_u.append(np.zeros_like(value.unpadded, dtype=np.int64) if fill else value.unpadded)
    try:
        out_p = ctx.evaluator.run(node, ids_p)[0]
        out_u = ctx.evaluator.run(node, ids_u)[0]
    except EvaluationError as error:
        raise ProofAborted(describe(node, f"cannot be followed: {error}")) from error
    template = datas[carrying[0]]
    if out_p.ndim == template.rank and out_p.shape == template.shape and out_u.shape == template.real_shape:
        maps = list(template.maps)
    else:
        maps = [ctx.layouts.lookup(p, u) for p, u in zip(out_p.shape, out_u.shape, strict=True)]
    # unpadded id of every padded source element (or -1 for padding, 0 for the fill)
    source_u = np.zeros(out_p.shape, dtype=np.int64)
    exact = np.ones(out_p.shape, bool)
    classes = np.full(out_p.shape, C.ZERO, np.int8)
    for slot, data in datas.items():
        start_p, start_u = offsets[slot]
        size_p = int(np.prod(data.shape))
        inside = (out_p >= start_p) & (out_p < start_p + size_p)
        if not np.any(inside):
            continue
        flat = out_p[inside] - start_p
        coords = np.unravel_index(flat, data.shape)
        unpadded = np.zeros(len(flat), dtype=np.int64)
        real = np.ones(len(flat), bool)
        for axis, (axis_map, coord) in enumerate(zip(data.maps, coords, strict=True)):
            mapped = coord if axis_map is None else axis_map[coord]
            real &= mapped >= 0
            unpadded = unpadded * data.real_shape[axis] + np.clip(mapped, 0, None)
        source_u[inside] = np.where(real, unpadded + start_u, -1)
        full_exact, full_classes = _full_facts(data)
        exact[inside] = full_exact[coords]
        classes[inside] = full_classes[coords]
    if node.op_type == "Pad" and len(inputs) > 2 and isinstance(inputs[2], Concrete):
        classes = np.where(out_p == 0, C.classify(inputs[2].padded).reshape(-1)[0], classes).astype(np.int8)
    expected = _read_unpadded(out_u, maps, out_p.shape)
    grid = np.broadcast_to(real_grid(maps, out_p.shape), out_p.shape)
    matches = (source_u == expected) | ~grid
    blame = _first_blame(*datas.values())
    if not np.all(matches):
        blame = blame or describe(node, "moves elements differently at the padded and at the caller's sizes")
    return [
        Data(
            tuple(out_p.shape),
            tuple(out_u.shape),
            tuple(maps),
            exact & matches,
            classes,
            template.elem_type,
            _sources(*inputs),
            blame,
        )
    ]


def _read_unpadded(array: np.ndarray, maps: Sequence[AxisMap], shape: Sequence[int]) -> np.ndarray:
    if array.size == 0:
        return np.full(shape, -2, dtype=np.int64)
    index = [
        np.arange(s) if m is None else np.clip(m, 0, array.shape[a] - 1)
        for a, (m, s) in enumerate(zip(maps, shape, strict=True))
    ]
    return array[np.ix_(*index)]


_CARRIERS = {
    "ScatterND": (0, 2),
    "ScatterElements": (0, 2),
    "Scatter": (0, 2),
}


def rule_shape(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Concrete]:
    data = inputs[0]
    assert isinstance(data, Data)
    attrs = attributes(node)
    if node.op_type == "Size":
        return [
            Concrete(
                np.array(int(np.prod(data.shape)), np.int64),
                np.array(int(np.prod(data.real_shape)), np.int64),
            )
        ]
    rank = data.rank
    start = attrs.get("start", 0)
    end = attrs.get("end", rank)
    start = max(0, min(rank, start + rank if start < 0 else start))
    end = max(0, min(rank, end + rank if end < 0 else end))
    return [
        Concrete(
            np.array(data.shape[start:end], dtype=np.int64),
            np.array(data.real_shape[start:end], dtype=np.int64),
        )
    ]


# ----------------------------------------------------------------------------------------------------
# Operators that combine positions
# ----------------------------------------------------------------------------------------------------


def contract(
    ctx: Context,
    node: onnx.NodeProto,
    operands: Sequence[Data],
    labels: Sequence[str],
    out_labels: str,
) -> Data:
    """A sum of products over the labels not in ``out_labels`` (MatMul, Gemm, Einsum)."""
    sizes_p: dict[str, int] = {}
    sizes_u: dict[str, int] = {}
    maps: dict[str, AxisMap] = {}
    found: set[str] = set()
    for data, own in zip(operands, labels, strict=True):
        if len(set(own)) != len(own):
            raise ProofAborted(
                describe(node, "repeats an axis label (a diagonal), which the proof does not follow")
            )
        for axis, label in enumerate(own):
            p, u = data.shape[axis], data.real_shape[axis]
            if label not in sizes_p or sizes_p[label] == 1:
                sizes_p[label], sizes_u[label] = p, u
            elif p != 1 and (p, u) != (sizes_p[label], sizes_u[label]):
                raise ProofAborted(describe(node, f"operands disagree on the size of axis {label!r}"))
            if p != 1:
                maps[label] = data.maps[axis] if label not in found else agree(maps[label], data.maps[axis])
                found.add(label)
    for label in sizes_p:
        if label not in found:
            maps[label] = (
                None
                if sizes_p[label] == sizes_u[label]
                else ctx.layouts.lookup(sizes_p[label], sizes_u[label])
            )
    contracted = [label for label in sizes_p if label not in out_labels]
    order = list(out_labels) + contracted
    aligned_exact, aligned_classes = [], []
    for data, own in zip(operands, labels, strict=True):
        aligned_exact.append(_align(data.exact, own, order))
        aligned_classes.append(_align(data.classes, own, order))
    axes = tuple(range(len(out_labels), len(order)))
    blame = _first_blame(*operands)
    padded = [label for label in contracted if maps[label] is not None and np.any(maps[label] < 0)]
    exact_terms = aligned_exact[0]
    for other in aligned_exact[1:]:
        exact_terms = exact_terms & other
    term_classes = aligned_classes[0]
    for other in aligned_classes[1:]:
        term_classes = C.BINARY["Mul"][term_classes.astype(np.intp), other.astype(np.intp)]
    if padded:
        if len(operands) != 2:
            return _opaque(
                operands[0],
                tuple(sizes_p[label] for label in out_labels),
                tuple(sizes_u[label] for label in out_labels),
                describe(node, "sums over padding of more than two operands"),
            )
        incomplete = [label for label in padded if not complete(maps[label], sizes_u[label])]
        real = np.ones((1,) * len(order), bool)
        for label in padded:
            view = [1] * len(order)
            view[order.index(label)] = sizes_p[label]
            real = real & (maps[label] >= 0).reshape(view)
        a_classes, b_classes = aligned_classes
        zero_weight = ((a_classes == C.ZERO) & _finite(b_classes)) | (
            (b_classes == C.ZERO) & _finite(a_classes)
        )
        exact_terms = np.where(real, exact_terms, zero_weight)
        if incomplete:
            exact_terms = exact_terms & False
            blame = blame or describe(
                node, f"sums over axis {incomplete[0]!r} without all of its real elements"
            )
        elif blame is None and not np.all(np.where(real, True, zero_weight)):
            blame = describe(
                node,
                "sums over positions that are padding, and the padded values there are not multiplied "
                "by a zero weight (e.g. a convolution or a projection across positions)",
            )
    exact = np.all(exact_terms, axis=axes) if axes else exact_terms
    classes = _reduce_classes(term_classes, axes)
    if axes:
        classes = classes.reshape(classes.shape[: len(out_labels)])
    shape_p = tuple(sizes_p[label] for label in out_labels)
    shape_u = tuple(sizes_u[label] for label in out_labels)
    return Data(
        shape_p,
        shape_u,
        tuple(maps[label] for label in out_labels),
        exact,
        classes,
        operands[0].elem_type,
        _sources(*operands),
        blame,
    )


def _align(facts: np.ndarray, own: str, order: Sequence[str]) -> np.ndarray:
    """``facts`` (axes labelled ``own``) with its axes in ``order``, size 1 for missing labels."""
    permutation = [own.index(label) for label in order if label in own]
    moved = np.transpose(facts, permutation) if permutation else facts
    shape = [facts.shape[own.index(label)] if label in own else 1 for label in order]
    return moved.reshape(shape)


_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def rule_matmul(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    a = as_data(inputs[0], ctx)  # type: ignore[arg-type]
    b = as_data(inputs[1], ctx)  # type: ignore[arg-type]
    ra, rb = a.rank, b.rank
    batch = max(ra, rb) - 2
    batch_labels = _LETTERS[: max(batch, 0)]
    m, k, n = "x", "y", "z"
    if ra == 1:
        la = k
    else:
        la = batch_labels[batch - (ra - 2) :] + m + k
    if rb == 1:
        lb = k
    else:
        lb = batch_labels[batch - (rb - 2) :] + k + n
    out = batch_labels + ("" if ra == 1 else m) + ("" if rb == 1 else n)
    return [contract(ctx, node, [a, b], [la, lb], out)]


def rule_gemm(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    attrs = attributes(node)
    a = as_data(inputs[0], ctx)  # type: ignore[arg-type]
    b = as_data(inputs[1], ctx)  # type: ignore[arg-type]
    la = "ky" if attrs.get("transA", 0) else "yk"
    lb = "nk" if attrs.get("transB", 0) else "kn"
    product = contract(ctx, node, [a, b], [la, lb], "yn")
    if len(inputs) > 2 and inputs[2] is not None:
        product = elementwise(ctx, node, [product, inputs[2]], _table_combine(C.BINARY["Add"]))
    return [product]


def rule_einsum(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    from optimum_ipu_backend.compiler.passes.rewrites.common import CannotLower
    from optimum_ipu_backend.compiler.passes.rewrites.einsum import parse_equation

    equation = attributes(node)["equation"]
    equation = equation.decode() if isinstance(equation, bytes) else equation
    operands = [as_data(v, ctx) for v in inputs if v is not None]
    try:
        labels, output = parse_equation(equation, [op.rank for op in operands])
    except CannotLower as error:
        raise ProofAborted(describe(node, error.reason)) from error
    if len(operands) > 2:
        raise ProofAborted(
            describe(node, f"einsum {equation!r} with {len(operands)} operands is not followed")
        )
    if len(operands) == 1:
        operands = [operands[0], _one(operands[0])]
        labels = [labels[0], ""]
    return [contract(ctx, node, operands, labels, output)]


def _one(template: Data) -> Data:
    return Data((), (), (), np.ones((), bool), np.int8(C.ONE), template.elem_type)


def rule_softmax(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    data = as_data(inputs[0], ctx)  # type: ignore[arg-type]
    axis = _normalize_axis(attributes(node).get("axis", -1), data.rank)
    if node.output[0] in ctx.watched:
        ctx.recorded[node.output[0]] = data
    exact_rows = np.all(
        expand_axis(data.exact, axis, data.shape[axis]) | ~_axis_real(data, axis), axis=axis, keepdims=True
    )
    classes = expand_axis(data.classes, axis, data.shape[axis])
    real_axis = _axis_real(data, axis)
    unmasked_real = np.any(C.IS_UNMASKED[classes] & real_axis, axis=axis, keepdims=True)
    maybe_real = np.any(C.IS_MAYBE[classes] & real_axis, axis=axis, keepdims=True)
    pad_masked = np.all(C.IS_MASKED[classes] | real_axis, axis=axis, keepdims=True)
    has_padding = data.maps[axis] is not None and np.any(data.maps[axis] < 0)
    blame = data.blame
    if not has_padding:
        exact = exact_rows
    elif not complete(data.maps[axis], data.real_shape[axis]):
        exact = exact_rows & False
        blame = blame or describe(node, f"normalizes over axis {axis} without all of its real elements")
    else:
        # A real row is exact when its padded elements are masked and some real one is not.
        row_ok = pad_masked & (unmasked_real | maybe_real)
        exact = exact_rows & row_ok
        if not np.all(row_ok | ~_rows_real(data, axis)) and blame is None:
            blame = describe(
                node,
                f"normalizes over axis {axis}, which has padding that is not masked out (no attention mask "
                "or causal mask hides it)",
            )
        needs_data = maybe_real & ~unmasked_real & _rows_real(data, axis)
        if np.any(needs_data):
            ctx.softmax_sites.append(
                SoftmaxSite(node.name or node.output[0], node.output[0], data.sources, axis)
            )
    any_row = np.any(classes == C.ANY, axis=axis, keepdims=True) | (
        np.any(classes == C.NEGINF, axis=axis, keepdims=True) & ~unmasked_real & ~maybe_real
    )
    out_classes = np.where(
        any_row, C.ANY, np.where(C.IS_MASKED[classes] & (unmasked_real | maybe_real), C.ZERO, C.SMALL)
    )
    if node.op_type == "LogSoftmax":
        out_classes = np.where(out_classes == C.ZERO, C.ANY, out_classes)
    return [
        data.with_axes(
            data.shape, data.real_shape, data.maps, exact, out_classes.astype(np.int8), blame=blame
        )
    ]


def _axis_real(data: Data, axis: int) -> np.ndarray:
    view = [1] * data.rank
    view[axis] = data.shape[axis]
    return real_coordinates(data.maps[axis], data.shape[axis]).reshape(view)


def _rows_real(data: Data, axis: int) -> np.ndarray:
    maps = list(data.maps)
    maps[axis] = None
    return real_grid(maps, data.shape)


def rule_normalization(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    """LayerNormalization, Group/InstanceNormalization, LpNormalization: statistics over some axes."""
    data = as_data(inputs[0], ctx)  # type: ignore[arg-type]
    attrs = attributes(node)
    if node.op_type == "LayerNormalization":
        axes = list(range(_normalize_axis(attrs.get("axis", -1), data.rank), data.rank))
    elif node.op_type == "LpNormalization":
        axes = [_normalize_axis(attrs.get("axis", -1), data.rank)]
    else:  # statistics over the spatial axes
        axes = list(range(2, data.rank))
    mixed = _remapped_axes(data, axes)
    classes = expand_axis_all(data.classes, axes, data.shape)
    bad = np.any(~C.IS_UNMASKED[classes], axis=tuple(axes), keepdims=True)
    out_classes = np.where(bad, C.ANY, C.SMALL).astype(np.int8)
    exact_real = data.exact | ~data.real_grid()
    exact = np.all(exact_real, axis=tuple(axes), keepdims=True) if axes else exact_real
    blame = data.blame
    if mixed:
        exact = exact & False
        blame = blame or describe(node, f"normalizes over axis {mixed[0]}, which has padding")
    operands = [data, *[v for v in inputs[1:] if v is not None]]
    result = Data(
        data.shape, data.real_shape, data.maps, exact, out_classes, data.elem_type, _sources(*operands), blame
    )
    outputs = [result]
    for _ in node.output[1:]:
        outputs.append(result.inexact(describe(node, "statistics outputs are not followed")))
    return outputs


def expand_axis_all(array: np.ndarray, axes: Sequence[int], shape: Sequence[int]) -> np.ndarray:
    for axis in axes:
        array = expand_axis(array, axis, shape[axis])
    return array


def rule_reduce(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    data = as_data(inputs[0], ctx)  # type: ignore[arg-type]
    attrs = attributes(node)
    axes = _axes_operand(node, inputs, 1)
    if axes is None or not axes:
        if attrs.get("noop_with_empty_axes", 0):
            return [data]
        axes = list(range(data.rank))
    axes = sorted({_normalize_axis(a, data.rank) for a in axes})
    keepdims = bool(attrs.get("keepdims", 1))
    padded = _padded_axes(data, axes)
    exact_full = expand_axis_all(data.exact, axes, data.shape)
    classes_full = expand_axis_all(data.classes, axes, data.shape)
    real = np.ones((1,) * data.rank, bool)
    for axis in axes:
        real = real & _axis_real(data, axis)
    blame = data.blame
    if padded:
        sums = node.op_type in ("ReduceSum", "ReduceL1", "ReduceL2", "ReduceSumSquare")
        if not sums or not all(complete(data.maps[a], data.real_shape[a]) for a in padded):
            exact = np.all(exact_full, axis=tuple(axes), keepdims=True) & False
            blame = blame or describe(
                node, f"reduces ({node.op_type}) over axis {padded[0]}, which has padding"
            )
        else:
            ok = np.where(real, exact_full, classes_full == C.ZERO)
            exact = np.all(ok, axis=tuple(axes), keepdims=True)
            if blame is None and not np.all(np.where(real, True, classes_full == C.ZERO)):
                blame = describe(node, f"sums over axis {padded[0]}, whose padded elements are not zero")
    else:
        exact = np.all(exact_full | ~real, axis=tuple(axes), keepdims=True)
    classes = _reduce_classes(classes_full, tuple(axes))
    if node.op_type in ("ReduceMax", "ReduceMin"):
        any_bad = np.any(classes_full == C.ANY, axis=tuple(axes), keepdims=True)
        classes = np.where(any_bad, C.ANY, C.SMALL).astype(np.int8)
    shape, real_shape, maps = list(data.shape), list(data.real_shape), list(data.maps)
    for axis in axes:
        shape[axis] = real_shape[axis] = 1
        maps[axis] = None
    if not keepdims:
        keep = [a for a in range(data.rank) if a not in axes]
        shape = [shape[a] for a in keep]
        real_shape = [real_shape[a] for a in keep]
        maps = [maps[a] for a in keep]
        exact = exact.reshape([exact.shape[a] for a in keep])
        classes = classes.reshape([classes.shape[a] for a in keep])
    return [data.with_axes(shape, real_shape, maps, exact, classes, blame=blame)]


def rule_arg_reduce(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    """ArgMax, ArgMin, TopK: select along one axis."""
    data = as_data(inputs[0], ctx)  # type: ignore[arg-type]
    attrs = attributes(node)
    axis = _normalize_axis(attrs.get("axis", -1 if node.op_type == "TopK" else 0), data.rank)
    blame = data.blame
    exact = np.all(expand_axis(data.exact, axis, data.shape[axis]), axis=axis, keepdims=True)
    if data.maps[axis] is not None:
        exact = exact & False
        blame = blame or describe(node, f"selects along axis {axis}, which has padding")
    shape, real_shape, maps = list(data.shape), list(data.real_shape), list(data.maps)
    if node.op_type == "TopK":
        k = _ints(_concrete(node, inputs[1], "k"), "p")[0]  # type: ignore[index]
        shape[axis] = real_shape[axis] = k
        maps[axis] = None
        values = data.with_axes(
            shape, real_shape, maps, exact, data.classes.max(axis=axis, keepdims=True), blame=blame
        )
        indices = data.with_axes(
            shape, real_shape, maps, exact, np.int8(C.SMALL), elem_type=onnx.TensorProto.INT64, blame=blame
        )
        return [values, indices]
    keepdims = bool(attrs.get("keepdims", 1))
    shape[axis] = real_shape[axis] = 1
    maps[axis] = None
    classes = np.full((1,) * data.rank, C.SMALL, np.int8)
    if not keepdims:
        del shape[axis], real_shape[axis], maps[axis]
        exact = np.squeeze(exact, axis=axis)
        classes = np.squeeze(classes, axis=axis)
    return [
        data.with_axes(shape, real_shape, maps, exact, classes, elem_type=onnx.TensorProto.INT64, blame=blame)
    ]


def rule_cumsum(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    data = as_data(inputs[0], ctx)  # type: ignore[arg-type]
    axis = _normalize_axis((_ints(_concrete(node, inputs[1], "axis"), "p") or [0])[0], data.rank)
    attrs = attributes(node)
    reverse = bool(attrs.get("reverse", 0))
    axis_map = data.maps[axis]
    exact_full = expand_axis(data.exact, axis, data.shape[axis])
    classes_full = expand_axis(data.classes, axis, data.shape[axis])
    blame = data.blame
    order = np.arange(data.shape[axis])
    if reverse:
        order = order[::-1]
    own = order if axis_map is None else axis_map[order]
    real_in_order = own[own >= 0]
    # The caller's run sums its coordinates in increasing order, or decreasing with reverse=1: the real
    # coordinates must meet the padded run's summation in that same order, so that every real element's
    # prefix holds the same real elements (plus padding, which must hold zero).
    steps = np.diff(real_in_order)
    in_order = bool(np.all(steps < 0) if reverse else np.all(steps > 0))
    in_order = in_order and complete(axis_map, data.real_shape[axis])
    moved_exact = np.moveaxis(exact_full, axis, -1)[..., order]
    moved_classes = np.moveaxis(classes_full, axis, -1)[..., order]
    real = own >= 0
    # an element is exact when every element before it (in summation order) is real and exact, or padding
    # that holds zero
    contribution_ok = np.where(real, moved_exact, moved_classes == C.ZERO)
    prefix_ok = np.logical_and.accumulate(contribution_ok, axis=-1)
    exact = np.moveaxis(prefix_ok[..., np.argsort(order)], -1, axis)
    if not in_order:
        exact = exact & False
    if blame is None and not np.all(exact | ~_axis_real(data, axis)):
        blame = describe(node, f"accumulates along axis {axis} across padding that is not zero")
    classes = np.where(C.IS_UNMASKED[classes_full], C.SMALL, C.ANY).astype(np.int8)
    return [data.with_axes(data.shape, data.real_shape, data.maps, exact, classes, blame=blame)]


def rule_window(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    """Conv, ConvTranspose and pooling: a window over the spatial axes (2 and up)."""
    data = as_data(inputs[0], ctx)  # type: ignore[arg-type]
    attrs = attributes(node)
    shapes = _window_shapes(node, data, inputs, attrs)
    out_p, out_u = shapes if shapes is not None else _shapes_by_zeros(ctx, node, inputs)
    spatial = list(range(2, data.rank))
    kernel = attrs.get("kernel_shape")
    if (
        kernel is None
        and node.op_type in ("Conv", "ConvTranspose")
        and isinstance(inputs[1], (Data, Concrete))
    ):
        kernel = list(_shape(inputs[1], "p")[2:])
    strides = attrs.get("strides", [1] * len(spatial))
    pads = attrs.get("pads", [0] * 2 * len(spatial))
    pointwise = [
        axis
        for i, axis in enumerate(spatial)
        if kernel is not None
        and kernel[i] == 1
        and strides[i] == 1
        and pads[i] == 0
        and pads[i + len(spatial)] == 0
    ]
    mixed = [axis for axis in _remapped_axes(data, spatial) if axis not in pointwise]
    if node.op_type.startswith("Global"):
        mixed = _remapped_axes(data, spatial)
    blame = _first_blame(*[v for v in inputs if v is not None])
    window = _right_padded_window(node, data, mixed, kernel, strides, pads, attrs, out_p, out_u)
    if window is not None:
        # One spatial axis is right-padded and every real output reads real elements or padding the
        # unpadded run sees too (its own zero padding): exact there, by the window's arithmetic.
        axis, out_map, window_exact = window
        maps = [data.maps[0], None] + [
            out_map if a == axis else data.maps[a] if a in pointwise else None for a in spatial
        ]
        exact = window_exact  # channels and the other spatial axes are folded already
        if blame is None and not np.all(exact | ~real_grid(maps[: len(out_p)], out_p)):
            blame = describe(
                node,
                f"reads padding along axis {axis} that is not zero where the unpadded run reads its own "
                "zero padding",
            )
        mixed = []
    else:
        maps = [data.maps[0], None] + [
            data.maps[a] if a in pointwise else ctx.layouts.lookup(out_p[a], out_u[a]) for a in spatial
        ]
        folded = tuple([1] + [a for a in spatial if a not in pointwise])
        exact = np.all(data.exact | ~data.real_grid(), axis=folded, keepdims=True)
    for other in inputs[1:]:
        if isinstance(other, Data) and not other.is_exact():
            exact = exact & False
    if mixed:
        exact = exact & False
        blame = blame or describe(
            node, f"mixes neighbouring positions along axis {mixed[0]}, which has padding"
        )
    bad = np.any(~C.IS_UNMASKED[data.classes])
    classes = np.full((1,) * len(out_p), C.ANY if bad else C.SMALL, np.int8)
    return [
        Data(
            tuple(out_p),
            tuple(out_u),
            tuple(maps[: len(out_p)]),
            exact,
            classes,
            data.elem_type,
            _sources(*inputs),
            blame,
        )
    ]


def _window_shapes(
    node: onnx.NodeProto, data: Data, inputs: list[Value | None], attrs: dict[str, Any]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Output shapes of a Conv or MaxPool with explicit pads, by the window arithmetic (running the node
    on zeros of 30 s of audio takes seconds); None where the arithmetic is not this simple."""
    if node.op_type not in ("Conv", "MaxPool") or data.rank < 3 or len(node.output) > 1:
        return None
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET") or attrs.get("ceil_mode", 0):
        return None
    spatial = data.rank - 2
    if node.op_type == "Conv":
        weight = inputs[1]
        if weight is None:
            return None
        weight_shape = _shape(weight, "p")
        if len(weight_shape) != data.rank or weight_shape != _shape(weight, "u"):
            return None
        kernel = list(attrs.get("kernel_shape", weight_shape[2:]))
        channels = weight_shape[0]
        group = attrs.get("group", 1)
        if weight_shape[1] * group != data.shape[1] or list(weight_shape[2:]) != kernel:
            return None
    else:
        kernel = list(attrs["kernel_shape"])
        channels = data.shape[1]
    strides = attrs.get("strides", [1] * spatial)
    dilations = attrs.get("dilations", [1] * spatial)
    pads = attrs.get("pads", [0] * 2 * spatial)
    if not (len(kernel) == len(strides) == len(dilations) == spatial and len(pads) == 2 * spatial):
        return None
    results = []
    for shape in (data.shape, data.real_shape):
        out = [shape[0], channels]
        for i in range(spatial):
            span = dilations[i] * (kernel[i] - 1) + 1
            room = shape[2 + i] + pads[i] + pads[i + spatial] - span
            if room < 0:
                return None  # the node fails at this size: let running it say so
            out.append(room // strides[i] + 1)
        results.append(tuple(out))
    return results[0], results[1]


def _right_padded_window(
    node: onnx.NodeProto,
    data: Data,
    mixed: Sequence[int],
    kernel: Sequence[int] | None,
    strides: Sequence[int],
    pads: Sequence[int],
    attrs: dict[str, Any],
    out_p: Sequence[int],
    out_u: Sequence[int],
) -> tuple[int, AxisMap, np.ndarray] | None:
    """For a Conv or MaxPool whose only mixed spatial axis is right-padded (its real coordinates are the
    prefix ``0..n-1`` in order, padding after): that axis, the output's map along it, and per output
    element (broadcastable to the output, the window axis full length) whether it is exact.

    Output ``j`` reads input ``j*stride - pad_begin + t*dilation`` for ``t < kernel``, in both runs, so it
    stands for output ``j`` of the unpadded run, which exists for ``j < out_u``. Where the unpadded run
    reads outside ``[0, n)`` it sees its own padding: the padded run must see the same there, i.e. its
    own padding too (before 0 or past its end), or, for a Conv (zero padding), a padding element known
    to be exactly 0. None when any of this does not apply: the caller keeps the general verdict.
    """
    if node.op_type not in ("Conv", "MaxPool") or len(mixed) != 1 or kernel is None:
        return None
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET", b"VALID", "VALID"):
        return None
    if node.op_type == "MaxPool" and (attrs.get("ceil_mode", 0) or len(node.output) > 1):
        return None
    axis = mixed[0]
    if data.rank != len(out_p) or any(data.maps[a] is not None for a in range(2, data.rank) if a != axis):
        return None
    axis_map = data.maps[axis]
    size_p, n = data.shape[axis], data.real_shape[axis]
    if axis_map is None or not np.array_equal(
        axis_map, np.where(np.arange(size_p) < n, np.arange(size_p), -1)
    ):
        return None  # left or interior padding, or reordered positions
    i = axis - 2
    spatial = data.rank - 2
    dilations = attrs.get("dilations", [1] * spatial)
    k, stride, dilation, begin = int(kernel[i]), int(strides[i]), int(dilations[i]), int(pads[i])
    count_p, count_u = int(out_p[axis]), int(out_u[axis])
    if count_u > count_p:
        return None
    # Whether each input position may be read by a real output: a real exact element, or (Conv only)
    # padding that holds exactly 0, as the unpadded run's zero padding does. Other axes of the window
    # (channels, other spatial axes) are folded: any inexact element there spoils the output.
    others = tuple(a for a in range(1, data.rank) if a != axis)
    exact_full = expand_axis(data.exact | ~data.real_grid(), axis, size_p)
    real_exact = np.all(exact_full, axis=others, keepdims=True) if others else exact_full
    if node.op_type == "Conv":
        classes_full = expand_axis(data.classes, axis, size_p)
        zero = classes_full == C.ZERO
        padding_zero = np.all(zero, axis=others, keepdims=True) if others else zero
    else:
        padding_zero = np.zeros((1,) * data.rank, bool)
    real = (np.arange(size_p) < n).reshape([size_p if a == axis else 1 for a in range(data.rank)])
    readable = np.where(real, real_exact, padding_zero)
    # Reads before 0 or past the padded end hit the padded run's own padding: always fine.
    low = max(0, begin)
    high = max(0, (count_p - 1) * stride - begin + (k - 1) * dilation - size_p + 1)
    widths = [(low, high) if a == axis else (0, 0) for a in range(data.rank)]
    readable = np.pad(
        np.broadcast_to(readable, [size_p if a == axis else s for a, s in enumerate(readable.shape)]),
        widths,
        constant_values=True,
    )
    reads = (
        np.arange(count_p)[:, None] * stride - begin + np.arange(k)[None, :] * dilation + low
    )  # [count_p, k], shifted into the padded array
    if reads.size and (reads.min() < 0 or reads.max() >= readable.shape[axis]):
        return None
    picked = np.take(readable, reads.reshape(-1), axis=axis)
    shape = list(picked.shape)
    shape[axis : axis + 1] = [count_p, k]
    window_exact = np.all(picked.reshape(shape), axis=axis + 1)
    out_map = identity_or(np.where(np.arange(count_p) < count_u, np.arange(count_p), -1))
    return axis, out_map, window_exact


def _run_on_zeros(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[list[np.ndarray]]:
    """The node's outputs in both runs (padded, then unpadded), computed on zeros of the input shapes and
    types: what an operator without a rule is known by (its output shapes and types)."""
    results = []
    for run in ("p", "u"):
        arrays: list[np.ndarray | None] = []
        for value in inputs:
            if value is None:
                arrays.append(None)
            elif isinstance(value, Concrete):
                arrays.append(value.padded if run == "p" else value.unpadded)
            else:
                shape = value.shape if run == "p" else value.real_shape
                if int(np.prod(shape)) > ELEMENT_LIMIT * 4:
                    raise ProofAborted(describe(node, "is too large to derive its output shape"))
                dtype = onnx.helper.tensor_dtype_to_np_dtype(value.elem_type)
                arrays.append(np.zeros(shape, dtype=dtype))
        try:
            results.append(ctx.evaluator.run(node, arrays))
        except EvaluationError as error:
            raise ProofAborted(describe(node, f"its output shape cannot be derived: {error}")) from error
    return results


def _shapes_by_zeros(
    ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The first output's shapes in both runs, by running the node on zeros of the input shapes."""
    padded, unpadded = _run_on_zeros(ctx, node, inputs)
    return tuple(padded[0].shape), tuple(unpadded[0].shape)


def rule_one_hot(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    indices = as_data(inputs[0], ctx)  # type: ignore[arg-type]
    depth = _ints(_concrete(node, inputs[1], "depth"), "p")[0]  # type: ignore[index]
    axis = _normalize_axis(attributes(node).get("axis", -1), indices.rank + 1)
    shape = list(indices.shape)
    shape.insert(axis, depth)
    real_shape = list(indices.real_shape)
    real_shape.insert(axis, depth)
    maps = list(indices.maps)
    maps.insert(axis, None)
    values = inputs[2]
    value_class = (
        C.SMALL
        if not isinstance(values, Concrete)
        else max(int(c) for c in C.classify(values.padded).reshape(-1))
    )
    return [
        Data(
            tuple(shape),
            tuple(real_shape),
            tuple(maps),
            np.expand_dims(indices.exact, axis),
            np.int8(value_class if value_class <= C.SMALL else C.ANY),
            _data_type(values) if values is not None else onnx.TensorProto.FLOAT,
            indices.sources,
            indices.blame,
        )
    ]


def rule_not_followed(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    """An operator without a rule: shapes from running it on zeros, nothing exact. A runtime's own operator
    (onnxruntime's fused Attention, ...) stops the proof: it has no rule, and no ONNX semantics to run."""
    if node.domain not in ("", "ai.onnx") or not onnx.defs.has(node.op_type):
        raise ProofAborted(
            describe(
                node,
                f"is onnxruntime's own operator {node.domain or 'ai.onnx'}::{node.op_type}, which the "
                "padding proof has no rule for, so the graph is compiled at the sizes of each call",
            )
        )
    template = next(v for v in inputs if isinstance(v, Data))
    blame = describe(node, f"has no padding rule ({node.domain or 'ai.onnx'}::{node.op_type})")
    padded, unpadded = _run_on_zeros(ctx, node, inputs)
    # each output with its own shapes and type (QuantizeLinear turns floats into 8-bit integers)
    return [
        replace(_opaque(template, p.shape, u.shape, blame), elem_type=elem_type_of(p))
        for p, u in zip(padded, unpadded, strict=False)
    ]


def rule_data_dependent(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    raise ProofAborted(
        describe(node, "produces a shape that depends on user data (it selects elements at run time)")
    )


#: A rule: the values of a node's outputs from the values of its inputs.
Rule = Callable[[Context, onnx.NodeProto, list[Value | None]], list[Any]]


RULES: dict[str, Rule] = {
    **{op: rule_binary for op in C.BINARY},
    **{op: rule_unary for op in C.UNARY},
    **{op: rule_variadic for op in ("Min", "Max", "Sum", "Mean")},
    "Cast": rule_cast,
    "CastLike": rule_cast,
    "Where": rule_where,
    "Clip": rule_clip,
    "Identity": rule_identity,
    "Transpose": rule_transpose,
    "Unsqueeze": rule_unsqueeze,
    "Squeeze": rule_squeeze,
    "Reshape": rule_reshape,
    "Flatten": rule_reshape,
    "Expand": rule_expand,
    "Tile": rule_tile,
    "Concat": rule_concat,
    "Slice": rule_slice,
    "Split": rule_split,
    "Gather": rule_gather,
    "GatherElements": rule_moved_elements,
    "GatherND": rule_moved_elements,
    "ScatterND": rule_moved_elements,
    "ScatterElements": rule_moved_elements,
    "Trilu": rule_moved_elements,
    "Pad": rule_moved_elements,
    "Shape": rule_shape,
    "Size": rule_shape,
    "MatMul": rule_matmul,
    "Gemm": rule_gemm,
    "Einsum": rule_einsum,
    "Softmax": rule_softmax,
    "LogSoftmax": rule_softmax,
    "LayerNormalization": rule_normalization,
    "GroupNormalization": rule_normalization,
    "InstanceNormalization": rule_normalization,
    "LpNormalization": rule_normalization,
    **{
        op: rule_reduce
        for op in (
            "ReduceSum",
            "ReduceMean",
            "ReduceMax",
            "ReduceMin",
            "ReduceProd",
            "ReduceL1",
            "ReduceL2",
            "ReduceLogSum",
            "ReduceLogSumExp",
            "ReduceSumSquare",
        )
    },
    "ArgMax": rule_arg_reduce,
    "ArgMin": rule_arg_reduce,
    "TopK": rule_arg_reduce,
    "CumSum": rule_cumsum,
    **{
        op: rule_window
        for op in (
            "Conv",
            "ConvTranspose",
            "MaxPool",
            "AveragePool",
            "LpPool",
            "GlobalAveragePool",
            "GlobalMaxPool",
            "GlobalLpPool",
        )
    },
    "OneHot": rule_one_hot,
    "NonZero": rule_data_dependent,
    "Compress": rule_data_dependent,
    "Unique": rule_data_dependent,
    "Range": rule_data_dependent,
    "ConstantOfShape": rule_data_dependent,
}


# onnxruntime's fused operators (domain com.microsoft) that its graph optimizer writes. Each is proven as
# the composition of standard operators that onnxruntime's operator documentation (ContribOperators.md)
# defines it to compute; the parts are read as synthetic standard nodes that keep the fused node's name.


def _part(node: onnx.NodeProto, op_type: str, **attrs: Any) -> onnx.NodeProto:
    """A standard operator that ``node`` computes as one of its parts (messages name ``node``)."""
    return onnx.helper.make_node(op_type, [], [node.output[0]], name=f"{node.name} ({node.op_type})", **attrs)


def _summed(ctx: Context, node: onnx.NodeProto, operands: Sequence[Value | None]) -> Data:
    present = [v for v in operands if v is not None]
    return elementwise(ctx, _part(node, "Add"), present, _table_combine(C.BINARY["Add"]))


def rule_skip_normalization(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    """SkipLayerNormalization (input, skip, gamma, beta, bias) and SkipSimplifiedLayerNormalization (input,
    skip, gamma, bias): input + skip + bias, then LayerNormalization (or its RMS form, statistics over
    the same axis) over the last axis. Outputs: the result, mean and inv_std_var (statistics, not
    followed), and the sum input_skip_bias_sum."""
    inputs = [*inputs, None, None][:5]
    simplified = node.op_type == "SkipSimplifiedLayerNormalization"
    bias, beta = (inputs[3], None) if simplified else (inputs[4], inputs[3])
    total = _summed(ctx, node, [inputs[0], inputs[1], bias])
    layer_norm = _part(node, "LayerNormalization", axis=-1)
    normalized = rule_normalization(ctx, layer_norm, [total, inputs[2], beta])[0]
    statistics = normalized.inexact(describe(node, "statistics outputs are not followed"))
    return [normalized, statistics, statistics, total][: len(node.output)]


def rule_simplified_normalization(
    ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]
) -> list[Data]:
    """SimplifiedLayerNormalization (X, scale): RMS normalization over the axes from ``axis`` on, the
    statistics of LayerNormalization's; its second output, inv_std_var, is not followed."""
    axis = attributes(node).get("axis", -1)
    normalized = rule_normalization(ctx, _part(node, "LayerNormalization", axis=axis), inputs[:2])[0]
    statistics = normalized.inexact(describe(node, "statistics outputs are not followed"))
    return [normalized, statistics][: len(node.output)]


def rule_biased_gelu(ctx: Context, node: onnx.NodeProto, inputs: list[Value | None]) -> list[Data]:
    """Gelu, FastGelu (X, bias), BiasGelu (A, B) and QuickGelu (X * Sigmoid(alpha * X)): a smooth activation
    of the sum, 0 at 0, as Gelu."""
    total = _summed(ctx, node, inputs[:2])
    return [elementwise(ctx, _part(node, "Gelu"), [total], _unary_combine(C.UNARY["Gelu"]))]


#: Rules for onnxruntime's own operators, by type (domain com.microsoft; SimplifiedLayerNormalization is
#: written in the ONNX domain, which defines no operator of that name).
CONTRIB_RULES: dict[str, Rule] = {
    "SkipLayerNormalization": rule_skip_normalization,
    "SkipSimplifiedLayerNormalization": rule_skip_normalization,
    "SimplifiedLayerNormalization": rule_simplified_normalization,
    "Gelu": rule_biased_gelu,
    "FastGelu": rule_biased_gelu,
    "BiasGelu": rule_biased_gelu,
    "QuickGelu": rule_biased_gelu,
}


def rule_for(node: onnx.NodeProto) -> Rule | None:
    """The rule that proves ``node``, by its domain and type (None: it has none)."""
    if node.domain in ("", "ai.onnx"):
        rule = RULES.get(node.op_type)
        if rule is None and not onnx.defs.has(node.op_type):  # onnxruntime's own, in the ONNX domain
            rule = CONTRIB_RULES.get(node.op_type)
        return rule
    return CONTRIB_RULES.get(node.op_type) if node.domain == "com.microsoft" else None
