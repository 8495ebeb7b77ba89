"""The PopTorch engine's graph converter (engines/onnx_torch.py) on single opset-11 nodes: each operator
computes what onnxruntime computes for the same node, and what it does not implement is refused with
the operator and the engine that serves it named.

PopTorch traces the module on the IPU device, where no value can be read on the host; here every module
also runs on torch's ``meta`` device (values absent, host reads refused) and must give the same shapes.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch.overrides import TorchFunctionMode

from optimum_ipu_backend.engines.base import EngineContractError
from optimum_ipu_backend.engines.onnx_torch import OnnxGraphModule

ATOL = 1e-5

# What reads a tensor's value on the host: PopTorch refuses each while it traces.
_HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__bool__,
    torch.Tensor.__index__,
    torch.Tensor.__array__,
}


class _RefuseHostReads(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS or (
            func is torch.Tensor.to and "cpu" in map(str, [*args[1:], *(kwargs or {}).values()])
        ):
            raise AssertionError(f"{getattr(func, '__name__', func)} reads a tensor's value while tracing")
        return func(*args, **(kwargs or {}))


def _on_meta(module: torch.nn.Module, *inputs: np.ndarray) -> tuple[torch.Tensor, ...]:
    """``module`` run as PopTorch traces it: buffers and inputs on a device without values, new tensors
    created there, any host read refused."""
    meta = copy.deepcopy(module).to("meta")
    with torch.device("meta"), _RefuseHostReads():
        return meta(*(torch.from_numpy(x).to("meta") for x in inputs))


def _model(
    op_type: str, x_shape: list[int], constants: dict[str, np.ndarray], **attributes
) -> onnx.ModelProto:
    """One node reading graph input ``x`` then the named constants, in order."""
    inputs = ["x", *constants]
    node = helper.make_node(op_type, inputs, ["y"], **attributes)
    graph = helper.make_graph(
        [node],
        op_type,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(value, name) for name, value in constants.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], ir_version=6)


def _compare(model: onnx.ModelProto, x: np.ndarray) -> None:
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )[0]
    module = OnnxGraphModule(model)
    # PopTorch refuses zero-sized parameters and buffers (dispatch_tracer/Tensor.cpp), e.g. Resize's roi
    assert all(buffer.numel() for buffer in module.buffers()), dict(module.named_buffers())
    (got,) = module(torch.from_numpy(x))
    assert list(got.shape) == list(expected.shape)
    np.testing.assert_allclose(got.numpy(), expected, atol=ATOL, rtol=0)
    (traced,) = _on_meta(module, x)
    assert traced.device.type == "meta" and list(traced.shape) == list(expected.shape)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space(mode):
    x = np.random.default_rng(0).standard_normal((2, 8, 3, 4)).astype(np.float32)
    _compare(_model("DepthToSpace", list(x.shape), {}, blocksize=2, mode=mode), x)


def test_instance_normalization():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    scale, bias = rng.standard_normal(3).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    _compare(_model("InstanceNormalization", list(x.shape), {"scale": scale, "bias": bias}, epsilon=1e-3), x)


_ROI = np.zeros(0, np.float32)


@pytest.mark.parametrize(
    "attributes, scales, sizes, shape",
    [
        # UNet's nearest upsampling, as exported from torch
        (
            {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
            [1, 1, 2, 2],
            None,
            [1, 2, 3, 5],
        ),
        # bilinear, align_corners=False (SegFormer's decode head): up and down, by scales and by sizes
        (
            {"mode": "linear", "coordinate_transformation_mode": "half_pixel"},
            [1, 1, 2, 2],
            None,
            [1, 2, 3, 5],
        ),
        (
            {"mode": "linear", "coordinate_transformation_mode": "half_pixel"},
            [1, 1, 0.5, 0.5],
            None,
            [1, 2, 8, 6],
        ),
        (
            {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"},
            None,
            [1, 2, 7, 9],
            [1, 2, 3, 5],
        ),
        (
            {"mode": "linear", "coordinate_transformation_mode": "align_corners"},
            None,
            [1, 2, 7, 9],
            [1, 2, 3, 5],
        ),
        # rank 3 (linear) and rank 5 (trilinear)
        ({"mode": "linear", "coordinate_transformation_mode": "half_pixel"}, [1, 1, 3], None, [2, 2, 4]),
        (
            {"mode": "linear", "coordinate_transformation_mode": "half_pixel"},
            [1, 1, 2, 2, 2],
            None,
            [1, 1, 2, 3, 2],
        ),
    ],
)
def test_resize(attributes, scales, sizes, shape):
    constants = {"roi": _ROI, "scales": np.asarray(scales or [], np.float32)}
    if sizes is not None:
        constants["sizes"] = np.asarray(sizes, np.int64)
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    _compare(_model("Resize", shape, constants, **attributes), x)


def test_a_resize_mode_it_does_not_implement_is_refused_naming_it():
    model = _model(
        "Resize",
        [1, 1, 4, 4],
        {"roi": _ROI, "scales": np.asarray([1, 1, 2, 2], np.float32)},
        mode="cubic",
        coordinate_transformation_mode="half_pixel",
    )
    module = OnnxGraphModule(model)
    with pytest.raises(EngineContractError, match="mode='cubic'.*engine='popart'"):
        module(torch.zeros(1, 1, 4, 4))


def test_an_operator_it_does_not_implement_is_refused_at_conversion():
    model = _model("LpNormalization", [2, 3], {}, axis=1)
    with pytest.raises(EngineContractError, match="no implementation of LpNormalization.*engine='popart'"):
        OnnxGraphModule(model)


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "VALID"])
@pytest.mark.parametrize("kernel, stride", [(3, 2), (2, 1), (5, 3)])
def test_conv_auto_pad(auto_pad, kernel, stride):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 2, 7, 8)).astype(np.float32)
    weight = rng.standard_normal((4, 2, kernel, kernel)).astype(np.float32)
    model = _model("Conv", list(x.shape), {"w": weight}, auto_pad=auto_pad, strides=[stride, stride])
    _compare(model, x)


def test_max_pool_auto_pad():
    x = np.random.default_rng(4).standard_normal((1, 2, 7, 7)).astype(np.float32)
    _compare(
        _model("MaxPool", list(x.shape), {}, auto_pad="SAME_UPPER", kernel_shape=[3, 3], strides=[2, 2]), x
    )


@pytest.mark.parametrize(
    "op_type, attributes",
    [
        ("MaxPool", {}),
        ("AveragePool", {}),
        ("AveragePool", {"count_include_pad": 1}),
    ],
)
@pytest.mark.parametrize("pads", [[0, 0, 1, 1], [1, 0, 2, 1]])
def test_pools_with_asymmetric_pads(op_type, attributes, pads):
    """Caffe2's exports (GoogLeNet, Inception-v2, AlexNet) pad a pool's end only. Negative inputs show a
    padded zero winning a max; an average shows whether padded cells count."""
    x = np.random.default_rng(5).standard_normal((1, 2, 7, 6)).astype(np.float32) - 3
    model = _model(op_type, list(x.shape), {}, kernel_shape=[3, 3], strides=[2, 2], pads=pads, **attributes)
    _compare(model, x)


def test_a_pool_with_asymmetric_pads_in_ceil_mode_is_refused_naming_the_engine_that_serves_it():
    model = _model(
        "MaxPool", [1, 1, 6, 6], {}, kernel_shape=[3, 3], strides=[2, 2], pads=[0, 0, 1, 1], ceil_mode=1
    )
    with pytest.raises(EngineContractError, match="asymmetric pads and ceil_mode=1.*engine='popart'"):
        OnnxGraphModule(model)(torch.zeros(1, 1, 6, 6))


# -- operands PopART needs at compile time ----------------------------------------------------------------


def _graph_model(nodes, inputs, constants, outputs=("y",)) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "static_operands",
        [helper.make_tensor_value_info(name, dtype, shape) for name, dtype, shape in inputs],
        [helper.make_empty_tensor_value_info(name) for name in outputs],
        [numpy_helper.from_array(value, name) for name, value in constants.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], ir_version=6)


def _compare_graph(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> OnnxGraphModule:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(None, feed)
    module = OnnxGraphModule(model)
    got = module(*(torch.from_numpy(feed[name]) for name in module.input_names))
    traced = _on_meta(module, *(feed[name] for name in module.input_names))
    for value, shape_only, wanted in zip(got, traced, expected, strict=True):
        assert list(value.shape) == list(wanted.shape) == list(shape_only.shape)
        np.testing.assert_allclose(value.numpy(), wanted, atol=ATOL, rtol=0)
    return module


_I64 = np.int64
_X = np.random.default_rng(7).standard_normal((2, 3, 4)).astype(np.float32)

# One node per operator whose operand PopART needs at compile time, read from an initializer.
STATIC_CASES = {
    "Reshape": ([helper.make_node("Reshape", ["x", "shape"], ["y"])], {"shape": np.array([0, -1], _I64)}),
    "Slice": (
        [helper.make_node("Slice", ["x", "starts", "ends", "axes", "steps"], ["y"])],
        {
            "starts": np.array([3, 0], _I64),
            "ends": np.array([0, 2], _I64),
            "axes": np.array([2, 1], _I64),
            "steps": np.array([-2, 1], _I64),
        },
    ),
    "Expand": ([helper.make_node("Expand", ["x", "shape"], ["y"])], {"shape": np.array([3, 2, 1, 4], _I64)}),
    "ConstantOfShape": (
        [
            helper.make_node(
                "ConstantOfShape",
                ["shape"],
                ["c"],
                value=numpy_helper.from_array(np.array([2.5], np.float32)),
            ),
            helper.make_node("Add", ["x", "c"], ["y"]),
        ],
        {"shape": np.array([3, 4], _I64)},
    ),
    "Pad": (
        [helper.make_node("Pad", ["x", "pads", "value"], ["y"])],
        {"pads": np.array([0, 1, 0, 1, 2, 1], _I64), "value": np.array(1.5, np.float32)},
    ),
    "CumSum": ([helper.make_node("CumSum", ["x", "axis"], ["y"], reverse=1)], {"axis": np.array(-1, _I64)}),
    "TopK": ([helper.make_node("TopK", ["x", "k"], ["y", "indices"])], {"k": np.array([2], _I64)}),
    "Tile": ([helper.make_node("Tile", ["x", "repeats"], ["y"])], {"repeats": np.array([1, 2, 3], _I64)}),
    "Resize": (
        [
            helper.make_node(
                "Resize",
                ["x4", "roi", "scales"],
                ["y"],
                mode="nearest",
                nearest_mode="floor",
                coordinate_transformation_mode="asymmetric",
            ),
        ],
        {"roi": np.zeros(0, np.float32), "scales": np.array([1, 1, 2, 2], np.float32)},
    ),
    "OneHot": (
        [helper.make_node("OneHot", ["ids", "depth", "values"], ["y"], axis=1)],
        {"depth": np.array([5], _I64), "values": np.array([-1.0, 3.0], np.float32)},
    ),
    # Shape folded from the static input shape, then the shape arithmetic exporters emit around it
    "Shape": (
        [
            helper.make_node("Shape", ["x"], ["s"]),
            helper.make_node("Gather", ["s", "zero"], ["batch"], axis=0),
            helper.make_node("Unsqueeze", ["batch"], ["batch1"], axes=[0]),
            helper.make_node("Concat", ["batch1", "minus_one"], ["target"], axis=0),
            helper.make_node("Reshape", ["x", "target"], ["y"]),
        ],
        {"zero": np.array(0, _I64), "minus_one": np.array([-1], _I64)},
    ),
}


@pytest.mark.parametrize("case", sorted(STATIC_CASES))
def test_operands_popart_needs_at_compile_are_resolved_at_build_and_forward_reads_no_value(case):
    nodes, constants = STATIC_CASES[case]
    if case == "OneHot":
        inputs, feed = [("ids", TensorProto.INT64, [2, 3])], {"ids": np.array([[0, 4, -1], [2, 2, 1]], _I64)}
    elif case == "Resize":
        inputs, feed = [("x4", TensorProto.FLOAT, [1, 2, 3, 4])], {"x4": _X.reshape(1, 2, 3, 4)}
    else:
        inputs, feed = [("x", TensorProto.FLOAT, [2, 3, 4])], {"x": _X}
    outputs = [name for name in nodes[-1].output]
    _compare_graph(_graph_model(nodes, inputs, constants, outputs), feed)


def test_a_shape_without_value_info_is_inferred_and_folded():
    """Shape of an intermediate value the graph gives no shape for: ONNX shape inference finds it."""
    weight = np.random.default_rng(8).standard_normal((4, 6)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Shape", ["h"], ["s"]),
        helper.make_node("Slice", ["s", "start", "end", "axis"], ["last"]),
        helper.make_node("Concat", ["minus_one", "last"], ["target"], axis=0),
        helper.make_node("Reshape", ["h", "target"], ["y"]),
    ]
    constants = {
        "w": weight,
        "start": np.array([-1], _I64),
        "end": np.array([3], _I64),
        "axis": np.array([0], _I64),
        "minus_one": np.array([-1], _I64),
    }
    module = _compare_graph(_graph_model(nodes, [("x", TensorProto.FLOAT, [2, 3, 4])], constants), {"x": _X})
    assert [op for op, *_ in module._nodes] == ["MatMul", "Reshape"]  # the shape arithmetic was folded


def test_an_operand_computed_from_a_graph_input_is_refused_at_conversion_naming_node_and_operand():
    nodes = [
        helper.make_node("Add", ["n", "one"], ["n1"], name="plus_one"),
        helper.make_node("Concat", ["minus_one", "n1"], ["target"], name="target", axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"], name="the_reshape"),
    ]
    constants = {"one": np.array([1], _I64), "minus_one": np.array([-1], _I64)}
    inputs = [("x", TensorProto.FLOAT, [2, 3, 4]), ("n", TensorProto.INT64, [1])]
    with pytest.raises(
        EngineContractError,
        match=r"'the_reshape' \(Reshape\) needs its shape operand 'target'.*'n'.*engine='popart'",
    ):
        OnnxGraphModule(_graph_model(nodes, inputs, constants))
    direct = [helper.make_node("Tile", ["x", "n3"], ["y"], name="tile")]
    inputs = [("x", TensorProto.FLOAT, [2, 3, 4]), ("n3", TensorProto.INT64, [3])]
    with pytest.raises(EngineContractError, match=r"'tile' \(Tile\) needs its repeats operand 'n3'"):
        OnnxGraphModule(_graph_model(direct, inputs, {}))


@pytest.mark.parametrize("size", [3, 5])
def test_lrn(size):
    """AlexNet, GoogLeNet and ZFNet normalize with LRN."""
    _compare(_model("LRN", list(_LRN_X.shape), {}, size=size, alpha=0.3, beta=0.75, bias=2.0), _LRN_X)


_LRN_X = np.random.default_rng(9).standard_normal((2, 7, 3, 4)).astype(np.float32) * 4


def _lrn_by_the_spec(x: np.ndarray, size: int, alpha: float, beta: float, bias: float) -> np.ndarray:
    """The ONNX LRN formula, channel by channel in float64. (onnx 1.x's reference evaluator loops over
    the batch axis instead of the channels, so it is no oracle here.)"""
    square_sum = np.zeros(x.shape)
    for c in range(x.shape[1]):
        low, high = max(0, c - math.floor((size - 1) / 2)), min(x.shape[1] - 1, c + math.ceil((size - 1) / 2))
        square_sum[:, c] = (x[:, low : high + 1].astype(np.float64) ** 2).sum(axis=1)
    return x / (bias + alpha / size * square_sum) ** beta


def test_lrn_of_even_size_places_its_window_as_onnx_defines_it():
    """onnxruntime refuses an even size, so the spec's formula is the oracle: the window runs from
    floor((size-1)/2) channels below to ceil((size-1)/2) above, one higher than torch's
    local_response_norm puts it (which this must therefore differ from)."""
    model = _model("LRN", list(_LRN_X.shape), {}, size=4, alpha=0.3, beta=0.75, bias=2.0)
    expected = _lrn_by_the_spec(_LRN_X, 4, 0.3, 0.75, 2.0)
    (got,) = OnnxGraphModule(model)(torch.from_numpy(_LRN_X))
    np.testing.assert_allclose(got.numpy(), expected, atol=ATOL, rtol=0)
    torch_window = torch.nn.functional.local_response_norm(torch.from_numpy(_LRN_X), 4, 0.3, 0.75, 2.0)
    assert np.abs(torch_window.numpy() - expected).max() > 100 * ATOL


def test_an_unread_zero_sized_input_is_left_out_and_a_read_one_refused():
    """PopTorch refuses zero-sized inputs: the empty past of a merged decoder's first step, which no node
    reads once its branch is bound, is not an input of the module; an empty input that is read is refused."""
    values = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
        helper.make_tensor_value_info("past", TensorProto.FLOAT, [2, 0, 3]),
    ]
    output = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])]
    unread = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", values, output)
    module = OnnxGraphModule(helper.make_model(unread, opset_imports=[helper.make_opsetid("", 11)]))
    assert module.input_names == ["x"]
    read = helper.make_graph(
        [
            helper.make_node("ReduceSum", ["past"], ["s"], axes=[1], keepdims=0),
            helper.make_node("Add", ["x", "s"], ["y"]),
        ],
        "g",
        values,
        output,
    )
    with pytest.raises(EngineContractError, match=r"input 'past' has no elements \(\[2, 0, 3\]\)"):
        OnnxGraphModule(helper.make_model(read, opset_imports=[helper.make_opsetid("", 11)]))


def test_an_output_with_no_elements_is_not_returned_nor_held_in_a_buffer():
    """A merged decoder's first step returns an empty past (a constant): forward leaves it out (the engine
    reports it with its shape, nothing to copy), so no zero-sized buffer reaches PopTorch."""
    empty = numpy_helper.from_array(np.zeros((0, 4, 1, 8), np.float32), "present")  # as legalization folds it
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("present", TensorProto.FLOAT, [0, 4, 1, 8]),
        ],
        [empty],
    )
    module = OnnxGraphModule(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]))
    assert module.output_names == ["y"]
    assert all(buffer.numel() for buffer in module.buffers())
    (y,) = module(torch.ones(2, 3))
    np.testing.assert_array_equal(y.numpy(), np.ones((2, 3), np.float32))
