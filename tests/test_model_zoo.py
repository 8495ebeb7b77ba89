"""The model zoo builds loadable models whose ONNX exports agree with eager torch on the CPU provider."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import numpy as np
import optimum.onnxruntime
import pytest
import torch
import transformers

from optimum_ipu_backend.conformance.definition import load_models
from optimum_ipu_backend.conformance.zoo import (
    MODEL_NAMES,
    PATTERN_TASKS,
    TASKS,
    ModelZoo,
    auto_model_class_for,
    build_model,
    export_onnx,
    preprocessed_inputs,
    task_of_config,
)

# Eager torch and ORT CPU run the same fp32 arithmetic in a different order; tiny models stay well inside.
ATOL = 1e-4
NEW_TOKENS = 16
GENERATIVE_CLASSES = {"ORTModelForCausalLM", "ORTModelForSeq2SeqLM", "ORTModelForSpeechSeq2Seq"}

# The conformance suite's model matrix: every TASKS entry plus a head for each remaining family, so that
# every zoo name is exported and checked against eager torch (the suite's CPU reference is checked here).
CASES: list[tuple[str, str, str]] = [
    (entry.ort_class, entry.architecture, entry.export_task) for entry in load_models().entries
]
TINY_NAMES = [name for name in MODEL_NAMES if name != "minilm"]
# The pattern models are only used with their heads (LongT5's base model reloads its embeddings by tying).
PATTERN_HEADS = {case.model: case.task for cases in PATTERN_TASKS.values() for case in cases}


def _torch_inputs(inputs: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {key: torch.from_numpy(value) for key, value in inputs.items()}


def _generation_inputs(inputs: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    # generate() builds decoder ids and positions itself.
    prompt = {key: value for key, value in inputs.items() if key not in ("decoder_input_ids", "position_ids")}
    return _torch_inputs(prompt)


def _float_outputs(outputs: Any) -> dict[str, np.ndarray]:
    """The float tensors of a ModelOutput by field name (caches are checked through generate())."""
    return {
        key: value.detach().numpy()
        for key, value in outputs.items()
        if isinstance(value, torch.Tensor) and value.is_floating_point()
    }


def build_auto_model(model_dir: Path) -> transformers.PreTrainedModel:
    """The saved head, reloaded; every weight must come from the checkpoint, none freshly initialised."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    model, loading_info = auto_model_class_for(task_of_config(config)).from_pretrained(
        model_dir, local_files_only=True, output_loading_info=True
    )
    missing = set(loading_info.pop("missing_keys"))
    assert not any(loading_info.values()), f"{model_dir.name}: {loading_info}"
    # A key saved only once because it is tied (LongT5's embeddings share `shared`) is missing but not fresh.
    parameters = dict(model.named_parameters(remove_duplicate=False))
    loaded_storage = {parameters[name].data_ptr() for name in parameters.keys() - missing}
    fresh = {key for key in missing if parameters[key].data_ptr() not in loaded_storage}
    assert not fresh, f"{model_dir.name}: newly initialised {sorted(fresh)}"
    return model.eval()


def test_tasks_name_real_ort_classes_and_zoo_models() -> None:
    assert set(MODEL_NAMES) == {
        "bert", "roberta", "camembert", "distilbert", "albert", "electra",
        "gpt2", "t5", "bart", "vit", "whisper", "minilm",
        "convbert", "esm", "m2m100", "longt5", "qwen3_moe", "wav2vec2", "llama",
    }  # fmt: skip
    for tasks in (TASKS, PATTERN_TASKS):
        for class_name in tasks:
            assert hasattr(optimum.onnxruntime, class_name), class_name
        assert {case.model for cases in tasks.values() for case in cases} <= set(MODEL_NAMES)
        # Every case the tests use per class is in the conformance matrix, which covers every zoo name.
        assert {(c, case.model, case.task) for c, cases in tasks.items() for case in cases} <= set(CASES)
    assert {name for _, name, _ in CASES} == set(MODEL_NAMES)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_reloads_offline_with_auto_classes(zoo: ModelZoo, name: str) -> None:
    model_dir = zoo.model(name, PATTERN_HEADS.get(name))
    config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    model = build_auto_model(model_dir)
    assert type(model).__name__ == config.architectures[0]
    if name != "minilm":
        assert sum(p.numel() for p in model.parameters()) < 200_000, "zoo models must stay tiny"
    if name == "vit":
        transformers.AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
        return
    if name == "wav2vec2":
        transformers.AutoFeatureExtractor.from_pretrained(model_dir, local_files_only=True)
        return
    if name == "whisper":
        processor = transformers.AutoProcessor.from_pretrained(model_dir, local_files_only=True)
        assert processor.feature_extractor.feature_size == config.num_mel_bins
        assert processor.feature_extractor.nb_max_frames == 2 * config.max_source_positions
        return
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert len(tokenizer) <= config.vocab_size
    assert tokenizer.pad_token_id is not None
    # A tokenizer that emits inputs the model's forward does not take breaks generate().
    forward_parameters = inspect.signature(model.forward).parameters
    emitted = tokenizer("the quick brown fox").keys()
    assert set(emitted) <= set(forward_parameters), f"{name}: {set(emitted) - set(forward_parameters)}"


