"""Dilated AveragePool as a depthwise Conv of unit weights divided by compile-time window counts: the same
averages as onnxruntime CPU's AveragePool-19, padding, ceil_mode and count_include_pad included."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import FLOAT, run_ort
from hypothesis import assume
from hypothesis import strategies as st


def _pool_model(shape, **attributes):
    return lt.one_node_model(
        "AveragePool", [("x", FLOAT, shape)], [("y", FLOAT, None)], opset=19, **attributes
    )


def _attribute_names(model):
    return {a.name for node in model.graph.node for a in node.attribute}


def test_the_onnx_example_averages_the_dilated_windows():
    """op/test_averagepool_2d_dilations: a 2x2 kernel dilated by 2 on 4x4, ceil_mode."""
    model = _pool_model((1, 1, 4, 4), kernel_shape=[2, 2], strides=[1, 1], dilations=[2, 2], ceil_mode=1)
    x = np.arange(1, 17, dtype=np.float32).reshape(1, 1, 4, 4)
    lowered = lt.lower_and_compare(model, {"x": x}, atol=1e-5)
    assert lt.op_types(lowered) == {"Conv", "Div"}
    np.testing.assert_array_equal(run_ort(lowered, {"x": x})["y"], [[[[6, 7], [10, 11]]]])


def test_unit_dilations_are_dropped():
    model = _pool_model((1, 2, 5, 5), kernel_shape=[2, 2], dilations=[1, 1])
    lowered = lt.lower_and_compare(model, {"x": lt.random_array(2, (1, 2, 5, 5), np.float32)})
    assert lt.op_types(lowered) == {"AveragePool"}
    assert "dilations" not in _attribute_names(lowered)


def test_same_auto_padding_with_dilations_is_refused():
    model = _pool_model((1, 1, 6, 6), kernel_shape=[2, 2], dilations=[2, 2], auto_pad="SAME_UPPER")
    lt.assert_refused(model, "the_AveragePool.*auto_pad=SAME_UPPER")


def test_a_dynamic_shape_is_refused():
    model = _pool_model((1, 1, "h", 6), kernel_shape=[2, 2], dilations=[2, 2])
    lt.assert_refused(model, "the_AveragePool.*static shape")


def test_realistic_feature_maps_match():
    """A 3x3 kernel dilated by 2 over 64 channels of 56x56, padded; and the 3-D conformance cases."""
    x = lt.random_array(4, (2, 64, 56, 56), np.float32)
    for include_pad in (0, 1):
        model = _pool_model(
            x.shape, kernel_shape=[3, 3], dilations=[2, 2], pads=[2, 2, 2, 2], count_include_pad=include_pad
        )
        lt.lower_and_compare(model, {"x": x}, atol=1e-5)
    volume = lt.random_array(5, (1, 1, 32, 32, 32), np.float32)
    for include_pad in (0, 1):
        for ceil_mode in (0, 1):
            model = _pool_model(
                volume.shape,
                kernel_shape=[5, 5, 5],
                strides=[3, 3, 3],
                dilations=[2, 2, 2],
                count_include_pad=include_pad,
                ceil_mode=ceil_mode,
            )
            lt.lower_and_compare(model, {"x": volume}, atol=1e-5)


def _windows(size, kernel, stride, dilation, begin, end, ceil_mode):
    """(the padded input is long enough, the last window starts in the end padding) along one axis."""
    reach = size + begin + end - (kernel - 1) * dilation - 1
    if reach < 0:
        return False, False
    count = (-(-reach // stride) if ceil_mode else reach // stride) + 1
    return True, (count - 1) * stride >= size + begin


@lt.property_test(
    spatial=st.integers(1, 3),
    data=st.data(),
    ceil_mode=st.integers(0, 1),
    include_pad=st.integers(0, 1),
    seed=lt.seeds,
)
def test_same_averages_as_onnxruntime(spatial, data, ceil_mode, include_pad, seed):
    sizes = data.draw(st.lists(st.integers(1, 7), min_size=spatial, max_size=spatial))
    kernel = data.draw(st.lists(st.integers(1, 3), min_size=spatial, max_size=spatial))
    dilations = data.draw(st.lists(st.integers(1, 3), min_size=spatial, max_size=spatial))
    strides = data.draw(st.lists(st.integers(1, 3), min_size=spatial, max_size=spatial))
    # onnxruntime requires each pad to be smaller than the (undilated) kernel.
    pads = [data.draw(st.integers(0, k - 1)) for k in kernel * 2]
    shape = (data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3)), *sizes)
    axes = [
        _windows(sizes[i], kernel[i], strides[i], dilations[i], pads[i], pads[spatial + i], ceil_mode)
        for i in range(spatial)
    ]
    assume(all(fits for fits, _ in axes))
    model = _pool_model(
        shape,
        kernel_shape=kernel,
        strides=strides,
        dilations=dilations,
        pads=pads,
        ceil_mode=ceil_mode,
        count_include_pad=include_pad,
    )
    if ceil_mode and any(starts_in_padding for _, starts_in_padding in axes) and max(dilations) > 1:
        lt.assert_refused(model, "the_AveragePool.*starts in the end padding")
        return
    lt.lower_and_compare(model, {"x": lt.random_array(seed, shape, np.float32)}, atol=1e-5)


def test_a_ceil_window_starting_in_the_end_padding_is_refused():
    """3 inputs, end pad 1, stride 3: the second window would start at 3. onnxruntime returns 1 window,
    ONNX shape inference declares 2."""
    model = _pool_model((1, 1, 3), kernel_shape=[2], strides=[3], dilations=[2], pads=[0, 1], ceil_mode=1)
    lt.assert_refused(model, "the_AveragePool.*starts in the end padding")
