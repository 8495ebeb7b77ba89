"""FoldStaticIfs: Ifs on shapes become the branch they take at each static size, nested ones included."""

from __future__ import annotations

import numpy as np
import pytest
from graph_testing import FLOAT, INT64, copy_model, make_model, run_ort, tensor_info
from onnx import helper, numpy_helper

from optimum_ipu_backend.compiler.graphs import count_ops
from optimum_ipu_backend.compiler.passes.base import PassContext
from optimum_ipu_backend.compiler.passes.fix_shapes import FixShapes
from optimum_ipu_backend.compiler.passes.fold_static_ifs import FoldStaticIfs


def _dim_is(axis: int, size: int, prefix: str) -> list:
    """Nodes computing ``Shape(x)[axis] == size`` into ``<prefix>_cond``."""
    constant = helper.make_tensor
    return [
        helper.make_node("Shape", ["x"], [f"{prefix}_shape"]),
        helper.make_node("Constant", [], [f"{prefix}_axis"], value=constant("a", INT64, [], [axis])),
        helper.make_node("Gather", [f"{prefix}_shape", f"{prefix}_axis"], [f"{prefix}_dim"], axis=0),
        helper.make_node("Constant", [], [f"{prefix}_size"], value=constant("s", INT64, [], [size])),
        helper.make_node("Equal", [f"{prefix}_dim", f"{prefix}_size"], [f"{prefix}_cond"]),
    ]


def _nested_ifs():
    """(y, z) = (x, 0.5) if x's dim 1 is 1, else (Relu(x) * 2 if dim 0 is 2 else -x, x + 1), the inner If
    in a branch. The then-branch returns an initializer of its own (which keeps its name: an Identity
    makes the If's output), the other outputs are made by branch nodes (renamed to the If's)."""
    rank2 = [None, None]
    same = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["same"])],
        "same",
        [],
        [tensor_info("same", FLOAT, rank2), tensor_info("halves", FLOAT, rank2)],
        initializer=[numpy_helper.from_array(np.full((2, 1), 0.5, np.float32), "halves")],
    )
    relu = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Mul", ["r", "two"], ["relu2"])],
        "relu",
        [],
        [tensor_info("relu2", FLOAT, rank2)],
        initializer=[numpy_helper.from_array(np.float32(2.0), "two")],
    )
    negate = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["neg"])], "negate", [], [tensor_info("neg", FLOAT, rank2)]
    )
    inner = helper.make_graph(
        [
            *_dim_is(0, 2, "inner"),
            helper.make_node("If", ["inner_cond"], ["inner_y"], then_branch=relu, else_branch=negate),
            helper.make_node("Add", ["x", "one"], ["plus_one"]),
        ],
        "inner",
        [],
        [tensor_info("inner_y", FLOAT, rank2), tensor_info("plus_one", FLOAT, rank2)],
        initializer=[numpy_helper.from_array(np.float32(1.0), "one")],
    )
    nodes = [
        *_dim_is(1, 1, "outer"),
        helper.make_node("If", ["outer_cond"], ["y", "z"], then_branch=same, else_branch=inner),
    ]
    outputs = [tensor_info("y", FLOAT, rank2), tensor_info("z", FLOAT, rank2)]
    return make_model(nodes, [tensor_info("x", FLOAT, ["batch", "seq"])], outputs, opset=14)


@pytest.mark.parametrize(
    "shape", [(2, 1), (2, 5), (3, 5)], ids=["initializer-output", "nested-then", "nested-else"]
)
def test_nested_shape_ifs_fold_to_the_branch_taken(shape):
    model = _nested_ifs()
    ctx = PassContext({"x": shape})
    pass_ = FoldStaticIfs()
    folded = pass_.run(FixShapes().run(copy_model(model), ctx), ctx)
    assert "If" not in count_ops(folded.graph)
    assert pass_.notes == [
        f"inlined {1 if shape[1] == 1 else 2} If with a condition fixed by the static shapes"
    ]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    expected = run_ort(model, {"x": x})
    actual = run_ort(folded, {"x": x})
    for name in ("y", "z"):
        np.testing.assert_array_equal(actual[name], expected[name])
