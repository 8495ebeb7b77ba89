"""GatherElements, GatherND and ScatterND (absent from PopART) as Gather/ScatterElements on flattened data,
and the scatter reductions (ScatterND and ScatterElements, opset 16/18) as a mask and a Reduce*.

With static shapes, every element these operators address has a row-major flat offset: the indices
given, times the data's strides, plus the positions of the dimensions not indexed (constants). The
offsets are constants when the indices are; otherwise they are computed with integer Mul/Add.
"""

from __future__ import annotations

import numpy as np
import onnx

from ...graphs import attribute
from .common import CannotLower, GraphScope, Rewrite, numpy_dtype, text_attribute


def row_major_strides(dims: tuple[int, ...] | list[int]) -> np.ndarray:
    """How far apart (in elements) consecutive indices of each dimension lie in row-major order."""
    strides = np.ones(len(dims), dtype=np.int64)
    for axis in range(len(dims) - 2, -1, -1):
        strides[axis] = strides[axis + 1] * dims[axis + 1]
    return strides


class _FlatIndexBuilder:
    """Emits the nodes that turn (possibly runtime) indices into flat offsets."""

    def __init__(self, scope: GraphScope, hint: str) -> None:
        self.scope = scope
        self.hint = hint
        self.nodes: list[onnx.NodeProto] = []

    def emit(
        self, op_type: str, inputs: list[str], suffix: str, output: str | None = None, **attrs: object
    ) -> str:
        node = self.scope.make_node(
            op_type, inputs, [output] if output else 1, f"{self.hint}/{suffix}", **attrs
        )
        self.nodes.append(node)
        return node.output[0]

    def constant(self, value: np.ndarray, suffix: str) -> str:
        return self.scope.add_constant(value, f"{self.hint}/{suffix}")

    def non_negative(self, indices: str, dims: np.ndarray, dtype: np.dtype) -> str:
        """Negative indices count from the end of their dimension (``dims`` broadcasts against them)."""
        zero = self.constant(np.zeros((), dtype), "zero")
        is_negative = self.emit("Less", [indices, zero], "is_negative")
        wrapped = self.emit("Add", [indices, self.constant(dims.astype(dtype), "dims")], "wrapped")
        return self.emit("Where", [is_negative, wrapped, indices], "non_negative")

    def flatten(
        self, tensor: str, suffix: str, leading: int | None = None, rest: tuple[int, ...] = ()
    ) -> str:
        shape = np.array([-1 if leading is None else leading, *rest], dtype=np.int64)
        return self.emit("Reshape", [tensor, self.constant(shape, f"{suffix}_shape")], suffix)


def _flat_index_builder(
    scope: GraphScope, node: onnx.NodeProto, addressed_as: str
) -> tuple[_FlatIndexBuilder, tuple[int, ...], tuple[int, ...]]:
    """A builder for the node's replacement, and the static shapes of its data (input 0) and indices (1).

    The shapes are checked first, so a refusal leaves nothing emitted.
    """
    data_dims = scope.require_static_shape(
        node.input[0], f"{node.op_type} needs to address its data as {addressed_as}"
    )
    index_dims = scope.require_static_shape(node.input[1], f"{node.op_type} needs to build its offsets")
    return _FlatIndexBuilder(scope, node.name or node.op_type), data_dims, index_dims


def _index_dtype(scope: GraphScope, indices: str) -> np.dtype:
    return numpy_dtype(scope.require_elem_type(indices))


