"""The session pre-check accepts exactly what the compiler can take: every operator a rewrite declares is
accepted and, as a one-node graph, served by an emulator session with onnxruntime's results."""

from __future__ import annotations

import inspect

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from graph_testing import make_model, tensor_info
from onnx import TensorProto, helper
from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

from optimum_ipu_backend.compiler.errors import LegalizationError
from optimum_ipu_backend.compiler.op_table import POPART_OPSET11_OPS, operator_name
from optimum_ipu_backend.compiler.passes import rewrites
from optimum_ipu_backend.compiler.passes.rewrites import LOWERED_OP_TYPES, REWRITE_FOR_OP, REWRITES, Rewrite
from optimum_ipu_backend.compiler.precheck import accepted_op_types, precheck_operators
from optimum_ipu_backend.session import create_session

RNG = np.random.default_rng(0)


def _f(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _i(values, dtype=np.int64) -> np.ndarray:
    return np.asarray(values, dtype=dtype)


#: One sample per operator some rewrite declares: (opset, [(input name, value, is a graph input)],
#: attributes, output count). Values that are not graph inputs become initializers (constants).
CASES: dict[str, tuple[int, list[tuple[str, np.ndarray, bool]], dict, int]] = {
    # Attention's mask is the ReduceSum of a 0/1 mask ORTOptimizer feeds BERT's (end positions).
    "com.microsoft::Attention": (
        18,
        [
            ("x", _f(2, 3, 4), True),
            ("w", _f(4, 12), False),
            ("b", _f(12), False),
            ("mask", _i([3, 1], np.int32), True),
        ],
        {"num_heads": 2, "mask_filter_value": float(np.finfo(np.float32).min)},
        1,
    ),
    "com.microsoft::MultiHeadAttention": (
        18,
        [("q", _f(2, 3, 4), True), ("k", _f(2, 5, 4), True), ("v", _f(2, 5, 6), True)],
        {"num_heads": 2},
        1,
    ),
    "ArgMax": (13, [("x", _f(3, 5), True)], {"axis": 1, "select_last_index": 0}, 1),
    "ArgMin": (13, [("x", _f(3, 5), True)], {"axis": 0, "select_last_index": 0}, 1),
    "AveragePool": (19, [("x", _f(1, 2, 6, 6), True)], {"kernel_shape": [2, 2], "dilations": [1, 1]}, 1),
    "BatchNormalization": (
        15,
        [
            ("x", _f(2, 3, 4)),
            ("scale", _f(3)),
            ("bias", _f(3)),
            ("mean", _f(3)),
            ("var", np.ones(3, np.float32)),
        ],
        {"training_mode": 0},
        1,
    ),
    "Celu": (12, [("x", _f(2, 3), True)], {"alpha": 0.5}, 1),
    "BitwiseNot": (18, [("x", _i([[-(2**31), 0, 7, 2**31 - 1]], np.int32), True)], {}, 1),
    "Cast": (19, [("x", _f(2, 3), True)], {"to": TensorProto.INT32}, 1),
    "CastLike": (15, [("x", _f(2, 3), True), ("like", _i([1], np.int32), False)], {}, 1),
    "Clip": (
        13,
        [
            ("x", _i([[-5, 0, 7]], np.int32), True),
            ("lo", _i(-2, np.int32), False),
            ("hi", _i(3, np.int32), False),
        ],
        {},
        1,
    ),
    "Constant": (13, [], {"value_floats": [1.0, 2.5]}, 1),
    "Einsum": (12, [("a", _f(2, 3), True), ("b", _f(3, 4), True)], {"equation": "ij,jk->ik"}, 1),
    "Dropout": (13, [("x", _f(2, 3), True)], {}, 1),
    "GRU": (
        14,
        [("x", _f(3, 2, 4)), ("W", _f(1, 15, 4), False), ("R", _f(1, 15, 5), False)],
        {"hidden_size": 5, "layout": 0},
        2,
    ),
    # negative indices count from the end, as onnxruntime counts them
    "Gather": (13, [("data", _f(5, 3), True), ("idx", _i([[-1, 0], [4, -5]]), True)], {"axis": 0}, 1),
    "GatherElements": (
        13,
        [("data", _f(3, 4), True), ("idx", _i([[0, -2], [1, 3], [-4, 0]]), True)],
        {"axis": 1},
        1,
    ),
    # column 1 addresses the axis of 3: its 2 lies beyond the smaller axis (2) yet is valid
    "GatherND": (13, [("data", _f(2, 3, 4), True), ("idx", _i([[0, 2], [1, -3]]), True)], {}, 1),
    "Gelu": (20, [("x", _f(2, 3), True)], {"approximate": "tanh"}, 1),
    "GroupNormalization": (
        21,
        [("x", _f(2, 4, 3), True), ("scale", _f(4), False), ("bias", _f(4), False)],
        {"num_groups": 2},
        1,
    ),
    "HardSwish": (14, [("x", _f(2, 3), True)], {}, 1),
    "Hardmax": (13, [("x", _f(2, 3), True)], {"axis": 0}, 1),
    "GreaterOrEqual": (16, [("a", _f(2, 3), True), ("b", _f(2, 3), True)], {}, 1),
    "Identity": (16, [("x", _f(2, 3), True)], {}, 1),
    "LSTM": (
        14,
        [("x", _f(3, 2, 4)), ("W", _f(1, 20, 4), False), ("R", _f(1, 20, 5), False)],
        {"hidden_size": 5, "layout": 0},
        2,
    ),
    "LayerNormalization": (
        17,
        [("x", _f(2, 3, 4), True), ("scale", _f(4), False), ("bias", _f(4), False)],
        {"axis": -1},
        1,
    ),
    "LpNormalization": (22, [("x", _f(2, 3), True)], {"axis": 1, "p": 1}, 1),
    "MeanVarianceNormalization": (13, [("x", _f(2, 3, 4), True)], {"axes": [0, 2]}, 1),
    "Mish": (22, [("x", _f(2, 3), True)], {}, 1),
    "RMSNormalization": (23, [("x", _f(2, 3, 4), True), ("scale", _f(4), False)], {}, 1),
    "ReverseSequence": (
        11,
        [("x", _f(4, 2, 3), True), ("lens", _i([3, 1]), False)],
        {"time_axis": 0, "batch_axis": 1},
        1,
    ),
    "LessOrEqual": (16, [("a", _f(2, 3), True), ("b", _f(2, 3), True)], {}, 1),
    "LogSoftmax": (13, [("x", _f(2, 3, 4), True)], {"axis": 1}, 1),
    "Max": (13, [("a", _i([[1, 9, -3]], np.int32), True), ("b", _i([[4, 2, -7]], np.int32), True)], {}, 1),
    "Min": (13, [("a", _i([[1, 9, -3]]), True), ("b", _i([[4, 2, -7]]), True)], {}, 1),
    "Pad": (
        18,
        [
            ("x", _f(2, 3), True),
            ("pads", _i([1, 2]), False),
            ("value", _i(0.5, np.float32), False),
            ("axes", _i([1]), False),
        ],
        {},
        1,
    ),
    "Mod": (28, [("a", _f(2, 3), True), ("b", np.full((2, 3), -1.5, np.float32), True)], {"fmod": 0}, 1),
    "OneHot": (
        11,
        [("idx", _i([[0, 3], [2, 1]]), True), ("depth", _i(4), False), ("values", _i([0, 1]), False)],
        {"axis": -1},
        1,
    ),
    "Pow": (15, [("x", _f(2, 3), True), ("e", _i(2, np.int32), False)], {}, 1),
    "RNN": (
        14,
        [("x", _f(3, 2, 4)), ("W", _f(1, 5, 4), False), ("R", _f(1, 5, 5), False)],
        {"hidden_size": 5, "layout": 0},
        2,
    ),
    "Range": (11, [("start", _i(2), False), ("limit", _i(11), False), ("delta", _i(3), False)], {}, 1),
    **{
        f"Reduce{kind}": (
            18,
            [("x", np.abs(_f(2, 3, 4)) + 0.5, True), ("axes", _i([1]), False)],
            {"keepdims": 1},
            1,
        )
        for kind in ("L1", "L2", "LogSum", "LogSumExp", "Max", "Mean", "Min", "Prod", "Sum", "SumSquare")
    },
    "Relu": (14, [("x", _i([[-3, 0, 5]], np.int32), True)], {}, 1),
    "Reshape": (14, [("x", _f(2, 6), True), ("shape", _i([3, 4]), False)], {"allowzero": 0}, 1),
    "Resize": (
        13,
        [
            ("x", _f(1, 1, 2, 2), True),
            ("roi", np.array([], np.float32), False),
            ("scales", np.array([1, 1, 2, 2], np.float32), False),
        ],
        {"mode": "nearest"},
        1,
    ),
    "RoiAlign": (
        16,
        [
            ("x", _f(1, 2, 6, 6), True),
            ("rois", np.array([[0, 0, 3, 3], [1, 1, 5, 4]], np.float32), False),
            ("batch", _i([0, 0]), False),
        ],
        {"coordinate_transformation_mode": "output_half_pixel", "output_height": 2, "output_width": 2},
        1,
    ),
    "ScatterElements": (
        16,
        [("data", _f(3, 3), True), ("idx", _i([[1, 0, 2]]), False), ("upd", _f(1, 3), True)],
        {"reduction": "none"},
        1,
    ),
    "ScatterND": (
        18,
        [("data", _f(4, 3), True), ("idx", _i([[1], [3]]), False), ("upd", _f(2, 3), True)],
        {},
        1,
    ),
    "RotaryEmbedding": (
        23,
        [
            ("x", _f(2, 2, 3, 4), True),
            ("cos", _f(5, 2), False),
            ("sin", _f(5, 2), False),
            ("pos", _i([[0, 1, 2], [2, 3, 4]]), True),
        ],
        {},
        1,
    ),
    "com.microsoft::RotaryEmbedding": (
        18,
        [
            ("x", _f(2, 2, 3, 4), True),
            ("pos", _i([[0, 1, 2], [2, 3, 4]]), True),
            ("cos", _f(5, 2), False),
            ("sin", _f(5, 2), False),
        ],
        {},
        1,
    ),
    "SimplifiedLayerNormalization": (18, [("x", _f(2, 3, 4), True), ("scale", _f(4), False)], {}, 1),
    "com.microsoft::SkipLayerNormalization": (
        18,
        [
            ("x", _f(2, 3, 4), True),
            ("skip", _f(2, 3, 4), True),
            ("gamma", _f(4), False),
            ("beta", _f(4), False),
        ],
        {"epsilon": 1e-5},
        1,
    ),
    "com.microsoft::SkipSimplifiedLayerNormalization": (
        18,
        [("x", _f(2, 3, 4), True), ("skip", _f(2, 3, 4), True), ("gamma", _f(4), False)],
        {"epsilon": 1e-5},
        1,
    ),
    "com.microsoft::EmbedLayerNormalization": (
        18,
        [
            ("ids", _i([[1, 0, 2]], np.int32), True),
            ("segment_ids", _i([[0, 1, 1]], np.int32), True),
            ("word", _f(3, 4), False),
            ("position", _f(5, 4), False),
            ("segment", _f(2, 4), False),
            ("gamma", _f(4), False),
            ("beta", _f(4), False),
            ("mask", _i([[1, 1, 0]], np.int32), True),
        ],
        {"epsilon": 1e-5},
        2,
    ),
    "Shape": (15, [("x", _f(2, 3, 4), True)], {"start": 1}, 1),
    "Size": (13, [("x", _f(2, 3, 4), True)], {}, 1),
    "Softmax": (13, [("x", _f(2, 3, 4), True)], {"axis": 1}, 1),
    "SpaceToDepth": (28, [("x", _f(1, 2, 4, 6), True)], {"blocksize": 2, "mode": "CRD"}, 1),
    "Split": (18, [("x", _f(2, 6), True), ("split", _i([2, 4]), False)], {"axis": 1}, 2),
    "Squeeze": (13, [("x", _f(2, 1, 3), True), ("axes", _i([1]), False)], {}, 1),
    "Trilu": (14, [("x", _f(4, 5), True), ("k", _i(1), False)], {"upper": 0}, 1),
    "Unsqueeze": (13, [("x", _f(2, 3), True), ("axes", _i([1]), False)], {}, 1),
    "com.microsoft::BiasAdd": (18, [("x", _f(2, 3, 4)), ("bias", _f(4)), ("skip", _f(2, 3, 4))], {}, 1),
    "com.microsoft::BiasGelu": (18, [("x", _f(2, 3, 4)), ("bias", _f(4), False)], {}, 1),
    "com.microsoft::FastGelu": (18, [("x", _f(2, 3, 4)), ("bias", _f(4), False)], {}, 1),
    "com.microsoft::Gelu": (18, [("x", _f(2, 3))], {}, 1),
    "com.microsoft::QuickGelu": (18, [("x", _f(2, 3))], {"alpha": 1.5}, 1),
    "Xor": (
        7,
        [("a", np.array([[True, False, True]]), True), ("b", np.array([[True, True, False]]), True)],
        {},
        1,
    ),
}


#: Operators onnxruntime CPU has no kernel for: what they compute, from the inputs in order.
NUMPY_ORACLES = {"com.microsoft::BiasAdd": lambda x, bias, skip: [(x + bias) + skip]}


def _normalise(entry):
    """Inputs given as (name, value) are graph inputs."""
    opset, inputs, attributes, outputs = entry
    return (
        opset,
        [(spec[0], spec[1], spec[2] if len(spec) > 2 else True) for spec in inputs],
        attributes,
        outputs,
    )


def _one_node_model(op_type: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    opset, inputs, attributes, outputs = _normalise(CASES[op_type])
    domain, _, op = op_type.rpartition("::")  # operator_name's form: "domain::Op" outside the default domain
    node = helper.make_node(
        op,
        [name for name, _, _ in inputs],
        [f"out{i}" for i in range(outputs)],
        name=f"the_{op}",
        domain=domain,
        **attributes,
    )
    graph_inputs = [
        tensor_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape)
        for name, value, is_input in inputs
        if is_input
    ]
    initializers = {name: value for name, value, is_input in inputs if not is_input}
    model = make_model(
        [node], graph_inputs, [], initializers, opset=opset, extra_opsets=_RUNTIME_OPSETS, check=False
    )
    if domain or not onnx.defs.has(op):
        # ONNX does not know onnxruntime's own operators; onnxruntime's symbolic shape inference does.
        model.graph.output.extend(onnx.ValueInfoProto(name=name) for name in node.output)
        typed = SymbolicShapeInference.infer_shapes(model)
        return typed, {name: value for name, value, is_input in inputs if is_input}
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    found = [value for value in inferred.graph.value_info if value.name.startswith("out")]
    if not found:
        # onnx infers no output type for GroupNormalization-21 (its function body is built per node); its
        # output is typed and shaped like its first input.
        like_input = onnx.ValueInfoProto()
        like_input.CopyFrom(graph_inputs[0])
        like_input.name = "out0"
        found = [like_input]
    model.graph.output.extend(found)
    if not domain:
        onnx.checker.check_model(model, full_check=True)
    return model, {name: value for name, value, is_input in inputs if is_input}


#: The runtime domains the samples may use (an import no node uses is harmless).
_RUNTIME_OPSETS = {"com.microsoft": 1}


def _det_model() -> onnx.ModelProto:
    """An operator PopART lacks and no rewrite takes."""
    return make_model(
        [helper.make_node("Det", ["x"], ["y"], name="pick")],
        [tensor_info("x", TensorProto.FLOAT, [2, 3, 3])],
        [tensor_info("y", TensorProto.FLOAT, [2])],
        opset=13,
    )


#: Operators lowered only in pairs (a QuantizeLinear may feed DequantizeLinear nodes only): no one-node
#: sample; tests/integration/test_quantized_models.py serves a QDQ network on the emulator instead.
PAIRED = frozenset({"QuantizeLinear", "DequantizeLinear"})


def test_every_declared_operator_has_a_sample():
    assert set(CASES) | PAIRED == set(LOWERED_OP_TYPES)


def test_every_rewrite_in_the_package_is_registered():
    """A rewrite class written in some module but left out of REWRITES would lower nothing."""
    defined = {
        cls
        for module in vars(rewrites).values()
        if inspect.ismodule(module) and module.__name__.startswith(rewrites.__name__)
        for cls in vars(module).values()
        if inspect.isclass(cls) and issubclass(cls, Rewrite) and not inspect.isabstract(cls)
    }
    assert defined == {type(rewrite) for rewrite in REWRITES}
    assert set(REWRITE_FOR_OP) == {
        operator_name(rewrite.domain, op) for rewrite in REWRITES for op in rewrite.op_types
    }


def test_the_precheck_accepts_what_the_compiler_takes_and_refuses_the_rest():
    assert LOWERED_OP_TYPES | POPART_OPSET11_OPS <= accepted_op_types()
    for op_type in sorted(LOWERED_OP_TYPES - PAIRED):
        model, _ = _one_node_model(op_type)
        assert precheck_operators(model) == [], op_type
    (refused,) = precheck_operators(_det_model())
    assert (refused.name, refused.op_type) == ("pick", "Det")


@pytest.mark.parametrize("op_type", sorted(CASES))
def test_every_declared_operator_is_served(op_type, tmp_path):
    model, feeds = _one_node_model(op_type)
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    if op_type in NUMPY_ORACLES:
        _, inputs, _, _ = _normalise(CASES[op_type])
        expected = NUMPY_ORACLES[op_type](*(value for _, value, _ in inputs))
    else:
        expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    session = create_session(str(path), providers=["ipu"], provider_options={"device": "emulator"})
    actual = session.run(None, feeds)
    for want, got in zip(expected, actual, strict=True):
        assert got.shape == want.shape, op_type
        if np.issubdtype(want.dtype, np.floating):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=op_type)
        else:
            np.testing.assert_array_equal(got, want, err_msg=op_type)


def test_a_graph_no_rewrite_takes_is_refused_at_creation(tmp_path):
    onnx.save(_det_model(), tmp_path / "model.onnx")
    with pytest.raises(LegalizationError, match="Det.*determinant"):
        create_session(
            str(tmp_path / "model.onnx"), providers=["ipu"], provider_options={"device": "emulator"}
        )
