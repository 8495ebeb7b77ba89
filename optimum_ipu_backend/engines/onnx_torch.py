"""The legalized ONNX graph as a ``torch.nn.Module``, the form PopTorch compiles.

Why our own converter rather than onnx2torch: onnx2torch requires torchvision, which pins one torch build
(the Poplar SDK pins torch 2.0.1 for PopTorch, and on a CPU machine it pulls a CUDA torch), and its
converters target opsets 9-16 in general. What PopTorch gets from us is narrower: a legalized graph,
static shapes, PopART's opset 11 operators, no control flow. One interpreter of that graph with torch
operators, executed node by node in topological order, is straightforward for PopTorch to trace, keeps
weights as module buffers (uploaded with the executable), and fails at conversion, naming the operator,
when the graph holds anything it does not implement. Each operator follows the ONNX opset-11 definition;
the engine tests compare the result with onnxruntime on the same graph.

PopTorch traces ``forward`` once on the IPU device, where a tensor's value cannot be read on the host.
Every operand PopART needs at compile time (``STATIC_OPERANDS``: shapes, bounds, pads, counts) is therefore
resolved when the module is built, and a graph where one is not a constant is refused then, naming the
node and the operand.

Carried state (``engines.base.state_updates``): each initializer an ``ai.graphcore`` CopyVarUpdate
overwrites is a buffer of its own (``state_buffers``), read by ``forward`` as it was before the call and
overwritten in place (``copy_``) once every output is computed. That is the form PopTorch keeps on the
device: it lowers an in-place update of a buffer to PopART's CopyVarUpdate (graphcore/poptorch
sdk-release-3.4, poptorch/source/InplaceOps.cpp, ``InplaceInputsTracker::finalizeGraph``), and the
buffer keeps the value from one call to the next.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from optimum_ipu_backend.engines.base import (
    STATE_UPDATE_DOMAIN,
    STATE_UPDATE_OP,
    EngineContractError,
    state_updates,
)

if TYPE_CHECKING:  # annotations only: the worker runs on Python 3.8, where these are not subscriptable
    from collections.abc import Callable, Sequence

    Attrs = dict[str, Any]
    Op = Callable[[list[Any], Attrs], Sequence[torch.Tensor] | torch.Tensor]

_TORCH_TYPES = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.INT16: torch.int16,
    onnx.TensorProto.INT8: torch.int8,
    onnx.TensorProto.UINT8: torch.uint8,
    onnx.TensorProto.BOOL: torch.bool,
}

# Operands PopART needs at compile time, by operator: input index -> role. Resolved to numpy arrays when the
# module is built, from initializers, Constant nodes, static shapes and the small computations between them
# (``.item()``, ``.tolist()`` and ``float(t)`` raise while PopTorch traces); ``forward`` receives numpy.
STATIC_OPERANDS: dict[str, dict[int, str]] = {
    "ConstantOfShape": {0: "input"},
    "CumSum": {1: "axis"},
    "Expand": {1: "shape"},
    "OneHot": {1: "depth"},
    "Pad": {1: "pads", 2: "constant_value"},
    "Reshape": {1: "shape"},
    # roi too (read only by tf_crop_and_resize, which is refused): exporters give an empty one, and as a
    # buffer it would be a zero-sized tensor, which PopTorch refuses (dispatch_tracer/Tensor.cpp)
    "Resize": {1: "roi", 2: "scales", 3: "sizes"},
    "Slice": {1: "starts", 2: "ends", 3: "axes", 4: "steps"},
    "Tile": {1: "repeats"},
    "TopK": {1: "K"},
}


def _ints(value: np.ndarray | None) -> list[int]:
    """A static operand (a numpy array resolved at build, never a tensor) as Python ints."""
    return [] if value is None else [int(v) for v in np.asarray(value).reshape(-1)]


def _floats(value: np.ndarray) -> list[float]:
    return [float(v) for v in np.asarray(value).reshape(-1)]


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _reduce(fn: Callable[..., torch.Tensor]) -> Op:
    def op(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
        data = inputs[0]
        axes = attrs.get("axes")
        keep = bool(attrs.get("keepdims", 1))
        dims = list(range(data.dim())) if axes is None else [_axis(a, data.dim()) for a in axes]
        if not dims:
            return data
        return fn(data, dims, keep)

    return op


def _reduce_prod(data: torch.Tensor, dims: list[int], keep: bool) -> torch.Tensor:
    for dim in sorted(dims, reverse=True):
        data = torch.prod(data, dim=dim, keepdim=keep)
    return data


def _flat_softmax(fn: Callable[..., torch.Tensor]) -> Op:
    """Opset-11 (Log)Softmax: the input coerced to 2-D at ``axis``, normalized over the second part."""

    def op(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
        data = inputs[0]
        axis = _axis(attrs.get("axis", 1), data.dim())
        rows = math.prod(data.shape[:axis])
        return fn(data.reshape(rows, -1), dim=1).reshape(data.shape)

    return op


def _div(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
    a, b = inputs
    if a.is_floating_point():
        return a / b
    return torch.div(a, b, rounding_mode="trunc")


def _gather(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
    data, indices = inputs
    axis = _axis(attrs.get("axis", 0), data.dim())
    indices = torch.where(indices < 0, indices + data.shape[axis], indices).to(torch.int64)
    picked = torch.index_select(data, axis, indices.reshape(-1))
    return picked.reshape((*data.shape[:axis], *indices.shape, *data.shape[axis + 1 :]))  # () for a scalar


def _reshape(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
    data, shape = inputs
    target = [data.shape[i] if size == 0 else size for i, size in enumerate(_ints(shape))]
    return data.reshape(target)


def _unsqueeze(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
    data = inputs[0]
    rank = data.dim() + len(attrs["axes"])
    for axis in sorted(_axis(a, rank) for a in attrs["axes"]):
        data = data.unsqueeze(axis)
    return data


def _squeeze(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
    data = inputs[0]
    axes = attrs.get("axes")
    if axes is None:
        return data.squeeze()
    for axis in sorted((_axis(a, data.dim()) for a in axes), reverse=True):
        data = data.squeeze(axis)
    return data


def _slice(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
    data = inputs[0]
    starts, ends = _ints(inputs[1]), _ints(inputs[2])
    axes = _ints(inputs[3]) if len(inputs) > 3 and inputs[3] is not None else list(range(len(starts)))
    steps = _ints(inputs[4]) if len(inputs) > 4 and inputs[4] is not None else [1] * len(starts)
    index: list[Any] = [slice(None)] * data.dim()
    flips = []
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis = _axis(axis, data.dim())
        size = data.shape[axis]
        if step > 0:
            start = min(max(start + size if start < 0 else start, 0), size)
            end = min(max(end + size if end < 0 else end, 0), size)
            index[axis] = slice(start, max(end, start), step)
        else:  # torch has no negative steps: take the range forwards, then flip
            start = min(max(start + size if start < 0 else start, -1), size - 1)
            end = min(max(end + size if end < 0 else end, -1), size - 1)
            chosen = list(range(start, end, step))
            index[axis] = slice(0, 0) if not chosen else slice(chosen[-1], chosen[0] + 1, -step)
            flips.append(axis)
    result = data[tuple(index)]
    return torch.flip(result, flips) if flips else result


def _split(inputs: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    data = inputs[0]
    axis = _axis(attrs.get("axis", 0), data.dim())
    sizes = attrs.get("split")
    if sizes is None:
        count = attrs["_outputs"]
        sizes = [data.shape[axis] // count] * count
    return list(torch.split(data, list(sizes), dim=axis))


def _expand(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
    data, shape = inputs
    target = torch.broadcast_shapes(tuple(data.shape), tuple(_ints(shape)))
    return data.expand(target)


def _constant_of_shape(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
    value = attrs.get("value")
    fill = torch.zeros(1, dtype=torch.float32) if value is None else value.reshape(-1)
    return fill.reshape([]).expand(_ints(inputs[0])).clone()


def _gemm(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
    a, b = inputs[0], inputs[1]
    a = a.t() if attrs.get("transA", 0) else a
    b = b.t() if attrs.get("transB", 0) else b
    result = attrs.get("alpha", 1.0) * (a @ b)
    if len(inputs) > 2 and inputs[2] is not None:
        result = result + attrs.get("beta", 1.0) * inputs[2]
    return result


def _pads(attrs: Attrs, data: torch.Tensor, kernel: Sequence[int]) -> list[int]:
    """Explicit ``[begin..., end...]`` pads, ``auto_pad`` resolved as ONNX defines it for static shapes:
    SAME_* pads so that the output is ceil(input / stride), the odd pixel at the end (UPPER) or the
    beginning (LOWER); VALID pads nothing."""
    spatial = data.dim() - 2
    auto_pad = _text(attrs.get("auto_pad", "NOTSET"))
    if auto_pad == "NOTSET":
        return list(attrs.get("pads", [0] * 2 * spatial))
    if auto_pad == "VALID":
        return [0] * 2 * spatial
    strides = attrs.get("strides", [1] * spatial)
    dilations = attrs.get("dilations", [1] * spatial)
    begin, end = [], []
    for size, k, stride, dilation in zip(data.shape[2:], kernel, strides, dilations):
        total = max((math.ceil(size / stride) - 1) * stride + (k - 1) * dilation + 1 - size, 0)
        small = total // 2
        begin.append(small if auto_pad == "SAME_UPPER" else total - small)
        end.append(total - begin[-1])
    return begin + end


def _conv(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
    data, weight = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    spatial = data.dim() - 2
    pads = _pads(attrs, data, weight.shape[2:])
    begin, end = pads[:spatial], pads[spatial:]
    if begin != end:
        data = torch.nn.functional.pad(data, _torch_pads(begin, end))
        begin = [0] * spatial
    conv = (torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d)[spatial - 1]
    return conv(
        data,
        weight,
        bias,
        stride=attrs.get("strides", [1] * spatial),
        padding=begin,
        dilation=attrs.get("dilations", [1] * spatial),
        groups=attrs.get("group", 1),
    )


def _pad(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
    data = inputs[0]
    pads = _ints(inputs[1])
    value = _floats(inputs[2])[0] if len(inputs) > 2 and inputs[2] is not None else 0.0
    mode = _text(attrs.get("mode", "constant"))
    rank = data.dim()
    flat = [p for axis in reversed(range(rank)) for p in (pads[axis], pads[axis + rank])]
    if mode != "constant":
        raise EngineContractError(f"Pad mode {mode!r} is not supported by the PopTorch graph converter")
    return torch.nn.functional.pad(data, flat, value=value)


def _clip(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
    data = inputs[0]
    low = inputs[1] if len(inputs) > 1 and inputs[1] is not None else None
    high = inputs[2] if len(inputs) > 2 and inputs[2] is not None else None
    if low is not None:
        data = torch.maximum(data, low.to(data.dtype))
    if high is not None:
        data = torch.minimum(data, high.to(data.dtype))
    return data


def _cumsum(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
    data, axis = inputs[0], _ints(inputs[1])[0]
    axis = _axis(axis, data.dim())
    if attrs.get("reverse", 0):
        data = torch.flip(data, [axis])
    result = torch.cumsum(data, dim=axis).to(data.dtype)
    if attrs.get("exclusive", 0):
        result = result - data
    return torch.flip(result, [axis]) if attrs.get("reverse", 0) else result


def _topk(inputs: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    data, k = inputs[0], _ints(inputs[1])[0]
    values, indices = torch.topk(
        data, k, dim=attrs.get("axis", -1), largest=bool(attrs.get("largest", 1)), sorted=True
    )
    return [values, indices.to(torch.int64)]


def _arg(fn: Callable[..., torch.Tensor]) -> Op:
    def op(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
        data = inputs[0]
        axis = _axis(attrs.get("axis", 0), data.dim())
        if attrs.get("select_last_index", 0):
            flipped = fn(torch.flip(data, [axis]), dim=axis, keepdim=bool(attrs.get("keepdims", 1)))
            return (data.shape[axis] - 1 - flipped).to(torch.int64)
        return fn(data, dim=axis, keepdim=bool(attrs.get("keepdims", 1))).to(torch.int64)

    return op


def _variadic(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Op:
    def op(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
        result = inputs[0]
        for other in inputs[1:]:
            result = fn(result, other)
        return result

    return op


def _unary(fn: Callable[[torch.Tensor], torch.Tensor]) -> Op:
    return lambda inputs, attrs: fn(inputs[0])


def _binary(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Op:
    return lambda inputs, attrs: fn(inputs[0], inputs[1])


def _batch_norm(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
    data, scale, bias, mean, var = inputs[:5]
    return torch.nn.functional.batch_norm(
        data, mean, var, scale, bias, training=False, eps=attrs.get("epsilon", 1e-5)
    )


def _instance_norm(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
    data, scale, bias = inputs[:3]
    return torch.nn.functional.instance_norm(data, weight=scale, bias=bias, eps=attrs.get("epsilon", 1e-5))


def _depth_to_space(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
    data = inputs[0]
    block = attrs["blocksize"]
    batch, channels, height, width = data.shape
    depth = channels // (block * block)
    if _text(attrs.get("mode", "DCR")) == "CRD":
        blocks = data.reshape(batch, depth, block, block, height, width).permute(0, 1, 4, 2, 5, 3)
    else:  # DCR, the default: the block offsets are the outer part of the channel index
        blocks = data.reshape(batch, block, block, depth, height, width).permute(0, 3, 4, 1, 5, 2)
    return blocks.reshape(batch, depth, height * block, width * block)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# Resize (opset 11) as torch's interpolate computes it: ONNX's (mode, coordinate transformation, nearest
# mode) -> (interpolate mode, align_corners). torch's "nearest" takes floor(x / scale), ONNX's asymmetric
# transformation with floor rounding; its linear modes with align_corners=False are ONNX's half_pixel.
_RESIZE_MODES = {
    ("nearest", "asymmetric", "floor"): ("nearest", None),
    ("linear", "half_pixel", None): ("linear", False),
    ("linear", "pytorch_half_pixel", None): ("linear", False),
    ("linear", "align_corners", None): ("linear", True),
}
_LINEAR_BY_RANK = {1: "linear", 2: "bilinear", 3: "trilinear"}


def _resize(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
    data = inputs[0]
    scales = inputs[2] if len(inputs) > 2 and inputs[2] is not None and inputs[2].size else None
    sizes = _ints(inputs[3]) if len(inputs) > 3 and inputs[3] is not None else []
    mode = _text(attrs.get("mode", "nearest"))
    transformation = _text(attrs.get("coordinate_transformation_mode", "half_pixel"))
    nearest = _text(attrs.get("nearest_mode", "round_prefer_floor")) if mode == "nearest" else None
    spatial = data.dim() - 2
    factors = _floats(scales) if scales is not None else []
    outer = sizes[:2] == list(data.shape[:2]) if sizes else factors[:2] == [1.0, 1.0]
    out = sizes[2:] or [math.floor(n * f) for n, f in zip(data.shape[2:], factors[2:])]
    torch_mode = _RESIZE_MODES.get((mode, transformation, nearest))
    # pytorch_half_pixel maps a size-1 output to 0, where torch's half-pixel mapping does not
    if (
        torch_mode is None
        or spatial not in _LINEAR_BY_RANK
        or not outer
        or (transformation == "pytorch_half_pixel" and min(out) == 1)
    ):
        raise EngineContractError(
            f"Resize with mode={mode!r}, coordinate_transformation_mode={transformation!r}"
            + (f", nearest_mode={nearest!r}" if nearest else "")
            + f" from {list(data.shape)} to {list(data.shape[:2]) + out} is not supported by the PopTorch "
            f"graph converter (it resizes the spatial axes of a rank-3 to rank-5 input with "
            f"{list(_RESIZE_MODES)}); serve this model with engine='popart'"
        )
    interpolate_mode, align_corners = torch_mode
    if interpolate_mode == "linear":
        interpolate_mode = _LINEAR_BY_RANK[spatial]
    if sizes:
        return torch.nn.functional.interpolate(
            data, size=out, mode=interpolate_mode, align_corners=align_corners
        )
    # The given scales, not out/in, map the coordinates, as in ONNX
    return torch.nn.functional.interpolate(
        data,
        scale_factor=factors[2:],
        mode=interpolate_mode,
        align_corners=align_corners,
        recompute_scale_factor=False,
    )


def _torch_pads(begin: Sequence[int], end: Sequence[int]) -> list[int]:
    """ONNX ``[begin...], [end...]`` pads in ``torch.nn.functional.pad``'s order: pairs from the last
    dimension back."""
    return [p for pair in zip(reversed(begin), reversed(end)) for p in pair]


def _pool(kind: str) -> Op:
    def op(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
        data = inputs[0]
        spatial = data.dim() - 2
        kernel = attrs["kernel_shape"]
        pads = _pads(attrs, data, kernel)
        strides = attrs.get("strides", [1] * spatial)
        ceil_mode = bool(attrs.get("ceil_mode", 0))
        count_include_pad = bool(attrs.get("count_include_pad", 0))
        functional = torch.nn.functional
        begin, end = pads[:spatial], pads[spatial:]
        if begin != end:
            # torch pools pad both sides alike; Caffe2 exports (GoogLeNet, AlexNet) pad only the end. The
            # pads are applied here instead, then the pool runs unpadded, which gives ONNX's floor-mode
            # output size. In ceil mode ONNX and torch drop a last window in the padding differently.
            if ceil_mode:
                raise EngineContractError(
                    f"{kind} with asymmetric pads and ceil_mode=1 is not supported by the PopTorch "
                    "converter; serve this model with engine='popart'"
                )
            torch_pads = _torch_pads(begin, end)
            if kind == "MaxPool":
                # a padded cell never wins the max
                data = functional.pad(data, torch_pads, value=-math.inf)
            elif not count_include_pad:
                # the window's sum over the cells of the input, divided by how many of them it covers
                inside = functional.pad(torch.ones_like(data[:1, :1]), torch_pads, value=0.0)
                pool = (functional.avg_pool1d, functional.avg_pool2d, functional.avg_pool3d)[spatial - 1]
                padded = functional.pad(data, torch_pads, value=0.0)
                return pool(padded, kernel, strides) / pool(inside, kernel, strides)
            else:
                data = functional.pad(data, torch_pads, value=0.0)
            begin = [0] * spatial
        if kind == "MaxPool":
            pool = (functional.max_pool1d, functional.max_pool2d, functional.max_pool3d)[spatial - 1]
            return pool(data, kernel, strides, begin, ceil_mode=ceil_mode)
        pool = (functional.avg_pool1d, functional.avg_pool2d, functional.avg_pool3d)[spatial - 1]
        return pool(data, kernel, strides, begin, ceil_mode=ceil_mode, count_include_pad=count_include_pad)

    return op


def _pow(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
    base, exponent = inputs
    return torch.pow(base, exponent.to(base.dtype))


def _mod(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
    a, b = inputs
    return torch.fmod(a, b) if attrs.get("fmod", 0) else torch.remainder(a, b)


def _one_hot(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
    indices, depth, values = inputs
    depth = _ints(depth)[0]
    indices = torch.where(indices < 0, indices + depth, indices).to(torch.int64)
    hot = torch.nn.functional.one_hot(indices, depth)
    axis = _axis(attrs.get("axis", -1), indices.dim() + 1)
    hot = torch.movedim(hot, -1, axis)
    return torch.where(hot.to(torch.bool), values[1], values[0])


def _flatten(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
    data = inputs[0]
    axis = _axis(attrs.get("axis", 1), data.dim())
    return data.reshape(math.prod(data.shape[:axis]), -1)


def _lrn(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
    """ONNX LRN: each channel divided by ``(bias + alpha / size * sum of squares)^beta`` over the channels
    ``c - floor((size-1)/2) .. c + ceil((size-1)/2)``. Not torch's local_response_norm, whose window for
    an even ``size`` is centred one channel lower."""
    x = inputs[0]
    size = attrs["size"]
    channels = x.shape[1]
    # F.pad lists pairs from the last dimension back; only the channel dimension (1) is padded.
    padded = torch.nn.functional.pad(x * x, [0, 0] * (x.dim() - 2) + [(size - 1) // 2, size // 2])
    square_sum = padded[:, 0:channels]
    for offset in range(1, size):
        square_sum = square_sum + padded[:, offset : offset + channels]
    scale = attrs.get("bias", 1.0) + attrs.get("alpha", 1e-4) / size * square_sum
    return x / scale.pow(attrs.get("beta", 0.75))


def _scatter_elements(inputs: list[Any], attrs: Attrs) -> torch.Tensor:
    data, indices, updates = inputs
    axis = _axis(attrs.get("axis", 0), data.dim())
    indices = torch.where(indices < 0, indices + data.shape[axis], indices).to(torch.int64)
    return data.scatter(axis, indices, updates)


OPS: dict[str, Op] = {
    "Abs": _unary(torch.abs),
    "Add": _binary(torch.add),
    "And": _binary(torch.logical_and),
    "ArgMax": _arg(torch.argmax),
    "ArgMin": _arg(torch.argmin),
    "Asin": _unary(torch.asin),
    "Atan": _unary(torch.atan),
    "AveragePool": _pool("AveragePool"),
    "BatchNormalization": _batch_norm,
    "Cast": lambda inputs, attrs: inputs[0].to(_TORCH_TYPES[attrs["to"]]),
    "Ceil": _unary(torch.ceil),
    "Clip": _clip,
    "Concat": lambda inputs, attrs: torch.cat(list(inputs), dim=attrs["axis"]),
    "ConstantOfShape": _constant_of_shape,
    "Conv": _conv,
    "Cos": _unary(torch.cos),
    "Cosh": _unary(torch.cosh),
    "CumSum": _cumsum,
    "DepthToSpace": _depth_to_space,
    "Div": _div,
    "Dropout": lambda inputs, attrs: [inputs[0], torch.ones_like(inputs[0], dtype=torch.bool)],
    "Elu": lambda inputs, attrs: torch.nn.functional.elu(inputs[0], attrs.get("alpha", 1.0)),
    "Equal": _binary(torch.eq),
    "Erf": _unary(torch.erf),
    "Exp": _unary(torch.exp),
    "Expand": _expand,
    "Flatten": _flatten,
    "Floor": _unary(torch.floor),
    "Gather": _gather,
    "Gemm": _gemm,
    "GlobalAveragePool": lambda inputs, attrs: inputs[0].mean(
        dim=list(range(2, inputs[0].dim())), keepdim=True
    ),
    "GlobalMaxPool": lambda inputs, attrs: torch.amax(
        inputs[0], dim=list(range(2, inputs[0].dim())), keepdim=True
    ),
    "Greater": _binary(torch.gt),
    "HardSigmoid": lambda inputs, attrs: torch.clamp(
        attrs.get("alpha", 0.2) * inputs[0] + attrs.get("beta", 0.5), 0, 1
    ),
    "Identity": _unary(lambda x: x),
    "InstanceNormalization": _instance_norm,
    "IsInf": _unary(torch.isinf),
    "IsNaN": _unary(torch.isnan),
    "LeakyRelu": lambda inputs, attrs: torch.nn.functional.leaky_relu(inputs[0], attrs.get("alpha", 0.01)),
    "Less": _binary(torch.lt),
    "Log": _unary(torch.log),
    "LogSoftmax": _flat_softmax(torch.log_softmax),
    "LRN": _lrn,
    "MatMul": _binary(torch.matmul),
    "Max": _variadic(torch.maximum),
    "MaxPool": _pool("MaxPool"),
    "Mean": lambda inputs, attrs: _variadic(torch.add)(inputs, attrs) / len(inputs),
    "Min": _variadic(torch.minimum),
    "Mod": _mod,
    "Mul": _binary(torch.mul),
    "Neg": _unary(torch.neg),
    "Not": _unary(torch.logical_not),
    "OneHot": _one_hot,
    "Or": _binary(torch.logical_or),
    "Pad": _pad,
    "Pow": _pow,
    "PRelu": _binary(lambda x, slope: torch.where(x < 0, x * slope, x)),
    "Reciprocal": _unary(torch.reciprocal),
    "ReduceL1": _reduce(lambda d, dims, keep: d.abs().sum(dim=dims, keepdim=keep)),
    "ReduceL2": _reduce(lambda d, dims, keep: d.pow(2).sum(dim=dims, keepdim=keep).sqrt()),
    "ReduceLogSum": _reduce(lambda d, dims, keep: d.sum(dim=dims, keepdim=keep).log()),
    "ReduceLogSumExp": _reduce(lambda d, dims, keep: torch.logsumexp(d, dim=dims, keepdim=keep)),
    "ReduceMax": _reduce(lambda d, dims, keep: torch.amax(d, dim=dims, keepdim=keep)),
    "ReduceMean": _reduce(lambda d, dims, keep: d.mean(dim=dims, keepdim=keep)),
    "ReduceMin": _reduce(lambda d, dims, keep: torch.amin(d, dim=dims, keepdim=keep)),
    "ReduceProd": _reduce(_reduce_prod),
    "ReduceSum": _reduce(lambda d, dims, keep: d.sum(dim=dims, keepdim=keep).to(d.dtype)),
    "ReduceSumSquare": _reduce(lambda d, dims, keep: (d * d).sum(dim=dims, keepdim=keep)),
    "Relu": _unary(torch.relu),
    "Reshape": _reshape,
    "Resize": _resize,
    "Round": _unary(torch.round),
    "ScatterElements": _scatter_elements,
    "Selu": lambda inputs, attrs: (
        attrs.get("gamma", 1.0507)
        * torch.where(inputs[0] > 0, inputs[0], attrs.get("alpha", 1.67326) * (torch.exp(inputs[0]) - 1))
    ),
    "Sigmoid": _unary(torch.sigmoid),
    "Sign": _unary(torch.sign),
    "Sin": _unary(torch.sin),
    "Sinh": _unary(torch.sinh),
    "Slice": _slice,
    "Softmax": _flat_softmax(torch.softmax),
    "Softplus": _unary(torch.nn.functional.softplus),
    "Softsign": _unary(torch.nn.functional.softsign),
    "Split": _split,
    "Sqrt": _unary(torch.sqrt),
    "Squeeze": _squeeze,
    "Sub": _binary(torch.sub),
    "Sum": _variadic(torch.add),
    "Tan": _unary(torch.tan),
    "Tanh": _unary(torch.tanh),
    "Tile": lambda inputs, attrs: inputs[0].repeat(_ints(inputs[1])),
    "TopK": _topk,
    "Transpose": lambda inputs, attrs: inputs[0].permute(
        attrs.get("perm", list(reversed(range(inputs[0].dim()))))
    ),
    "Unsqueeze": _unsqueeze,
    "Where": lambda inputs, attrs: torch.where(inputs[0].to(torch.bool), inputs[1], inputs[2]),
}


def _attributes(node: onnx.NodeProto) -> Attrs:
    attrs: Attrs = {}
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            raise EngineContractError(
                f"node {node.name!r} ({node.op_type}) holds a subgraph; the PopTorch graph converter takes "
                "graphs without control flow"
            )
        value = helper.get_attribute_value(attribute)
        if isinstance(value, onnx.TensorProto):
            value = torch.from_numpy(np.array(numpy_helper.to_array(value)))
        elif isinstance(value, (list, tuple)):
            value = list(value)
        attrs[attribute.name] = value
    attrs["_outputs"] = len(node.output)
    return attrs


_CONSTANT_TYPES = {
    "value_float": np.float32,
    "value_floats": np.float32,
    "value_int": np.int64,
    "value_ints": np.int64,
}


def _constant_value(node: onnx.NodeProto) -> np.ndarray:
    """The value of a Constant node (its one attribute: a tensor or, from opset 12, a number or list)."""
    (attribute,) = node.attribute
    value = helper.get_attribute_value(attribute)
    if isinstance(value, onnx.TensorProto):
        return np.array(numpy_helper.to_array(value))
    if attribute.name in _CONSTANT_TYPES:
        return np.array(value, dtype=_CONSTANT_TYPES[attribute.name])
    raise EngineContractError(
        f"Constant node {node.name!r} holds a {attribute.name}, which the PopTorch graph converter does not "
        "take"
    )


def _static_shapes(values: Sequence[onnx.ValueInfoProto]) -> dict[str, tuple[int, ...]]:
    """The shapes of the values whose every dimension is a number, by name."""
    shapes = {}
    for value in values:
        tensor_type = value.type.tensor_type
        if not tensor_type.HasField("shape"):
            continue
        dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim)
        if all(d >= 0 for d in dims):
            shapes[value.name] = dims
    return shapes


# Initializers up to this size stay in the copy shape inference reads (their values may decide shapes,
# such as a Reshape's target); larger ones, the weights, enter it as typed inputs, without their data.
_INFERENCE_VALUE_LIMIT = 4096


def _inferred_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Static shapes of the graph's values by ONNX shape inference on a copy without the weights' data."""
    graph = model.graph
    small, typed = [], []
    for initializer in graph.initializer:
        if math.prod(initializer.dims) <= _INFERENCE_VALUE_LIMIT and not initializer.external_data:
            small.append(initializer)
        else:
            typed.append(
                helper.make_tensor_value_info(initializer.name, initializer.data_type, initializer.dims)
            )
    light = helper.make_model(
        helper.make_graph(
            list(graph.node),
            graph.name,
            list(graph.input) + typed,
            list(graph.output),
            small,
            value_info=list(graph.value_info),
        ),
        opset_imports=list(model.opset_import),
        ir_version=model.ir_version,
    )
    inferred = onnx.shape_inference.infer_shapes(light, data_prop=True).graph
    return _static_shapes([*inferred.value_info, *inferred.output])