class GatherElementsRewrite(Rewrite):
    """GatherElements(data, indices, axis) becomes Gather on the flattened data at flat offsets."""

    op_types = frozenset({"GatherElements"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        data, indices = node.input[0], node.input[1]
        builder, data_dims, index_dims = _flat_index_builder(scope, node, addressed_as="flat")
        rank = len(data_dims)
        axis = int(attribute(node, "axis", 0))
        axis = axis + rank if axis < 0 else axis
        strides = row_major_strides(data_dims)
        dtype = _index_dtype(scope, indices)
        # The offset contributed by every dimension other than `axis` is its position times its stride.
        grid = np.meshgrid(*[np.arange(n, dtype=np.int64) for n in index_dims], indexing="ij")
        base = sum((grid[k] * strides[k] for k in range(rank) if k != axis), np.zeros(index_dims, np.int64))
        flat_data = builder.flatten(data, "flat_data")
        known = scope.constant(indices)
        if known is not None:
            along = np.where(known < 0, known + data_dims[axis], known).astype(np.int64)
            offsets = builder.constant((base + along * strides[axis]).astype(dtype), "offsets")
        else:
            along = builder.non_negative(indices, np.array(data_dims[axis]), dtype)
            scaled = builder.emit(
                "Mul", [along, builder.constant(np.array(strides[axis], dtype), "stride")], "scaled"
            )
            offsets = builder.emit("Add", [scaled, builder.constant(base.astype(dtype), "base")], "offsets")
        builder.emit("Gather", [flat_data, offsets], "gather", node.output[0], axis=0)
        return builder.nodes


def _row_offsets(
    builder: _FlatIndexBuilder, scope: GraphScope, indices: str, dims: tuple[int, ...], keepdims: int
) -> tuple[str, np.ndarray | None]:
    """Index tuples (last axis of ``indices``) addressing the leading dims ``dims``, as row numbers."""
    strides = row_major_strides(dims)
    known = scope.constant(indices)
    if known is not None:
        tuples = np.where(known < 0, known + np.array(dims, np.int64), known).astype(np.int64)
        rows = (tuples * strides).sum(axis=-1, keepdims=bool(keepdims))
        return "", rows
    dtype = _index_dtype(scope, indices)
    tuples_name = builder.non_negative(indices, np.array(dims, np.int64), dtype)
    weighted = builder.emit(
        "Mul", [tuples_name, builder.constant(strides.astype(dtype), "strides")], "weighted"
    )
    return builder.emit("ReduceSum", [weighted], "rows", axes=[-1], keepdims=keepdims), None


class GatherNDRewrite(Rewrite):
    """GatherND (any batch_dims) becomes Gather over the data reshaped to [rows, *slice dims]."""

    op_types = frozenset({"GatherND"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        data, indices = node.input[0], node.input[1]
        builder, data_dims, index_dims = _flat_index_builder(scope, node, addressed_as="rows")
        batch_dims = int(attribute(node, "batch_dims", 0))
        depth = index_dims[-1]
        addressed = data_dims[: batch_dims + depth]
        rows_data = builder.flatten(
            data, "rows_data", int(np.prod(addressed)), tuple(data_dims[batch_dims + depth :])
        )
        # Each batch (the leading batch_dims, shared by data and indices) owns a block of rows.
        batch_grid = np.meshgrid(*[np.arange(n, dtype=np.int64) for n in index_dims[:-1]], indexing="ij")
        batch_strides = row_major_strides(addressed)
        batch_base = sum(
            (batch_grid[k] * batch_strides[k] for k in range(batch_dims)), np.zeros(index_dims[:-1], np.int64)
        )
        name, rows = _row_offsets(builder, scope, indices, tuple(addressed[batch_dims:]), keepdims=0)
        dtype = _index_dtype(scope, indices)
        if rows is not None:
            offsets = builder.constant((rows + batch_base).astype(dtype), "offsets")
        elif batch_dims:
            offsets = builder.emit(
                "Add", [name, builder.constant(batch_base.astype(dtype), "batch_base")], "offsets"
            )
        else:
            offsets = name
        builder.emit("Gather", [rows_data, offsets], "gather", node.output[0], axis=0)
        return builder.nodes


# The scatter reductions: (the opset-11 reduction over the updates that hit a position, its identity).
_REDUCTIONS = {
    "add": ("ReduceSum", 0),
    "mul": ("ReduceProd", 1),
    "max": ("ReduceMax", "min"),
    "min": ("ReduceMin", "max"),
}


def _identity(value: int | str, dtype: np.dtype) -> np.ndarray:
    """The neutral element of a reduction in ``dtype``: 0, 1, or the type's lowest ("min") or highest
    ("max") value (infinity for floats)."""
    if isinstance(value, int):
        return np.array(value, dtype)
    if np.issubdtype(dtype, np.floating):
        return np.array(-np.inf if value == "min" else np.inf, dtype)
    return np.array(getattr(np.iinfo(dtype), value), dtype)


def scatter_reduction(node: onnx.NodeProto) -> str:
    """The node's ``reduction`` attribute ('none' when absent), refused unless ONNX defines it."""
    reduction = text_attribute(node, "reduction", "none")
    if reduction != "none" and reduction not in _REDUCTIONS:
        raise CannotLower(f"reduction='{reduction}' is not one of ONNX's (add, mul, max, min)")
    return reduction


class ScatterNDRewrite(Rewrite):
    """ScatterND becomes ScatterElements on the flattened data at each update's offset. With a reduction
    (opset 16/18) every row of the data instead combines with every update aimed at it
    (``_reduce_into_rows``): exact, as onnxruntime applies repeated indices one after another and these
    reductions are associative (a float sum up to its rounding order)."""

    op_types = frozenset({"ScatterND"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        reduction = scatter_reduction(node)
        data, indices, updates = node.input[0], node.input[1], node.input[2]
        builder, data_dims, index_dims = _flat_index_builder(scope, node, addressed_as="flat")
        depth = index_dims[-1]
        slice_size = int(np.prod(data_dims[depth:], dtype=np.int64))
        name, rows = _row_offsets(builder, scope, indices, tuple(data_dims[:depth]), keepdims=1)
        dtype = _index_dtype(scope, indices)
        if reduction != "none":
            row_count = int(np.prod(data_dims[:depth], dtype=np.int64))
            scattered = _reduce_into_rows(
                builder,
                reduction,
                numpy_dtype(scope.require_elem_type(data)),
                builder.flatten(data, "data_rows", row_count, (slice_size,)),
                builder.constant(rows.reshape(-1, 1).astype(dtype), "row_numbers")
                if rows is not None
                else builder.flatten(name, "row_numbers", None, (1,)),
                builder.flatten(updates, "update_rows", None, (slice_size,)),
                np.arange(row_count, dtype=dtype),
            )
        else:
            within = np.arange(slice_size, dtype=np.int64)
            if rows is not None:
                offsets = builder.constant((rows * slice_size + within).reshape(-1).astype(dtype), "offsets")
            else:
                starts = builder.emit(
                    "Mul", [name, builder.constant(np.array(slice_size, dtype), "slice_size")], "starts"
                )
                grid = builder.emit(
                    "Add", [starts, builder.constant(within.astype(dtype), "within")], "element_offsets"
                )
                offsets = builder.flatten(grid, "offsets")
            flat_data = builder.flatten(data, "flat_data")
            flat_updates = builder.flatten(updates, "flat_updates")
            scattered = builder.emit("ScatterElements", [flat_data, offsets, flat_updates], "scatter", axis=0)
        shape = builder.constant(np.array(data_dims, np.int64), "shape")
        builder.emit("Reshape", [scattered, shape], "reshape", node.output[0])
        return builder.nodes


def lower_scatter_elements_reduction(
    node: onnx.NodeProto, reduction: str, scope: GraphScope
) -> list[onnx.NodeProto]:
    """ScatterElements with a reduction (opset 16/18): the data seen with ``axis`` first as rows
    [axis size, rest] and the updates as [update count along axis, rest], where each element's row is its
    index, then ``_reduce_into_rows`` (exact like ScatterND's: every update aimed at a position, repeats
    included, combined with its value). Updates may be smaller than the data on the other axes: they are
    padded to the data's extent with the index -1, which names no row."""
    data, indices, updates = node.input[0], node.input[1], node.input[2]
    builder, data_dims, index_dims = _flat_index_builder(scope, node, addressed_as="rows along its axis")
    rank = len(data_dims)
    axis = int(attribute(node, "axis", 0))
    axis = axis + rank if axis < 0 else axis
    size = data_dims[axis]
    dtype = _index_dtype(scope, indices)
    value_dtype = numpy_dtype(scope.require_elem_type(data))
    order = [axis, *(k for k in range(rank) if k != axis)]
    moved_data = tuple(data_dims[k] for k in order)
    moved_index = tuple(index_dims[k] for k in order)
    rest = int(np.prod(moved_data[1:], dtype=np.int64))
    # Pad-11's pads: nothing before, up to the data's extent after, on every axis but the first.
    short = [0, *(d - i for d, i in zip(moved_data[1:], moved_index[1:], strict=True))]
    pads = np.array([0] * rank + short, np.int64)

    def as_rows(tensor: str, fill: np.ndarray, suffix: str) -> str:
        if axis:
            tensor = builder.emit("Transpose", [tensor], f"{suffix}_moved", perm=order)
        if any(short):
            tensor = builder.emit(
                "Pad",
                [tensor, builder.constant(pads, f"{suffix}_pads"), builder.constant(fill, f"{suffix}_fill")],
                f"{suffix}_padded",
            )
        return builder.flatten(tensor, suffix, None, (rest,))

    known = scope.constant(indices)
    if known is not None:
        mapped = np.where(known < 0, known + size, known).astype(dtype).transpose(order)
        padded = np.pad(mapped, [(0, n) for n in short], constant_values=-1)
        row_numbers = builder.constant(padded.reshape(-1, rest), "row_numbers")
    else:
        mapped_name = builder.non_negative(indices, np.array(size), dtype)
        row_numbers = as_rows(mapped_name, np.array(-1, dtype), "row_numbers")
    reduced = _reduce_into_rows(
        builder,
        reduction,
        value_dtype,
        builder.flatten(
            builder.emit("Transpose", [data], "data_moved", perm=order) if axis else data,
            "data_rows",
            size,
            (rest,),
        ),
        row_numbers,
        as_rows(updates, np.zeros((), value_dtype), "update_rows"),  # padding: at index -1, never read
        np.arange(size, dtype=dtype),
    )
    shape = builder.constant(np.array(moved_data, np.int64), "shape")
    if not axis:
        builder.emit("Reshape", [reduced, shape], "reshape", node.output[0])
        return builder.nodes
    moved = builder.emit("Reshape", [reduced, shape], "reshape")
    builder.emit("Transpose", [moved], "restore", node.output[0], perm=[int(k) for k in np.argsort(order)])
    return builder.nodes


def _reduce_into_rows(
    builder: _FlatIndexBuilder,
    reduction: str,
    value_dtype: np.dtype,
    data_rows: str,
    row_numbers: str,
    update_rows: str,
    all_rows: np.ndarray,
) -> str:
    """``data_rows`` [rows, slice] with each update row [updates, slice] combined into the rows its row
    numbers name: ``row_numbers`` is [updates, 1] (a whole update row goes to one row, ScatterND) or
    [updates, slice] (each element has its own row, ScatterElements). A mask [updates, rows, 1 or slice]
    of row numbers against rows places every update in its row (the reduction's identity elsewhere),
    and the reduction over the updates is applied to the data."""
    reducer, identity = _REDUCTIONS[reduction]
    hits = builder.emit(
        "Equal",
        [
            builder.emit("Unsqueeze", [row_numbers], "row_column", axes=[1]),
            builder.constant(all_rows.reshape(1, -1, 1), "rows"),
        ],
        "hits",
    )  # [updates, rows, 1 or slice]
    placed = builder.emit(
        "Where",
        [
            hits,
            builder.emit("Unsqueeze", [update_rows], "update_cells", axes=[1]),
            builder.constant(_identity(identity, value_dtype), "identity"),
        ],
        "placed",
    )  # [updates, rows, slice]
    combined = builder.emit(reducer, [placed], "combined", axes=[0], keepdims=0)
    if reduction in ("add", "mul"):
        return builder.emit("Add" if reduction == "add" else "Mul", [data_rows, combined], "applied")
    # max/min: rows no update hits keep their value (the identity may not be representable); Greater or
    # Less with Where, as opset 11's Max and Min take no integers.
    wins = builder.emit("Greater" if reduction == "max" else "Less", [combined, data_rows], "wins")
    extreme = builder.emit("Where", [wins, combined, data_rows], "extreme")
    hit_counts = builder.emit("Cast", [hits], "hit_counts", to=onnx.TensorProto.INT32)
    any_hit = builder.emit("ReduceMax", [hit_counts], "any_hit", axes=[0], keepdims=0)
    touched = builder.emit("Cast", [any_hit], "touched", to=onnx.TensorProto.BOOL)  # [rows, 1 or slice]
    return builder.emit("Where", [touched, extreme, data_rows], "applied")
