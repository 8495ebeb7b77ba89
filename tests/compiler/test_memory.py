"""estimate_memory: weight bytes and a liveness walk, checked against hand-computed figures."""

from __future__ import annotations

import numpy as np
from graph_testing import BOOL, FLOAT, FLOAT16, make_model, tensor_info
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper

from optimum_ipu_backend.compiler import estimate_memory


def _chain(length: int, rows: int, cols: int, elem_type: int = FLOAT):
    nodes = [helper.make_node("Relu", ["x" if i == 0 else f"t{i - 1}"], [f"t{i}"]) for i in range(length)]
    return make_model(
        nodes,
        [tensor_info("x", elem_type, [rows, cols])],
        [tensor_info(f"t{length - 1}", elem_type, [rows, cols])],
    )


def test_weights_are_initializers_plus_constant_values():
    model = make_model(
        [
            helper.make_node(
                "Constant", [], ["c"], value=numpy_helper.from_array(np.zeros((3, 5), np.float16))
            ),
            helper.make_node("MatMul", ["x", "w"], ["h"]),
        ],
        [tensor_info("x", FLOAT, [2, 4])],
        [tensor_info("h", FLOAT, [2, 10]), tensor_info("c", FLOAT16, [3, 5])],
        {"w": np.zeros((4, 10), np.float32)},
    )
    estimate = estimate_memory(model)
    assert estimate.weights_bytes == 4 * 10 * 4 + 3 * 5 * 2


def test_a_chain_holds_two_tensors_at_a_time():
    estimate = estimate_memory(_chain(5, 8, 16))
    assert estimate.peak_activation_bytes == 2 * 8 * 16 * 4
    assert estimate.total_bytes == estimate.weights_bytes + estimate.peak_activation_bytes


def test_a_tensor_read_late_stays_live():
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Relu", ["a"], ["b"]),
        helper.make_node("Relu", ["b"], ["c"]),
        helper.make_node("Add", ["c", "a"], ["y"]),  # keeps `a` alive across b and c
    ]
    model = make_model(nodes, [tensor_info("x", FLOAT, [10])], [tensor_info("y", FLOAT, [10])])
    # At the Relu that makes c: a, b and c are live.
    assert estimate_memory(model).peak_activation_bytes == 3 * 10 * 4


def test_ipus_needed_rounds_up_against_900_mb():
    big = make_model(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        [tensor_info("x", FLOAT, [1])],
        [tensor_info("y", FLOAT, [250_000_000])],
        check=False,
    )
    weight = big.graph.initializer.add()  # dims only: the estimate never reads the values
    weight.name, weight.data_type = "w", FLOAT
    weight.dims.append(250_000_000)
    estimate = estimate_memory(big)
    assert estimate.weights_bytes == 1_000_000_000
    assert estimate.ipu_memory_bytes == 900_000_000 and estimate.tiles_per_ipu == 1472
    assert estimate.ipus_needed == 3  # 1 GB weights + 1 GB output
    assert estimate.total_bytes > estimate.ipu_memory_bytes


def test_if_branches_add_their_own_peak():
    inner = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["u"]), helper.make_node("Relu", ["u"], ["v"])],
        "then",
        [],
        [tensor_info("v", FLOAT, [100])],
    )
    small = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["n"])], "else", [], [tensor_info("n", FLOAT, [100])]
    )
    model = make_model(
        [helper.make_node("If", ["c"], ["y"], then_branch=inner, else_branch=small)],
        [tensor_info("c", BOOL, []), tensor_info("x", FLOAT, [100])],
        [tensor_info("y", FLOAT, [100])],
    )
    # Outside: c (1 byte), x and y live at the If; inside the larger branch u and v.
    assert estimate_memory(model).peak_activation_bytes == 1 + 400 + 400 + 800


@settings(max_examples=25, deadline=None)
@given(length=st.integers(1, 12), rows=st.integers(1, 64), cols=st.integers(1, 64), half=st.booleans())
def test_property_chain_peak_is_two_activations(length, rows, cols, half):
    elem_type, itemsize = (FLOAT16, 2) if half else (FLOAT, 4)
    estimate = estimate_memory(_chain(length, rows, cols, elem_type))
    assert estimate.weights_bytes == 0
    assert estimate.peak_activation_bytes == 2 * rows * cols * itemsize
    assert estimate.ipus_needed == 1
