"""The model matrix: every ONNX file of each zoo export is legalized, PopART-ready, and computes the same.

Each graph is legalized at a small static shape, checked for what PopART needs (opset <= 11, every op in
the table, static shapes, no forbidden dtype), and run on onnxruntime CPU against the original export on
the same inputs (cast to the legalized input types): atol 1e-5 plus rtol 1e-5 in fp32 (the rtol is the
float32 floor of all-MiniLM-L6-v2, see matrix_testing.FP32_RTOL). Decoders are fed what a real generation
step feeds them (matrix_testing): the encoder's output, and the previous step's present key/values as past.
`optimum-ipu check` and the emulator engine are run over the same matrix by test_check_matrix.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from graph_testing import feeds_for_types, run_ort
from matrix_testing import (
    BATCH,
    FP32_ATOL,
    FP32_RTOL,
    MATRIX,
    MATRIX_IDS,
    SEQ,
    assert_popart_ready,
    decoder_only_steps,
    input_names,
    only_inputs,
    seq2seq_steps,
)
from onnx import helper

from optimum_ipu_backend.compiler import LegalizationError, find_unsupported_nodes, legalize
from optimum_ipu_backend.conformance.zoo import preprocessed_inputs


def test_importing_the_compiler_does_not_import_the_folding_libraries():
    code = (
        "import sys, optimum_ipu_backend.compiler\n"
        "print(sorted({'onnxslim', 'onnxscript'} & set(sys.modules)))"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert completed.stdout.strip() == "[]"


def _weights_model() -> onnx.ModelProto:
    """A graph with a weight large enough to travel through the passes as a stand-in input."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((128, 256)).astype(np.float32)
    weight[0, 0] = -1e6  # out of float16 range: clamped like a mask constant
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["w", "ids"], ["rows"], axis=0),
            helper.make_node("ReduceSum", ["rows", "axes"], ["y"], keepdims=0),
        ],
        "weights",
        [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["batch", 3])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 3])],
        initializer=[
            onnx.numpy_helper.from_array(weight, "w"),
            onnx.numpy_helper.from_array(np.array([-1], np.int64), "axes"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_legalize_keeps_weights_converts_them_and_leaves_its_argument_alone(precision):
    model = _weights_model()
    snapshot = model.SerializeToString()
    legalized = legalize(model, {"ids": (2, 3)}, precision=precision)
    assert model.SerializeToString() == snapshot
    assert legalized.input_types == {"ids": onnx.TensorProto.INT32}
    assert legalized.input_shapes == {"ids": (2, 3)} and legalized.output_shapes == {"y": (2, 3)}
    weight = next(i for i in legalized.model.graph.initializer if i.name == "w")
    want_type = onnx.TensorProto.FLOAT16 if precision == "fp16" else onnx.TensorProto.FLOAT
    assert weight.data_type == want_type and legalized.output_types["y"] == want_type
    assert find_unsupported_nodes(legalized.model) == []
    ids = np.array([[0, 5, 127], [3, 3, 9]], np.int64)
    expected = run_ort(model, {"ids": ids})["y"]
    actual = run_ort(legalized.model, feeds_for_types({"ids": ids}, legalized.input_types))["y"]
    if precision == "fp32":
        np.testing.assert_allclose(actual, expected, atol=1e-4, rtol=1e-6)
    else:
        assert np.isfinite(actual).all()
        finite_rows = np.array([[False, True, True], [True, True, True]])  # row 0 holds the -1e6 weight
        np.testing.assert_allclose(actual[finite_rows], expected[finite_rows], rtol=2e-2, atol=0.5)


def test_legalize_errors_name_the_failing_pass_and_keep_earlier_reports():
    with pytest.raises(LegalizationError) as error:
        legalize(_weights_model(), {})
    assert error.value.failed_pass == "fix_shapes" and "batch" in str(error.value)
    with pytest.raises(ValueError, match="precision"):
        legalize(_weights_model(), {"ids": (1, 3)}, precision="bf16")


def _cases(
    name: str, export_dir: Path, model_dir: Path
) -> list[tuple[str, onnx.ModelProto, dict[str, np.ndarray]]]:
    graphs = {path.name: onnx.load(path) for path in sorted(export_dir.glob("*.onnx"))}
    sample = preprocessed_inputs(model_dir, batch=BATCH, seq=SEQ)
    if "encoder_model.onnx" in graphs:
        steps = seq2seq_steps(export_dir, sample)
        feeds = {
            "encoder_model.onnx": steps.encoder,
            "decoder_model.onnx": steps.prefix,
            "decoder_with_past_model.onnx": steps.next_step,
        }
        assert set(feeds) == set(graphs), sorted(graphs)
        return [(file, graphs[file], only_inputs(graphs[file], feeds[file])) for file in sorted(graphs)]
    assert list(graphs) == ["model.onnx"], sorted(graphs)
    model = graphs["model.onnx"]
    if any(n.startswith("past_key_values") for n in input_names(model)):
        first, second = decoder_only_steps(model, sample)
        return [("model.onnx (empty past)", model, first), ("model.onnx (with past)", model, second)]
    return [("model.onnx", model, only_inputs(model, sample))]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "task"), MATRIX, ids=MATRIX_IDS)