def _run(op_type: str, args: list[Any], attrs: Attrs, output_names: Sequence[str]) -> dict[str, torch.Tensor]:
    """One operator's results by output name (an unnamed, omitted output is dropped)."""
    result = OPS[op_type](args, attrs)
    results = [result] if isinstance(result, torch.Tensor) else list(result)
    return {name: value for name, value in zip(output_names, results) if name}


def _static_inputs(node: onnx.NodeProto) -> dict[int, str]:
    """The node's inputs read as static operands (STATIC_OPERANDS), by index; omitted ones are left out."""
    return {
        index: node.input[index]
        for index in STATIC_OPERANDS.get(node.op_type, {})
        if index < len(node.input) and node.input[index]
    }


def _to_numpy(value: Any) -> np.ndarray:
    return np.array(value.detach().numpy()) if isinstance(value, torch.Tensor) else np.array(value)


# Operators always computed when the module is built: a Constant, and a Shape (the graph is static).
_FOLDED = ("Constant", "Shape")

# The dtypes a state buffer can have on PopTorch. PopART's CopyVarUpdate also takes int32 (graphcore/popart
# sdk-release-3.4, willow/src/defs.cpp and willow/src/op/copyvarupdate.cpp), but PopTorch turns every
# parameter and buffer that is not floating point into a constant (graphcore/poptorch sdk-release-3.4,
# poptorch/source/dispatch_tracer/JITDispatch.cpp, addParameter: "downgraded to constant because PopART
# doesn't support non floating point parameters"): an integer state would stay at its compile-time value,
# and naming it in updatableNamedBuffers fails the compile. The runtime keeps such state as float32
# (compiler.carried_state, CarryRequest.integer_state).
_STATE_DTYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
#: Buffers are named ``b{counter}_{kind}``, the counter zero-padded to this width and counting registrations,
#: so that their names sort as they were registered. PopTorch's copyNamedBuffersToDevice hands the host
#: tensors on in the (lexicographic) order of their names and pairs them with the device buffers in
#: registration order (poptorch/source/PoplarExecutable.cpp, PoplarExecutable::copyNamedBuffersToDevice;
#: popart_compiler/source/Compiler.cpp, Compiler::copyNamedBuffersToDevice): unpadded names such as
#: ``state_9`` and ``state_10`` would swap two layers' caches of the same shape without an error.
BUFFER_COUNTER_WIDTH = 6

