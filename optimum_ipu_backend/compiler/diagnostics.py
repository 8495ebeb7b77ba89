"""What `optimum-ipu check` gives a user whose graph does not legalize: ``--explain NODE`` (the node's
neighbourhood at the fixed sizes) and ``--repro DIR`` (the graphs with random weights, to attach to an
issue without the model's weights)."""

from __future__ import annotations

import difflib
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx

from optimum_ipu_backend.compiler.errors import LegalizationError, UnsupportedNode
from optimum_ipu_backend.compiler.graphs import GraphView, iter_graphs, shape_view
from optimum_ipu_backend.compiler.op_table import dtype_name
from optimum_ipu_backend.compiler.passes.base import PassContext
from optimum_ipu_backend.compiler.passes.fix_shapes import FixShapes, dim_labels
from optimum_ipu_backend.compiler.passes.fold_constants import FoldConstants
from optimum_ipu_backend.compiler.passes.fold_static_ifs import FoldStaticIfs

_TWO_GIB = 2**31 - 1
#: Files a reproduction carries besides the graphs: what sizes and exports are read from, no weights.
_REPRO_FILES = ("config.json", "generation_config.json")


def save_model(model: onnx.ModelProto, target: Path) -> None:
    """Write ``model`` to ``target``, its tensors in a side file when it is over protobuf's 2 GiB."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if model.ByteSize() > _TWO_GIB:
        onnx.save(model, target, save_as_external_data=True, location=f"{target.name}.data")
    else:
        onnx.save(model, target)


# ------------------------------------------------------------------------------------------------------
# --explain NODE: the node's neighbourhood, with the shapes the fixed sizes give
# ------------------------------------------------------------------------------------------------------


def _types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    types: dict[str, onnx.TypeProto] = {}
    for graph in iter_graphs(model.graph):
        for init in graph.initializer:
            types[init.name] = onnx.helper.make_tensor_type_proto(init.data_type, list(init.dims))
        for value in (*graph.input, *graph.value_info, *graph.output):
            types[value.name] = value.type
    return types


def _describe_tensor(name: str, types: Mapping[str, onnx.TypeProto]) -> str:
    found = types.get(name)
    if found is None or not found.HasField("tensor_type"):
        return "type unknown"
    value = onnx.ValueInfoProto(name=name, type=found)
    shape = (
        "x".join(str(label) for label in dim_labels(value)) if found.tensor_type.HasField("shape") else "?"
    )
    return f"{dtype_name(found.tensor_type.elem_type)}[{shape or 'scalar'}]"


def explain_node(model: onnx.ModelProto, node_name: str, where: str) -> str | None:
    """The node's operator, attributes, inputs (shape, producer) and outputs (shape, readers), or None
    when ``model`` has no node of that name."""
    index = GraphView(model.graph, subgraphs=True)
    node = next((n for graph in iter_graphs(model.graph) for n in graph.node if n.name == node_name), None)
    if node is None:
        return None
    types = _types(model)
    inputs = {vi.name for vi in model.graph.input}
    constants = {init.name for graph in iter_graphs(model.graph) for init in graph.initializer}
    lines = [f"node {node.name} ({node.op_type}) in {where}"]
    for attr in node.attribute:
        if attr.type not in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
            lines.append(f"  attribute {attr.name} = {onnx.helper.get_attribute_value(attr)!r}")
    lines.append("  inputs:")
    for position, name in enumerate(node.input):
        if not name:
            lines.append(f"    {position}: (omitted)")
            continue
        producer = index.producer.get(name)
        if producer is not None:
            source = f"from {producer.op_type} {producer.name or '<unnamed>'}"
        elif name in constants:
            source = "a constant (initializer)"
        elif name in inputs:
            source = "a graph input"
        else:
            source = "from an enclosing graph"
        lines.append(f"    {position}: {name}  {_describe_tensor(name, types)}  {source}")
    lines.append("  outputs:")
    for position, name in enumerate(node.output):
        readers = ", ".join(
            f"{reader.op_type} {reader.name or '<unnamed>'}" for reader, _ in index.consumers[name]
        )
        read = (
            f"read by {readers}" if readers else "a graph output" if name in index.graph_outputs else "unused"
        )
        lines.append(f"    {position}: {name}  {_describe_tensor(name, types)}  {read}")
    return "\n".join(lines)


def _fixed_views(
    model: onnx.ModelProto, context: PassContext, label: str
) -> list[tuple[onnx.ModelProto, str]]:
    """The export at the fixed input sizes, folded (where every shape is static) and only fixed (where
    the nodes folding removed still are)."""
    try:
        fixed = FixShapes().run(shape_view(model), context)
    except LegalizationError:
        return [(shape_view(model), f"{label} (input sizes could not be fixed)")]
    views = [(fixed, f"{label} (shapes after fixing the input sizes)")]
    try:
        copy = onnx.ModelProto.FromString(fixed.SerializeToString())
        folded = FoldConstants().run(FoldStaticIfs().run(copy, context), context)
    except Exception:  # noqa: BLE001 - the fixed view still explains the node; legalize reports the rest
        return views
    return [(folded, f"{label} (shapes after fixing the input sizes and folding constants)"), *views]


def explain(
    model: onnx.ModelProto,
    label: str,
    input_shapes: Mapping[str, Sequence[int]],
    node_name: str,
    error: LegalizationError | None = None,
) -> str:
    """--explain for one checked graph (``model``, its branch inputs bound): the node in the export at the
    fixed sizes (folded when it survives folding), else in the graph the failing pass received (a node a
    pass made), else the closest names. ``error`` is the graph's legalization error, if it had one."""
    views = _fixed_views(model, PassContext(dict(input_shapes)), label)
    text = next((found for view, where in views if (found := explain_node(view, node_name, where))), None)
    fixed = views[-1][0]
    if text is None and error is not None and error.model is not None:
        text = explain_node(error.model, node_name, f"{label} (as the {error.failed_pass} pass received it)")
    if text is None:
        names = [n.name for graph in iter_graphs(fixed.graph) for n in graph.node if n.name]
        close = difflib.get_close_matches(node_name, names, n=5, cutoff=0.5)
        suggestion = f"; close names: {', '.join(close)}" if close else ""
        return f"{label}: no node named {node_name!r}{suggestion}"
    problems: list[UnsupportedNode] = error.nodes if error is not None else []
    found = [p.describe() for p in problems if node_name in (p.name, p.origin)]
    if found:
        text += "\n  unsupported:\n" + "\n".join(f"    - {line}" for line in found)
    return text


