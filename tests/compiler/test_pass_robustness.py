"""No pass crashes: unusual but valid graphs through every pass, and the error a crash becomes.

Each graph is one ONNX allows and some exporter writes: an old opset, IR 3 (every initializer also a graph
input), an initializer that is a caller-overridable default, a graph with no node, an output that is an
input, an output that is an initializer, a subgraph, and a weight large enough to travel as a stand-in.
Every pass (alone, after fix_shapes) either succeeds or refuses with a LegalizationError that is not a
CompilerBugError; the whole pipeline legalizes each graph, and the legalized graph computes what the source
graph computes on onnxruntime CPU (or, where CPU has no kernel for the old opset, what ONNX's reference
evaluator computes).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from optimum_ipu_backend.compiler import LegalizationError, legalize
from optimum_ipu_backend.compiler.errors import CompilerBugError, OpsetConversionError
from optimum_ipu_backend.compiler.graphs import initializer_inputs_as_constants, weight_free_copy
from optimum_ipu_backend.compiler.passes.base import PassContext
from optimum_ipu_backend.compiler.passes.fix_shapes import FixShapes
from optimum_ipu_backend.compiler.pipeline import build_passes

FLOAT = TensorProto.FLOAT
RNG = np.random.default_rng(0)


def _model(nodes, inputs, outputs, initializers=(), opset=13, ir_version=8) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "unusual", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", opset)])
    model.ir_version = ir_version
    return model


def _tensor(name: str, *shape: int) -> onnx.TensorProto:
    return numpy_helper.from_array(RNG.standard_normal(shape).astype(np.float32), name)


def _value(name: str, *shape: int, elem_type: int = FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, list(shape))


def ir3_opset6_gemm() -> onnx.ModelProto:
    """PyTorch's opset-6 exports: IR 3, weights listed among the inputs, Add with the old broadcast flag."""
    w, b = _tensor("w", 4, 3), _tensor("b", 3)
    nodes = [
        helper.make_node("Gemm", ["x", "w", "b"], ["h"], broadcast=1),
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.float32([0.5]), "c")),
        helper.make_node("Add", ["h", "c"], ["y"], broadcast=1),
    ]
    inputs = [_value("x", 2, 4), _value("w", 4, 3), _value("b", 3)]
    return _model(nodes, inputs, [_value("y", 2, 3)], [w, b], opset=6, ir_version=3)


def ir3_opset9_constant_folded() -> onnx.ModelProto:
    """IR 3 with a Constant node: folding it makes an initializer that an IR-3 graph must also list."""
    nodes = [
        helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.float32([[2.0]]), "k")),
        helper.make_node("Mul", ["x", "k"], ["y"]),
    ]
    return _model(nodes, [_value("x", 2, 5)], [_value("y", 2, 5)], opset=9, ir_version=3)


def ir3_listed_weight() -> onnx.ModelProto:
    """IR 3 with a weight past the stand-in threshold, listed as an input like every IR-3 initializer."""
    w = _tensor("w", 128, 160)  # 80 KiB: a weight the passes carry as a typed stand-in input
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    return _model(nodes, [_value("x", 2, 128), _value("w", 128, 160)], [_value("y", 2, 160)], [w], 9, 3)


def overridable_default() -> onnx.ModelProto:
    """IR 4 and later: an input with an initializer is a default the caller may override."""
    nodes = [helper.make_node("Add", ["x", "bias"], ["y"])]
    inputs = [_value("x", 2, 3), _value("bias", 3)]
    return _model(nodes, inputs, [_value("y", 2, 3)], [_tensor("bias", 3)])


def no_node_output_is_input() -> onnx.ModelProto:
    return _model([], [_value("x", 2, 3)], [_value("x", 2, 3)])


def output_is_input_and_computed() -> onnx.ModelProto:
    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    return _model(nodes, [_value("x", 2, 3)], [_value("x", 2, 3), _value("y", 2, 3)])


def output_is_initializer() -> onnx.ModelProto:
    nodes = [helper.make_node("Neg", ["x"], ["y"])]
    outputs = [_value("y", 2, 3), _value("table", 3)]
    return _model(nodes, [_value("x", 2, 3)], outputs, [_tensor("table", 3)])


def if_subgraph_old_opset() -> onnx.ModelProto:
    """An If whose branches read the outer scope, in an opset-9 graph the converter raises to 11."""
    then_branch = helper.make_graph([helper.make_node("Abs", ["x"], ["t"])], "then", [], [_value("t", 2, 3)])
    else_branch = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [], [_value("e", 2, 3)])
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.float32(0), "zero")),
        helper.make_node("Greater", ["s", "zero"], ["positive"]),
        helper.make_node("If", ["positive"], ["y"], then_branch=then_branch, else_branch=else_branch),
    ]
    return _model(nodes, [_value("x", 2, 3)], [_value("y", 2, 3)], opset=9, ir_version=4)


def prelu6_per_channel(width: int = 4) -> onnx.ModelProto:
    """PRelu-6 with one slope per channel, as PyTorch exports PReLU, on [N, C, W]."""
    slope = numpy_helper.from_array(np.float32([0.1, 0.2, 0.3]), "slope")
    nodes = [helper.make_node("PRelu", ["x", "slope"], ["y"])]
    inputs = [_value("x", 2, 3, width), _value("slope", 3)]
    return _model(nodes, inputs, [_value("y", 2, 3, width)], [slope], opset=6, ir_version=3)


GRAPHS: dict[str, Callable[[], onnx.ModelProto]] = {
    f.__name__: f
    for f in (
        ir3_opset6_gemm,
        ir3_opset9_constant_folded,
        ir3_listed_weight,
        overridable_default,
        no_node_output_is_input,
        output_is_input_and_computed,
        output_is_initializer,
        if_subgraph_old_opset,
        prelu6_per_channel,
    )
}