# Operators whose result is always a new tensor here. Any other operator may hand back its input or a view
# of it (Identity, Reshape, Slice, a Cast to the same dtype, a reduction over no axis, ...): such a value,
# computed from a state buffer, would change when the buffer is overwritten at the end of ``forward``.
_FRESH_RESULTS = frozenset(
    (
        "Add", "And", "ArgMax", "ArgMin", "Concat", "Div", "Equal", "Erf", "Exp", "Gather", "Gemm",
        "Greater", "Less", "Log", "LogSoftmax", "MatMul", "Mul", "Neg", "Not", "Or", "Pow", "Reciprocal",
        "Relu", "Sigmoid", "Softmax", "Sqrt", "Sub", "Tanh", "Where",
    )
)  # fmt: skip


def _state_aliases(graph: onnx.GraphProto, states: set[str]) -> set[str]:
    """The values that may share memory with a state buffer: the states, and what operators outside
    ``_FRESH_RESULTS`` compute from one (a CopyVarUpdate's output is its updater)."""
    aliases = set(states)
    for node in graph.node:
        if node.op_type in _FRESH_RESULTS and node.domain in ("", "ai.onnx"):
            continue
        if any(name in aliases for name in node.input):
            aliases.update(name for name in node.output if name)
    return aliases


class _Resolver:
    """Resolves, when the module is built, every value PopART needs at compile time.

    A node is *folded* (computed here, on the CPU, and left out of ``forward``) when it is a Constant or a
    Shape (the graph is static), or when one of its outputs is read as a static operand (STATIC_OPERANDS),
    directly or through the computation leading to one; all of its inputs must then be known constants.
    Every other node stays in ``forward`` with its static operands as numpy arrays.
    """

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        graph = model.graph
        self.known: dict[str, np.ndarray] = {
            initializer.name: np.array(numpy_helper.to_array(initializer))
            for initializer in graph.initializer
        }
        self.shapes = _static_shapes([*graph.input, *graph.value_info, *graph.output])
        self._inferred: dict[str, tuple[int, ...]] | None = None
        producers = {name: node for node in graph.node for name in node.output if name}
        # Each value needed on the host -> (the node that reads it statically, the operand's role and name)
        self.needed: dict[str, tuple[onnx.NodeProto, str, str]] = {}
        pending = [
            (name, (node, STATIC_OPERANDS[node.op_type][index], name))
            for node in graph.node
            for index, name in _static_inputs(node).items()
        ]
        while pending:
            name, reader = pending.pop()
            if name in self.needed:
                continue
            self.needed[name] = reader
            producer = producers.get(name)
            if producer is not None and producer.op_type not in _FOLDED:
                pending.extend((upstream, reader) for upstream in producer.input if upstream)

    def _shape_of(self, name: str, node: onnx.NodeProto) -> tuple[int, ...]:
        if name in self.known:
            return tuple(self.known[name].shape)
        if name in self.shapes:
            return self.shapes[name]
        if self._inferred is None:
            self._inferred = _inferred_shapes(self.model)
        if name in self._inferred:
            return self._inferred[name]
        raise EngineContractError(
            f"node {node.name!r} (Shape) reads the shape of {name!r}, which is not static; the PopTorch "
            "engine takes fully static graphs (serve this model with engine='popart')"
        )

    def _refuse(self, node: onnx.NodeProto, missing: str) -> EngineContractError:
        reader, role, operand = self.needed.get(missing, (node, "?", missing))
        through = "" if reader is node else f" (through node {node.name!r} ({node.op_type}))"
        return EngineContractError(
            f"node {reader.name!r} ({reader.op_type}) needs its {role} operand {operand!r} as a constant "
            f"when PopTorch compiles the graph, but it depends on {missing!r}{through}, which is not a "
            "constant (a graph input, or a value computed from one); PopTorch cannot read a tensor's value "
            "on the host while it traces. Serve this model with engine='popart'"
        )

    def folds(self, node: onnx.NodeProto) -> bool:
        return node.op_type in _FOLDED or any(name in self.needed for name in node.output)

    def fold(self, node: onnx.NodeProto) -> None:
        """Compute ``node`` from known constants; its outputs become known."""
        if node.op_type == "Constant":
            self.known[node.output[0]] = _constant_value(node)
            return
        if node.op_type == "Shape":
            self.known[node.output[0]] = np.array(self._shape_of(node.input[0], node), dtype=np.int64)
            return
        missing = [name for name in node.input if name and name not in self.known]
        if missing:
            raise self._refuse(node, missing[0])
        statics = STATIC_OPERANDS.get(node.op_type, {})
        args = [
            None if not name else self.known[name] if index in statics else torch.from_numpy(self.known[name])
            for index, name in enumerate(node.input)
        ]
        for name, value in _run(node.op_type, args, _attributes(node), node.output).items():
            self.known[name] = _to_numpy(value)

    def statics(self, node: onnx.NodeProto) -> dict[int, np.ndarray]:
        """The static operands of a node that stays in ``forward``."""
        resolved = {}
        for index, name in _static_inputs(node).items():
            if name not in self.known:
                raise self._refuse(node, name)
            resolved[index] = self.known[name]
        return resolved


