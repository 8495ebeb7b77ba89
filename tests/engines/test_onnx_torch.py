"""The PopTorch engine's graph converter (engines/onnx_torch.py) on single opset-11 nodes: each operator
computes what onnxruntime computes for the same node, and what it does not implement is refused with
the operator and the engine that serves it named."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from optimum_ipu_backend.engines.base import EngineContractError
from optimum_ipu_backend.engines.onnx_torch import OnnxGraphModule

ATOL = 1e-5


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
    (got,) = OnnxGraphModule(model)(torch.from_numpy(x))
    assert list(got.shape) == list(expected.shape)
    np.testing.assert_allclose(got.numpy(), expected, atol=ATOL, rtol=0)


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