def test_every_graph_legalizes_and_matches_the_original(zoo, name, task):
    export_dir = zoo.onnx(name, task)
    for label, original, feeds in _cases(name, export_dir, zoo.model(name, task)):
        shapes = {k: v.shape for k, v in feeds.items()}
        snapshot = original.SerializeToString()
        legalized = legalize(original, shapes)
        assert original.SerializeToString() == snapshot, f"{label}: legalize() changed its argument"
        assert_popart_ready(legalized.model, label)
        # Folding may drop an input no output depends on (an empty past): the session feeds input_types only.
        assert set(legalized.input_shapes) <= set(shapes), label
        assert all(legalized.input_shapes[k] == tuple(shapes[k]) for k in legalized.input_shapes), label
        expected = run_ort(original, feeds)
        actual = run_ort(legalized.model, feeds_for_types(feeds, legalized.input_types))
        assert set(expected) <= set(actual), label
        for output, want in expected.items():
            got = actual[output]
            assert got.shape == want.shape, (label, output)
            np.testing.assert_allclose(
                got, want, atol=FP32_ATOL, rtol=FP32_RTOL, err_msg=f"{label}: {output}"
            )


@pytest.fixture(scope="module")
def minilm_classifier(tmp_path_factory) -> tuple[Path, Path]:
    """A BERT sequence classifier with all-MiniLM-L6-v2's real encoder and a seeded 3-label head.

    The zoo's random tiny BERT has logits of ~5e-3 whose top-2 margins (median 6e-5) are below float16's
    resolution, so its top-1 under float16 is a coin toss for any implementation; trained encoder weights
    give margins a classifier actually has.
    """
    import shutil

    import torch
    import transformers

    from optimum_ipu_backend.conformance.zoo import export_onnx, minilm_dir

    root = tmp_path_factory.mktemp("minilm-classifier")
    model_dir = root / "model"
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification.from_pretrained(minilm_dir(), num_labels=3)
    model.eval().save_pretrained(model_dir)
    for tokenizer_file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(minilm_dir() / tokenizer_file, model_dir / tokenizer_file)
    return model_dir, export_onnx(model_dir, "text-classification", root / "onnx")


@pytest.mark.slow
def test_fp16_bert_classification_top1_agrees_on_256_inputs(minilm_classifier):
    model_dir, export_dir = minilm_classifier
    original = onnx.load(export_dir / "model.onnx")
    feeds = preprocessed_inputs(model_dir, batch=256, seq=16, seed=7)
    feeds = only_inputs(original, feeds)
    legalized = legalize(original, {k: v.shape for k, v in feeds.items()}, precision="fp16")
    assert legalized.output_types["logits"] == onnx.TensorProto.FLOAT16
    assert_popart_ready(legalized.model, "bert fp16")
    expected = run_ort(original, feeds)["logits"]
    actual = run_ort(legalized.model, feeds_for_types(feeds, legalized.input_types))["logits"]
    assert np.isfinite(actual).all()
    agreement = np.mean(np.argmax(actual, axis=-1) == np.argmax(expected, axis=-1))
    assert agreement >= 0.99, agreement


def test_fp16_minilm_sentence_embeddings_keep_cosine_0_999(zoo):
    task = "feature-extraction"
    export_dir = zoo.onnx("minilm", task)
    original = onnx.load(export_dir / "model.onnx")
    feeds = preprocessed_inputs(zoo.model("minilm", task), batch=16, seq=32, seed=3)
    feeds = only_inputs(original, feeds)
    legalized = legalize(original, {k: v.shape for k, v in feeds.items()}, precision="fp16")
    assert_popart_ready(legalized.model, "minilm fp16")
    mask = feeds["attention_mask"][..., None].astype(np.float32)

    def embed(hidden: np.ndarray) -> np.ndarray:  # sentence-transformers' mean pooling
        return (hidden.astype(np.float32) * mask).sum(axis=1) / mask.sum(axis=1)

    expected = embed(run_ort(original, feeds)["last_hidden_state"])
    actual = embed(
        run_ort(legalized.model, feeds_for_types(feeds, legalized.input_types))["last_hidden_state"]
    )
    cosine = np.sum(expected * actual, axis=-1) / (
        np.linalg.norm(expected, axis=-1) * np.linalg.norm(actual, axis=-1)
    )
    assert cosine.min() >= 0.999, cosine