def _feed(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    constants = {init.name for init in model.graph.initializer}
    return {
        value.name: RNG.standard_normal([d.dim_value for d in value.type.tensor_type.shape.dim]).astype(
            np.float32
        )
        for value in model.graph.input
        if value.name not in constants
    }


def _expected(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The source graph's outputs: onnxruntime CPU, or ONNX's reference where CPU lacks the old kernels."""
    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception:  # onnxruntime 1.32 dropped the kernels of opset 6 (Add(6), PRelu(6), ...)
        return list(ReferenceEvaluator(model).run(None, feed))
    return session.run(None, feed)


@pytest.mark.parametrize("name", list(GRAPHS))
def test_every_pass_alone_takes_the_graph_or_refuses_it(name):
    model = GRAPHS[name]()
    onnx.checker.check_model(model)
    copy = weight_free_copy(model)
    initializer_inputs_as_constants(copy)
    ctx = PassContext(input_shapes=_shapes(model))
    fixed = FixShapes().run(copy.model, ctx)
    for graph_pass in build_passes("fp16"):
        try:
            graph_pass.run(onnx.ModelProto.FromString(fixed.SerializeToString()), ctx)
        except LegalizationError as refusal:
            assert not isinstance(refusal, CompilerBugError), (graph_pass.name, str(refusal))
        # Anything else propagates and fails the test: a pass crashed.


def _shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    return {name: array.shape for name, array in _feed(model).items()}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("name", list(GRAPHS))
def test_the_pipeline_legalizes_the_graph_and_keeps_its_meaning(name, precision):
    model = GRAPHS[name]()
    feed = _feed(model)
    legalized = legalize(model, {k: v.shape for k, v in feed.items()}, precision=precision)
    assert all(
        opset.version == 11 for opset in legalized.model.opset_import if opset.domain in ("", "ai.onnx")
    )
    onnx.checker.check_model(legalized.model)
    session = ort.InferenceSession(legalized.model.SerializeToString(), providers=["CPUExecutionProvider"])
    cast = {
        name: array.astype(onnx.helper.tensor_dtype_to_np_dtype(legalized.input_types[name]))
        for name, array in feed.items()
    }
    got = session.run(None, cast)
    for expected, actual in zip(_expected(model, feed), got, strict=True):
        # fp16 keeps 11 bits: a sum of 128 products is off by a few of its own magnitude's ulps.
        scale = float(np.max(np.abs(expected))) if expected.size else 0.0
        rtol, atol = (1e-5, 1e-6) if precision == "fp32" else (1e-2, 4e-3 * scale)
        np.testing.assert_allclose(np.asarray(actual, np.float32), expected, rtol=rtol, atol=atol)


def test_prelu6_slopes_whose_axis_opset6_leaves_open_are_refused():
    """On [2, 3, 3] a slope [3] fits the channel axis (PyTorch's meaning) and the last axis (ONNX's
    reference, PRelu-7's broadcasting); the converter would silently pick the last."""
    with pytest.raises(LegalizationError, match="does not say which it applies along") as raised:
        legalize(prelu6_per_channel(width=3), {"x": (2, 3, 3)})
    assert not isinstance(raised.value, CompilerBugError)


def test_prelu6_slopes_apply_per_channel():
    """Checked against the per-channel formula itself, not only against the reference evaluator."""
    model = prelu6_per_channel()
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    legalized = legalize(model, {"x": x.shape})
    (y,) = ort.InferenceSession(legalized.model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    slope = np.float32([0.1, 0.2, 0.3]).reshape(1, 3, 1)
    np.testing.assert_allclose(y, np.where(x < 0, x * slope, x), rtol=1e-6)


def test_a_crashing_pass_is_a_compiler_bug_naming_the_pass(monkeypatch):
    fold = next(p for p in build_passes("fp32") if p.name == "fold_constants")

    def crash(self, model, ctx):
        raise AttributeError("'NoneType' object has no attribute 'opset_import'")

    monkeypatch.setattr(type(fold), "run", crash)
    model = overridable_default()
    with pytest.raises(CompilerBugError) as raised:
        legalize(model, {"x": (2, 3)}, source="unusual/model.onnx")
    error = raised.value
    assert error.failed_pass == "fold_constants"
    text = str(error)
    assert text.startswith("Compiler bug: the fold_constants pass failed internally with AttributeError")
    assert "model file: unusual/model.onnx" in text
    assert "bug in optimum-ipu-backend" in text and "file an issue" in text
    assert "dimension" not in text  # never advice about shapes
    assert [report.name for report in error.reports] == ["fix_shapes", "fold_static_ifs"]


def test_a_model_the_converter_cannot_take_is_an_opset_conversion_error():
    """BatchNormalization-7 with spatial=0 (statistics per element, not per channel): onnx's 7->9 adapter
    refuses it. The error is the model's, whatever the shapes, and its advice is not about dimensions."""
    stats = [numpy_helper.from_array(np.ones((2, 3), np.float32), name) for name in ("s", "b", "m", "v")]
    nodes = [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], spatial=0)]
    model = _model(nodes, [_value("x", 1, 2, 3)], [_value("y", 1, 2, 3)], stats, opset=7, ir_version=4)
    with pytest.raises(OpsetConversionError) as raised:
        legalize(model, {"x": (1, 2, 3)}, source="old/model.onnx")
    text = str(raised.value)
    assert text.startswith(
        "The model's ai.onnx opset 7 could not be converted to 11 (onnx.version_converter)"
    )
    assert "Attribute spatial must have value 1" in text and "model file: old/model.onnx" in text
    assert "dimension" not in text
    assert raised.value.failed_pass == "lower_opset11"
