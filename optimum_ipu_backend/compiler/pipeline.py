"""legalize(): the ordered passes that turn an exported ONNX graph into one PopART can compile."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx

from .errors import PATTERN_PASS_FAILURE, CompilerBugError, LegalizationError, UnsupportedNode
from .external_data import is_external, read_weight
from .graphs import (
    WeightFreeCopy,
    count_ops,
    initializer_inputs_as_constants,
    iter_graphs,
    names_read,
    weight_free_copy,
)
from .op_table import dtype_name
from .passes.base import GraphPass, PassContext, PassReport
from .passes.fix_shapes import FixShapes, dim_labels
from .passes.fold_constants import FoldConstants
from .passes.fold_static_ifs import FoldStaticIfs
from .passes.int64_to_int32 import Int64ToInt32, to_int32_values
from .passes.lower_opset11 import LowerToOpset11
from .passes.precision_fp16 import ToFloat16, to_float16_values
from .passes.shard_over_ipus import Sharding, ShardOverIPUs
from .passes.verify import VerifyPopartReady

PRECISIONS = ("fp32", "fp16")


@dataclass
class LegalizedGraph:
    """A PopART-ready graph and what the session needs to feed it."""

    model: onnx.ModelProto
    reports: list[PassReport] = field(default_factory=list)
    #: ONNX elem types of the legalized graph's inputs/outputs; the session casts host arrays to these.
    input_types: dict[str, int] = field(default_factory=dict)
    output_types: dict[str, int] = field(default_factory=dict)
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    output_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    precision: str = "fp32"
    #: The directory the model's external weight references are relative to (the export's), or None.
    weights_dir: Path | None = None
    #: The initializers that are the export's weights (in whatever type the passes gave them): what
    #: ``external_data.save_graph`` puts in the data file, the same set for every shape.
    weight_names: frozenset[str] = frozenset()


def build_passes(precision: str, sharding: Sharding | None = None) -> list[GraphPass]:
    """The passes in the order they run for ``precision`` (and ``sharding`` over several IPUs)."""
    passes: list[GraphPass] = [
        FixShapes(),
        FoldStaticIfs(),
        FoldConstants(),
        LowerToOpset11(),
        FoldConstants(name="fold_constants (cleanup)", only_if_foldable=True),
        Int64ToInt32(),
    ]
    if precision == "fp16":
        passes.append(ToFloat16())
    if sharding is not None and sharding.ipus > 1:
        passes.append(ShardOverIPUs(sharding))
    passes.append(VerifyPopartReady())
    return passes


def _ops_delta(before: dict[str, int], after: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    removed = {op: n - after.get(op, 0) for op, n in before.items() if n > after.get(op, 0)}
    added = {op: n - before.get(op, 0) for op, n in after.items() if n > before.get(op, 0)}
    return dict(sorted(removed.items())), dict(sorted(added.items()))


def _summary(notes: Sequence[str], removed: dict[str, int], added: dict[str, int]) -> str:
    parts = list(notes)
    if removed:
        parts.append("removed " + ", ".join(f"{n} {op}" for op, n in removed.items()))
    if added:
        parts.append("added " + ", ".join(f"{n} {op}" for op, n in added.items()))
    return "; ".join(parts) if parts else "no change"


def _run_pass(
    graph_pass: GraphPass, model: onnx.ModelProto, ctx: PassContext, reports: list[PassReport]
) -> onnx.ModelProto:
    before = count_ops(model.graph)
    started = time.perf_counter()
    try:
        result = graph_pass.run(model, ctx)
    except LegalizationError as error:
        error.reports = list(reports)
        error.failed_pass = graph_pass.name
        error.model = model
        raise
    except Exception as error:
        wrapped = CompilerBugError(graph_pass.name, error)
        wrapped.reports = list(reports)
        wrapped.model = model
        raise wrapped from error
    seconds = time.perf_counter() - started
    after = count_ops(result.graph)
    removed, added = _ops_delta(before, after)
    notes = list(getattr(graph_pass, "notes", []))
    reports.append(
        PassReport(
            name=graph_pass.name,
            # verify only reports; its note is a verdict, not a change
            changed=bool(removed or added or (notes and not isinstance(graph_pass, VerifyPopartReady))),
            summary=_summary(notes, removed, added),
            nodes_before=sum(before.values()),
            nodes_after=sum(after.values()),
            ops_removed=removed,
            ops_added=added,
            seconds=seconds,
        )
    )
    return result


#: Integer weights whose every value float32 holds exactly (quantized weights, retyped by the QDQ lowering).
_EXACT_IN_FLOAT = frozenset(
    {onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16, onnx.TensorProto.UINT16}
)


def _converted_weight(tensor: onnx.TensorProto, elem_type: int, weights_dir: Path | None) -> onnx.TensorProto:
    """The weight in the type the passes gave its stand-in input (fp16 / int32 / quantized-to-float32
    conversions). A weight
    that keeps its type stays where it is (an external one is still a reference into the export's file);
    a converted one is read (mapped, one at a time) and held converted in memory."""
    if elem_type == tensor.data_type:
        return tensor
    values = read_weight(tensor, weights_dir) if is_external(tensor) else onnx.numpy_helper.to_array(tensor)
    if tensor.data_type == onnx.TensorProto.FLOAT and elem_type == onnx.TensorProto.FLOAT16:
        converted, _ = to_float16_values(values)
    elif tensor.data_type in _EXACT_IN_FLOAT and elem_type == onnx.TensorProto.FLOAT:
        converted = values.astype(np.float32)  # a quantized weight, dequantized on the device
    elif tensor.data_type == onnx.TensorProto.INT64 and elem_type == onnx.TensorProto.INT32:
        problems: list[UnsupportedNode] = []
        converted = to_int32_values(values, tensor.name, problems)
        if problems:
            raise LegalizationError("A weight does not fit in int32.", problems)
    else:
        reason = f"no conversion from {dtype_name(tensor.data_type)} to {dtype_name(elem_type)}"
        raise LegalizationError(
            "A weight changed type.",
            [UnsupportedNode(tensor.name, "initializer", "", reason, PATTERN_PASS_FAILURE)],
        )
    return onnx.numpy_helper.from_array(converted, tensor.name)


def _attach_weights(
    light: onnx.ModelProto, detached: WeightFreeCopy, weights_dir: Path | None = None
) -> onnx.ModelProto:
    """Put the weights back as initializers (in place) in the types the passes chose; drop unused ones."""
    if not detached.weights:
        return light
    graph = light.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in graph.input}
    kept_inputs = [vi for vi in graph.input if vi.name not in detached.added_inputs]
    del graph.input[:]
    graph.input.extend(kept_inputs)
    read = names_read(graph)
    for name, tensor in detached.weights.items():
        if name in read:
            graph.initializer.append(
                _converted_weight(tensor, types.get(name, tensor.data_type), weights_dir)
            )
    return light


def _boundary(values: Sequence[onnx.ValueInfoProto]) -> tuple[dict[str, int], dict[str, tuple[int, ...]]]:
    types = {vi.name: vi.type.tensor_type.elem_type for vi in values}
    shapes = {vi.name: tuple(int(d) for d in dim_labels(vi)) for vi in values}
    return types, shapes


def origin_of(name: str, exported: set[str]) -> str:
    """The exported node (or tensor) a name made by a pass comes from, or '' when none matches.

    Passes name what they make after what they replace (``<node>/<step>``, ``<node>__<n>``), so the
    origin is the longest prefix of ``name``, cut at one of those separators, that the export holds.
    """
    candidate = name
    while candidate:
        if candidate in exported:
            return candidate
        cut = max(candidate.rfind("/"), candidate.rfind("__"))
        if cut <= 0:
            return ""
        candidate = candidate[:cut]
    return ""


def _name_origins(error: LegalizationError, exported_model: onnx.ModelProto, source: str | None) -> None:
    exported = set()
    for graph in iter_graphs(exported_model.graph):
        exported.update(node.name for node in graph.node if node.name)
        exported.update(value.name for value in (*graph.input, *graph.initializer))
    error.nodes = [
        node if node.origin else replace(node, origin=origin_of(node.name, exported)) for node in error.nodes
    ]
    error.model_file = source
    error.refresh()


def legalize(
    model: onnx.ModelProto,
    input_shapes: Mapping[str, Sequence[int]],
    *,
    precision: str = "fp32",
    progress: Callable[[str], None] | None = None,
    source: str | None = None,
    weights_dir: str | Path | None = None,
    sharding: Sharding | None = None,
) -> LegalizedGraph:
    """Return a PopART-ready copy of ``model`` at the given static input shapes.

    Raises LegalizationError (listing every offending node and what to do) when it cannot; each node
    names the exported node it came from, and the message names ``source`` (the ONNX file the model was
    read from) when given. ``model`` itself is not modified. ``weights_dir`` is the directory the model's
    external weights are relative to (``compiler.external_data.load_graph`` leaves them in their files);
    weights that keep their type stay references there, and ``LegalizedGraph.weights_dir`` carries it.
    ``sharding`` over more than one IPU annotates every node with its IPU and pipeline stage.
    """
    weights_dir = None if weights_dir is None else Path(weights_dir)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    ctx = PassContext(
        input_shapes={k: tuple(int(d) for d in v) for k, v in input_shapes.items()}, precision=precision
    )
    weights = weight_free_copy(model)
    initializer_inputs_as_constants(weights)
    working = weights.model
    reports: list[PassReport] = []
    try:
        for graph_pass in build_passes(precision, sharding):
            if progress is not None:
                progress(graph_pass.name)
            working = _run_pass(graph_pass, working, ctx, reports)
    except LegalizationError as error:
        _name_origins(error, model, source)
        if error.model is not None:
            try:
                error.model = _attach_weights(error.model, weights, weights_dir)
            except LegalizationError:
                pass  # keep the stand-ins: the error being raised says more than this one
        raise
    working = _attach_weights(working, weights, weights_dir)
    attached = {init.name for init in working.graph.initializer} & set(weights.weights)
    initializer_names = {init.name for init in working.graph.initializer}
    input_types, shapes_in = _boundary([vi for vi in working.graph.input if vi.name not in initializer_names])
    output_types, shapes_out = _boundary(list(working.graph.output))
    return LegalizedGraph(
        model=working,
        reports=reports,
        input_types=input_types,
        output_types=output_types,
        input_shapes=shapes_in,
        output_shapes=shapes_out,
        precision=precision,
        weights_dir=weights_dir,
        weight_names=frozenset(attached),
    )