@pytest.mark.parametrize("name", TINY_NAMES)
def test_build_is_deterministic(zoo: ModelZoo, tmp_path: Path, name: str) -> None:
    first = zoo.model(name)
    second = build_model(name, tmp_path)
    assert second != first
    files = sorted(path.name for path in first.iterdir() if path.is_file())
    assert files == sorted(path.name for path in second.iterdir() if path.is_file())
    for file_name in files:
        assert (first / file_name).read_bytes() == (second / file_name).read_bytes(), file_name


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_sample_inputs_exercise_padding(zoo: ModelZoo, name: str) -> None:
    model_dir = zoo.model(name)
    inputs = preprocessed_inputs(model_dir, batch=3, seq=10, seed=1)
    assert all(value.shape[0] == 3 for value in inputs.values())
    if "attention_mask" in inputs:
        mask = inputs["attention_mask"]
        assert mask.shape == (3, 10) and mask.dtype == np.int64
        assert mask[0].all() and not mask[-1].all()
    if "token_type_ids" in inputs:
        assert set(np.unique(inputs["token_type_ids"])) == {0, 1}
    again = preprocessed_inputs(model_dir, batch=3, seq=10, seed=1)
    assert all(np.array_equal(inputs[key], again[key]) for key in inputs)
    if name == "whisper":
        features = inputs["input_features"]
        assert features.dtype == np.float32 and np.ptp(features[0]) > 0
    if name == "vit":
        assert inputs["pixel_values"].shape == (3, 3, 32, 32)
    if name == "wav2vec2":
        values = inputs["input_values"]
        assert values.dtype == np.float32 and values.shape == (3, 200)
        assert np.all(values[-1, -100:] == 0) and np.all(values[0] != 0)


def test_export_is_cached_and_refuses_a_different_request(zoo: ModelZoo, tmp_path: Path) -> None:
    model_dir = zoo.model("bert", "text-classification")
    out_dir = tmp_path / "export"
    assert export_onnx(model_dir, "text-classification", out_dir) == out_dir
    onnx_file = out_dir / "model.onnx"
    stamp = onnx_file.stat().st_mtime_ns
    assert export_onnx(model_dir, "text-classification", out_dir) == out_dir
    assert onnx_file.stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="different export"):
        export_onnx(model_dir, "text-classification", out_dir, opset=14)


def test_generation_models_do_not_repeat_one_token(zoo: ModelZoo) -> None:
    """Random weights must still give varied greedy output, or generate() comparisons would prove little."""
    for name, task in (
        ("gpt2", "text-generation"),
        ("t5", "text2text-generation"),
        ("bart", "text2text-generation"),
        ("whisper", "automatic-speech-recognition"),
        ("m2m100", "text2text-generation"),
        ("longt5", "text2text-generation"),
        ("qwen3_moe", "text-generation"),
        ("llama", "text-generation"),
    ):
        model_dir = zoo.model(name, task)
        model = build_auto_model(model_dir)
        generated = model.generate(
            **_generation_inputs(preprocessed_inputs(model_dir)),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
        for row in generated[:, -NEW_TOKENS:]:
            assert len(set(row.tolist())) >= 4, f"{name}: {row.tolist()}"


@pytest.mark.parametrize(("class_name", "name", "task"), CASES, ids=[f"{c[1]}-{c[2]}" for c in CASES])
def test_onnx_export_matches_eager_torch(zoo: ModelZoo, class_name: str, name: str, task: str) -> None:
    model_dir = zoo.model(name, task)
    onnx_dir = zoo.onnx(name, task)
    assert list(onnx_dir.glob("*.onnx")), f"no ONNX file in {onnx_dir}"
    marker = json.loads((onnx_dir / ".zoo-export.json").read_text())
    assert marker["task"] == task

    eager = build_auto_model(model_dir)
    ort_model = getattr(optimum.onnxruntime, class_name).from_pretrained(
        onnx_dir, provider="CPUExecutionProvider", local_files_only=True
    )
    inputs = preprocessed_inputs(model_dir)

    with torch.no_grad():
        expected = _float_outputs(eager(**_torch_inputs(inputs)))
        actual = _float_outputs(ort_model(**_torch_inputs(inputs)))
    compared = [key for key in expected if key in actual]
    assert compared, f"no common outputs: torch {list(expected)}, ort {list(actual)}"
    for key in compared:
        np.testing.assert_allclose(actual[key], expected[key], rtol=0, atol=ATOL, err_msg=key)

    if class_name in GENERATIVE_CLASSES:
        settings = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False}
        expected_tokens = eager.generate(**_generation_inputs(inputs), **settings)
        actual_tokens = ort_model.generate(**_generation_inputs(inputs), **settings)
        assert actual_tokens.tolist() == expected_tokens.tolist()


def _graph_signature(onnx_dir: Path) -> dict[str, Any]:
    import onnx

    signature = {}
    for onnx_file in sorted(onnx_dir.glob("*.onnx")):
        graph = onnx.load(onnx_file, load_external_data=False).graph
        signature[onnx_file.name] = [
            (value.name, [dim.dim_param or dim.dim_value for dim in value.type.tensor_type.shape.dim])
            for value in [*graph.input, *graph.output]
        ]
    return signature


@pytest.mark.parametrize(
    ("class_name", "name", "task"),
    [
        ("ORTModelForCausalLM", "gpt2", "text-generation-with-past"),
        ("ORTModelForSeq2SeqLM", "t5", "text2text-generation-with-past"),
    ],
)
@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::DeprecationWarning")
def test_export_matches_from_pretrained_export(zoo: ModelZoo, class_name: str, name: str, task: str) -> None:
    """Same files and graph interfaces as ORTModel's own export (merged causal decoder, split seq2seq)."""
    ort_model = getattr(optimum.onnxruntime, class_name).from_pretrained(
        zoo.model(name, task), export=True, provider="CPUExecutionProvider"
    )
    assert _graph_signature(zoo.onnx(name, task)) == _graph_signature(Path(ort_model.model_save_dir))
