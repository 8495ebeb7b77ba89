"""Quantized models at session creation: a QDQ network with constant scales runs on the emulator and
matches onnxruntime CPU; a dynamically quantized BERT (ORTQuantizer, is_static=False) is refused at
creation with the one message that names the quantization, says why and gives the alternative."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from emulator_sessions import emulator_session
from onnx import TensorProto, helper, numpy_helper

from optimum_ipu_backend.compiler.errors import LegalizationError
from optimum_ipu_backend.compiler.refused_operators import DYNAMIC_QUANTIZATION


def _qdq_network(rng: np.random.Generator) -> onnx.ModelProto:
    """Two MatMul layers as ORTQuantizer's QDQ format writes them: int8 weights (per-channel) and an
    int32 bias behind DequantizeLinear, activations through QuantizeLinear -> DequantizeLinear."""
    nodes, initializers = [], []

    def const(name: str, value: np.ndarray) -> str:
        initializers.append(numpy_helper.from_array(value, name))
        return name

    def qdq(x: str, name: str, scale: float, zero: int) -> str:
        s, z = const(f"{name}_s", np.float32(scale)), const(f"{name}_z", np.uint8(zero))
        nodes.append(helper.make_node("QuantizeLinear", [x, s, z], [f"{name}_q"]))
        nodes.append(helper.make_node("DequantizeLinear", [f"{name}_q", s, z], [f"{name}_dq"]))
        return f"{name}_dq"

    def layer(x: str, name: str, k: int, n: int) -> str:
        w_scale = rng.uniform(0.002, 0.02, size=n).astype(np.float32)
        weights = const(f"{name}_w", rng.integers(-127, 128, size=(k, n)).astype(np.int8))
        nodes.append(
            helper.make_node(
                "DequantizeLinear",
                [weights, const(f"{name}_ws", w_scale), const(f"{name}_wz", np.zeros(n, np.int8))],
                [f"{name}_wf"],
                axis=1,
            )
        )
        nodes.append(helper.make_node("MatMul", [x, f"{name}_wf"], [f"{name}_mm"]))
        bias = const(f"{name}_b", rng.integers(-5000, 5000, size=n).astype(np.int32))
        nodes.append(
            helper.make_node(
                "DequantizeLinear", [bias, const(f"{name}_bs", np.float32(1e-4))], [f"{name}_bf"]
            )
        )
        nodes.append(helper.make_node("Add", [f"{name}_mm", f"{name}_bf"], [f"{name}_out"]))
        return f"{name}_out"

    h = layer(qdq("x", "in", 0.02, 128), "fc1", 16, 32)
    h = qdq(h, "fc1_act", 0.15, 128)
    nodes.append(helper.make_node("Relu", [h], ["relu"]))
    y = layer(qdq("relu", "relu_act", 0.15, 0), "fc2", 32, 8)
    nodes.append(helper.make_node("Identity", [y], ["logits"]))
    graph = helper.make_graph(
        nodes,
        "qdq_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [4, 8])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _ort(path: Path, feed: dict[str, np.ndarray], level: ort.GraphOptimizationLevel) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, feed)[0]


def test_a_qdq_network_with_constant_scales_matches_cpu_on_the_emulator(tmp_path):
    rng = np.random.default_rng(7)
    onnx_dir = tmp_path / "qdq"
    onnx_dir.mkdir()
    onnx.save(_qdq_network(rng), str(onnx_dir / "model.onnx"))
    session = emulator_session(onnx_dir, tmp_path / "cache")
    for seed in range(3):
        feed = {"x": np.random.default_rng(seed).uniform(-2.5, 2.5, size=(4, 16)).astype(np.float32)}
        got = session.run(None, feed)[0]
        # The QDQ graph as ONNX defines it (no fusion): the same float arithmetic in another order of
        # summation inside MatMul, so equal to float32 rounding.
        reference = _ort(onnx_dir / "model.onnx", feed, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
        np.testing.assert_allclose(got, reference, rtol=0, atol=1e-5)
        # onnxruntime's default optimization level (ORT_ENABLE_ALL) is no reference here: it fuses the
        # QDQ pattern into integer kernels, whose logits here differ from the unfused graph's by up to
        # about 10 (measured, cause not investigated).


@pytest.fixture(scope="module")
def dynamically_quantized_bert(bert, tmp_path_factory) -> Path:
    from optimum.onnxruntime import ORTQuantizer
    from optimum.onnxruntime.configuration import AutoQuantizationConfig

    _, export = bert
    out = tmp_path_factory.mktemp("bert-dynamic-int8")
    quantizer = ORTQuantizer.from_pretrained(export, file_name="model.onnx")
    quantizer.quantize(
        save_dir=out,
        quantization_config=AutoQuantizationConfig.avx512_vnni(is_static=False, per_channel=False),
    )
    served = tmp_path_factory.mktemp("bert-dynamic-int8-served")
    for item in out.iterdir():
        shutil.copy(item, served / ("model.onnx" if item.name == "model_quantized.onnx" else item.name))
    ops = {
        node.op_type for node in onnx.load(str(served / "model.onnx"), load_external_data=False).graph.node
    }
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= ops
    return served


def _assert_the_quantization_message(message: str) -> None:
    assert DYNAMIC_QUANTIZATION in message
    assert "dynamic int8 quantization (DynamicQuantizeLinear + MatMulInteger)" in message
    assert "scales computed on every call from the data" in message
    assert "no int8 matrix multiply" in message and "opset 11" in message
    assert "emulating them in float would change the results" in message
    assert 'Load the unquantized model instead, with provider_options={"precision": "fp16"}' in message
    assert message.count(DYNAMIC_QUANTIZATION) == 1, message  # one message for the model, not per node
    assert "1 offending node(s)" in message


def test_a_dynamically_quantized_bert_is_refused_at_session_creation(dynamically_quantized_bert, tmp_path):
    with pytest.raises(LegalizationError) as raised:
        emulator_session(dynamically_quantized_bert, tmp_path / "cache")
    _assert_the_quantization_message(str(raised.value))
    assert "try the other precision" not in str(raised.value)  # the general advice does not apply


def test_ortmodel_from_pretrained_refuses_it_with_the_same_message(dynamically_quantized_bert, tmp_path):
    from optimum.onnxruntime import ORTModelForSequenceClassification

    with pytest.raises(Exception) as raised:  # noqa: PT011 - whatever optimum wraps it in, the words count
        ORTModelForSequenceClassification.from_pretrained(
            dynamically_quantized_bert,
            provider="ipu",
            provider_options={"device": "emulator", "executable_cache_dir": str(tmp_path)},
        )
    _assert_the_quantization_message(str(raised.value))


def test_check_reports_the_refused_quantization_once_per_kind(dynamically_quantized_bert, capsys):
    """`optimum-ipu check` on the quantized export: each refused kind on one line with its count."""
    from optimum_ipu_backend.cli.check import main

    assert main([str(dynamically_quantized_bert), "--dim", "sequence_length=16"]) == 1
    text = capsys.readouterr().out
    assert "PopART-ready: no" in text
    lines = [line for line in text.splitlines() if "dynamic int8 quantization" in line]
    assert len(lines) == 2, text  # DynamicQuantizeLinear and MatMulInteger, each with its count
    assert any(line.strip().startswith("- 18 MatMulInteger nodes") for line in lines), lines


def test_check_names_the_fused_operators_it_lowered(zoo, capsys):
    """`optimum-ipu check` on ORTOptimizer's O2 BERT: onnxruntime's fused operators, lowered, by count."""
    import json

    from optimum_ipu_backend.cli.check import main

    optimized = zoo.optimized("bert", "text-classification", "O2")
    assert main([str(optimized), "--dim", "sequence_length=16", "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)["files"]
    assert report["runtime_operators_lowered"] == {
        "com.microsoft::Attention": 2,
        "com.microsoft::BiasGelu": 2,
        "com.microsoft::SkipLayerNormalization": 4,
    }
