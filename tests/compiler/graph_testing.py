"""Shared helpers for the compiler tests: tiny graphs built with onnx.helper, and before/after runs on ORT."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

FLOAT_ATOL = 1e-6


def tensor_info(name: str, elem_type: int, shape: Sequence[int | str | None] | None) -> onnx.ValueInfoProto:
    """A typed tensor; ``shape=None`` leaves the rank unknown."""
    return helper.make_tensor_value_info(name, elem_type, None if shape is None else list(shape))


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    initializers: Mapping[str, np.ndarray] | None = None,
    opset: int = 18,
    extra_opsets: Mapping[str, int] | None = None,
    check: bool = True,
) -> onnx.ModelProto:
    """A single-graph model, checked unless ``check=False``."""
    graph = helper.make_graph(
        list(nodes),
        "test_graph",
        list(inputs),
        list(outputs),
        initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in (initializers or {}).items()],
    )
    opsets = [helper.make_opsetid("", opset)] + [
        helper.make_opsetid(d, v) for d, v in (extra_opsets or {}).items()
    ]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = min(model.ir_version, 10)  # what onnxruntime 1.32 reads
    if check:
        onnx.checker.check_model(model, full_check=True)
    return model


def copy_model(model: onnx.ModelProto) -> onnx.ModelProto:
    copied = onnx.ModelProto()
    copied.CopyFrom(model)
    return copied


def run_ort(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Outputs of ``model`` on onnxruntime CPU with graph optimizations off, keyed by output name."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    wanted = {i.name: i for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {k: v for k, v in feeds.items() if k in wanted}), strict=True))


def feeds_for_types(feeds: Mapping[str, np.ndarray], input_types: Mapping[str, int]) -> dict[str, np.ndarray]:
    """Host arrays cast to the legalized graph's input types (what the session does at the boundary)."""
    cast = {}
    for name, elem_type in input_types.items():
        value = np.asarray(feeds[name])
        target = helper.tensor_dtype_to_np_dtype(elem_type)
        if np.issubdtype(value.dtype, np.integer) and np.issubdtype(target, np.integer):
            info = np.iinfo(target)
            assert value.min(initial=0) >= info.min and value.max(initial=0) <= info.max, name
        cast[name] = value.astype(target)
    return cast


def assert_same_outputs(
    expected: Mapping[str, np.ndarray],
    actual: Mapping[str, np.ndarray],
    atol: float = FLOAT_ATOL,
    rtol: float = 0.0,
) -> None:
    """Integer and bool outputs exactly equal; float outputs within ``atol`` (NaN where NaN)."""
    assert set(actual) == set(expected), (sorted(actual), sorted(expected))
    for name, want in expected.items():
        got = actual[name]
        assert got.shape == want.shape, (name, got.shape, want.shape)
        if np.issubdtype(want.dtype, np.floating):
            np.testing.assert_allclose(
                got.astype(np.float64), want.astype(np.float64), atol=atol, rtol=rtol, err_msg=name
            )
        else:
            np.testing.assert_array_equal(got.astype(np.int64), want.astype(np.int64), err_msg=name)


def assert_pass_preserves(
    before: onnx.ModelProto,
    after: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    atol: float = FLOAT_ATOL,
) -> None:
    """Run both graphs on ORT (feeds cast to each graph's input types) and require the same outputs."""

    def types(model: onnx.ModelProto) -> dict[str, int]:
        initializers = {i.name for i in model.graph.initializer}
        return {i.name: i.type.tensor_type.elem_type for i in model.graph.input if i.name not in initializers}

    expected = run_ort(before, feeds_for_types(feeds, types(before)))
    actual = run_ort(after, feeds_for_types(feeds, types(after)))
    assert_same_outputs(expected, actual, atol=atol)


def elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Elem type of every typed tensor of the top graph (inputs, outputs, value_info, initializers)."""
    types = {
        vi.name: vi.type.tensor_type.elem_type
        for vi in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output)
    }
    types.update({init.name: init.data_type for init in model.graph.initializer})
    return types


def shape_of(value_info: onnx.ValueInfoProto) -> list[int | str]:
    return [
        d.dim_value if d.HasField("dim_value") else d.dim_param for d in value_info.type.tensor_type.shape.dim
    ]


INT64 = TensorProto.INT64
INT32 = TensorProto.INT32
FLOAT = TensorProto.FLOAT
FLOAT16 = TensorProto.FLOAT16
BOOL = TensorProto.BOOL