class OnnxGraphModule(torch.nn.Module):
    """Runs one static ONNX graph with torch operators, its static operands baked into the nodes as numpy
    arrays (``_Resolver``). Constant values that ``forward`` reads as tensors (initializers, folded values)
    are buffers, uploaded like weights. ``state_buffers`` names the buffer of each state tensor (see the
    module's notes), by ONNX name."""

    def __init__(self, model: onnx.ModelProto) -> None:
        super().__init__()
        graph = model.graph
        unsupported = sorted(
            {
                node.op_type
                for node in graph.node
                if not _is_state_update(node)
                and (
                    (node.op_type not in OPS and node.op_type not in _FOLDED)
                    or node.domain not in ("", "ai.onnx")
                )
            }
        )
        if unsupported:
            raise EngineContractError(
                f"the PopTorch graph converter has no implementation of {', '.join(unsupported)}; serve this "
                "model with engine='popart'"
            )
        initializers = {initializer.name for initializer in graph.initializer}
        self.input_names = _fed_inputs(graph, initializers)
        # The outputs forward returns: all but those with no elements, whose values are known without a run
        # and which PopTorch could only return from a zero-sized buffer, which it refuses (the empty past a
        # merged decoder's first step returns).
        self.output_names = [value.name for value in graph.output if not _has_no_elements(value)]
        resolver = _Resolver(model)
        updates = _checked_state_updates(graph)
        # The state is not a constant: nothing may be folded from its initial value.
        self.state_buffers: dict[str, str] = {}
        initial_state = {}
        for initializer in graph.initializer:
            if initializer.name in updates:
                initial_state[initializer.name] = resolver.known.pop(initializer.name)
                resolver.shapes[initializer.name] = tuple(initializer.dims)
        aliases = _state_aliases(graph, set(updates))
        # Outputs and updaters that may share memory with a state buffer are copied before the updates.
        self._copied = {name for name in [*self.output_names, *updates.values()] if name in aliases}
        self._nodes: list[tuple[str, list[str], list[str], Attrs, dict[int, np.ndarray]]] = []
        read_as_tensors = set(self.output_names) | set(updates.values())
        for node in graph.node:
            if _is_state_update(node):
                if node.output and node.output[0] in resolver.needed:
                    raise resolver._refuse(node, node.input[0])
                # its output is the updated variable: the updater's value
                self._nodes.append(("Identity", [node.input[1]], list(node.output[:1]), {}, {}))
                continue
            if resolver.folds(node):
                resolver.fold(node)
                continue
            statics = resolver.statics(node)
            attrs = _attributes(node)
            for name, value in list(attrs.items()):
                if isinstance(value, torch.Tensor):  # constant tensors become buffers, like weights
                    attrs[name] = self._buffer("attribute", value)
                    attrs.setdefault("_buffers", []).append(name)
            read_as_tensors.update(
                name for position, name in enumerate(node.input) if name and position not in statics
            )
            self._nodes.append((node.op_type, list(node.input), list(node.output), attrs, statics))
        # Known values that forward reads as tensors are buffers; weights keep their initializer's order.
        self._tensor_names: dict[str, str] = {}
        order = [initializer.name for initializer in graph.initializer]
        order += [name for name in resolver.known if name not in initializers]
        for name in order:
            if name in read_as_tensors and name in resolver.known:
                kind = "initializer" if name in initializers else "constant"
                self._tensor_names[name] = self._buffer(kind, torch.from_numpy(resolver.known[name]))
        for name in initial_state:
            # a copy: the buffer is written in place, and numpy_helper's array may be read-only
            self.state_buffers[name] = self._buffer("state", torch.from_numpy(initial_state[name].copy()))
            self._tensor_names[name] = self.state_buffers[name]
        check_buffer_order(list(self._buffers))
        # (buffer, updater): overwritten at the end of forward, after every reader read the old value
        self._updates = [(self.state_buffers[name], updater) for name, updater in updates.items()]
        if self._updates:
            self._nodes = _in_dependency_order(self._nodes, {*self.input_names, *self._tensor_names})

    def _buffer(self, kind: str, tensor: torch.Tensor) -> str:
        """Register ``tensor`` as the next buffer; its name sorts after every earlier one's."""
        counter = len(self._buffers)
        if counter >= 10**BUFFER_COUNTER_WIDTH:
            raise EngineContractError(
                f"the graph needs more than {10**BUFFER_COUNTER_WIDTH} buffers, more than the PopTorch "
                "engine names in registration order; serve this model with engine='popart'"
            )
        name = f"b{counter:0{BUFFER_COUNTER_WIDTH}d}_{kind}"
        self.register_buffer(name, tensor, persistent=True)
        return name

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(inputs) != len(self.input_names):
            raise TypeError(f"the graph takes {len(self.input_names)} inputs, {len(inputs)} given")
        values: dict[str, Any] = dict(zip(self.input_names, inputs))
        for name, buffer_name in self._tensor_names.items():
            values[name] = getattr(self, buffer_name)
        for op_type, input_names, output_names, attrs, statics in self._nodes:
            if "_buffers" in attrs:
                attrs = {**attrs, **{name: getattr(self, attrs[name]) for name in attrs["_buffers"]}}
            args = [
                statics[index] if index in statics else values[name] if name else None
                for index, name in enumerate(input_names)
            ]
            values.update(_run(op_type, args, attrs, output_names))
        for name in self._copied:
            values[name] = values[name].clone()
        results = tuple(values[name] for name in self.output_names)
        for buffer_name, updater in self._updates:
            getattr(self, buffer_name).copy_(values[updater])
        return results