# ------------------------------------------------------------------------------------------------------
# --repro DIR: the graphs with random weights, to attach to an issue
# ------------------------------------------------------------------------------------------------------


def _random_like(tensor: onnx.TensorProto, rng: np.random.Generator) -> onnx.TensorProto | None:
    """Random values of the tensor's shape and float type; None for what is not a weight (integer and
    boolean tensors hold shapes, indices and masks, and single values are constants of the computation)."""
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    if not np.issubdtype(dtype, np.floating) or int(np.prod(tensor.dims)) <= 1:
        return None
    values = (rng.standard_normal(tuple(tensor.dims)) * 0.02).astype(dtype)
    return onnx.numpy_helper.from_array(values, tensor.name)


def _float_constants(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    for graph in iter_graphs(model.graph):
        yield from graph.initializer
        for node in graph.node:
            if node.op_type == "Constant":
                yield from (attr.t for attr in node.attribute if attr.name == "value")


def write_repro(files: Sequence[Path], source_dir: Path, target: Path, seed: int = 0) -> list[Path]:
    """Each graph with every float weight replaced by random values of the same shape and type, plus the
    config files, in ``target``: the structure of the model without its weights."""
    rng = np.random.default_rng(seed)
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for path in files:
        model = onnx.load(path)
        for tensor in _float_constants(model):
            replacement = _random_like(tensor, rng)
            if replacement is not None:
                tensor.CopyFrom(replacement)
        save_model(model, target / path.name)
        written.append(target / path.name)
    for name in _REPRO_FILES:
        if (source_dir / name).is_file():
            shutil.copyfile(source_dir / name, target / name)
            written.append(target / name)
    return written