def _has_no_elements(value: onnx.ValueInfoProto) -> bool:
    dims = value.type.tensor_type.shape.dim
    return all(d.HasField("dim_value") for d in dims) and any(d.dim_value == 0 for d in dims)


def _fed_inputs(graph: onnx.GraphProto, initializers: set[str]) -> list[str]:
    """The graph inputs ``forward`` takes. PopTorch refuses a zero-sized input (graphcore/poptorch
    sdk-release-3.4, poptorch/source/dispatch_tracer/Tensor.cpp, errorOnZeroSizedTensor): one that no node
    reads (the empty past of a merged decoder's first step) is left out, and the engine is not fed it; one
    that a node reads is refused."""
    read = {name for node in graph.node for name in node.input}
    names = []
    for value in graph.input:
        if value.name in initializers:
            continue
        if _has_no_elements(value):
            if value.name in read:
                shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
                raise EngineContractError(
                    f"input {value.name!r} has no elements ({shape}), which PopTorch refuses; serve this "
                    "model with engine='popart'"
                )
            continue
        names.append(value.name)
    return names


def check_buffer_order(names: Sequence[str]) -> None:
    """Refuse buffer names (in registration order) whose lexicographic order differs: PopTorch pairs the
    host tensors of copyNamedBuffersToDevice, in name order, with the device buffers in registration order
    (see ``BUFFER_COUNTER_WIDTH``), so such names would upload one buffer's values into another."""
    names = list(names)
    if names != sorted(names):
        first = next(i for i, (a, b) in enumerate(zip(names, sorted(names))) if a != b)
        raise EngineContractError(
            f"buffer {names[first]!r} is registered in position {first} but its name sorts elsewhere; "
            "PopTorch would upload named buffers into the wrong ones (an internal error of the engine)"
        )


def _in_dependency_order(nodes: list, available: set[str]) -> list:
    """``nodes`` (forward's entries) so that each comes after the producers of what it reads: a graph with
    carried state may put a CopyVarUpdate before its updater (only the update's timing is defined), and
    its output is the updater's value. Stable: nodes keep their order where they can."""
    pending, ordered, available = list(nodes), [], set(available)
    while pending:
        for position, (_, input_names, output_names, _, statics) in enumerate(pending):
            reads = [name for index, name in enumerate(input_names) if name and index not in statics]
            if all(name in available for name in reads):
                ordered.append(pending.pop(position))
                available.update(output_names)
                break
        else:
            raise EngineContractError(
                f"the graph reads {pending[0][1]} before anything computes it (a cycle or a missing value)"
            )
    return ordered


def _is_state_update(node: onnx.NodeProto) -> bool:
    return node.domain == STATE_UPDATE_DOMAIN and node.op_type == STATE_UPDATE_OP


def _checked_state_updates(graph: onnx.GraphProto) -> dict[str, str]:
    """``state_updates``, refused where PopART refuses it: a dtype CopyVarUpdate does not take, and (not
    defined by PopART: two copies into one variable in one run) a variable updated twice."""
    updates = state_updates(graph)
    counts: dict[str, int] = {}
    for node in graph.node:
        if _is_state_update(node):
            counts[node.input[0]] = counts.get(node.input[0], 0) + 1
            if len(node.input) != 2:
                raise EngineContractError(f"CopyVarUpdate {node.name!r} takes [variable, updater]")
    twice = sorted(name for name, count in counts.items() if count > 1)
    if twice:
        raise EngineContractError(f"the state {twice[0]!r} is updated by more than one CopyVarUpdate")
    for initializer in graph.initializer:
        if initializer.name in updates and initializer.data_type not in _STATE_DTYPES:
            dtype = helper.tensor_dtype_to_np_dtype(initializer.data_type)
            raise EngineContractError(
                f"the state {initializer.name!r} is {np.dtype(dtype).name}; PopTorch keeps only float32 and "
                "float16 buffers on the device (it turns other buffers into constants), so the graph must "
                "carry it as floating point or the engine must be engine='popart'"
            )
    return updates


class ScalarsWithLeadingAxis(torch.nn.Module):
    """``module`` with a leading axis of 1 on its rank-0 inputs and outputs.

    PopTorch's batch rule splits dim 0 of every input over device iterations and replicas and concatenates
    outputs on dim 0, so a scalar cannot pass as it is: the engine feeds it as ``[steps]``, each
    micro-batch sees ``[1]``, and this wrapper hands the graph the scalar it declares.
    """

    def __init__(self, module: OnnxGraphModule, scalar_inputs: set[int], scalar_outputs: set[int]) -> None:
        super().__init__()
        self.module = module
        self.scalar_inputs = frozenset(scalar_inputs)
        self.scalar_outputs = frozenset(scalar_outputs)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args = [x.reshape(()) if i in self.scalar_inputs else x for i, x in enumerate(inputs)]
        results = self.module(*args)
        return tuple(y.reshape((1,)) if i in self.scalar_outputs else y for i, y in enumerate(results))
