"""Every ORTModel class, unchanged, with provider="ipu" on the host emulator matches the same class on
CPUExecutionProvider: outputs within atol 1e-5, generated tokens identical.

The checks run in one fresh interpreter of the installed environment (ortmodel_checks.py), where
the plugin is active only through what pip installed; this process builds the models and applies
the tolerances.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from subprocess_env import python

from optimum_ipu_backend.conformance.zoo import export_onnx

ATOL = 1e-5

FORWARD = {
    "sequence-classification": ("ORTModelForSequenceClassification", "bert", "text-classification"),
    "token-classification": ("ORTModelForTokenClassification", "bert", "token-classification"),
    "question-answering": ("ORTModelForQuestionAnswering", "bert", "question-answering"),
    "feature-extraction": ("ORTModelForFeatureExtraction", "bert", "feature-extraction"),
    "feature-extraction-minilm": ("ORTModelForFeatureExtraction", "minilm", "feature-extraction"),
    "masked-lm": ("ORTModelForMaskedLM", "bert", "fill-mask"),
    "multiple-choice": ("ORTModelForMultipleChoice", "bert", "multiple-choice"),
    "image-classification": ("ORTModelForImageClassification", "vit", "image-classification"),
}
GENERATE = {
    "causal-lm-with-cache": ("ORTModelForCausalLM", "gpt2", "text-generation-with-past", {}),
    "causal-lm-without-cache": ("ORTModelForCausalLM", "gpt2", "text-generation", {"use_cache": False}),
    # grouped-query attention, rotary positions and RMSNorm
    "causal-lm-llama": ("ORTModelForCausalLM", "llama", "text-generation-with-past", {}),
    "seq2seq-t5": ("ORTModelForSeq2SeqLM", "t5", "text2text-generation-with-past", {}),
    "seq2seq-t5-merged": ("ORTModelForSeq2SeqLM", "t5", "merged", {"use_merged": True}),
    "seq2seq-bart": ("ORTModelForSeq2SeqLM", "bart", "text2text-generation-with-past", {}),
    "speech-seq2seq-whisper": (
        "ORTModelForSpeechSeq2Seq",
        "whisper",
        "automatic-speech-recognition-with-past",
        {},
    ),
}
IPU_FORMS = {
    # the other accepted spellings, each on one case
    "sequence-classification": {
        "provider": "IPUExecutionProvider",
        "provider_options": {"device": "emulator"},
    },
    "token-classification": {
        "providers": ["ipu", "CPUExecutionProvider"],
        "provider_options": [{"device": "emulator"}, {}],
    },
}


def _onnx_dir(zoo, model: str, task: str) -> Path:
    if task == "merged":  # the decoders merged into one graph with an If on use_cache_branch
        return export_onnx(
            zoo.model(model, "text2text-generation"),
            "text2text-generation-with-past",
            zoo.root / "onnx" / f"{model}-merged",
            no_post_process=False,
        )
    return zoo.onnx(model, task)


@pytest.fixture(scope="module")
def results(tmp_path_factory, zoo) -> dict:
    scratch = tmp_path_factory.mktemp("ortmodels")
    cases = {}
    for name, (cls, model, task) in FORWARD.items():
        cases[name] = {
            "kind": "forward",
            "class": cls,
            "model": model,
            "model_dir": str(zoo.model(model, task)),
            "onnx_dir": str(_onnx_dir(zoo, model, task)),
            "scratch": str(scratch / name),
        }
        if name in IPU_FORMS:
            cases[name]["ipu_kwargs"] = IPU_FORMS[name]
    cases["sequence-classification"].update(io_binding=True, save_reload=True)
    for name, (cls, model, task, load_kwargs) in GENERATE.items():
        cases[name] = {
            "kind": "generate",
            "class": cls,
            "model": model,
            "load_kwargs": load_kwargs,
            "model_dir": str(zoo.model(model, "text2text-generation" if task == "merged" else task)),
            "onnx_dir": str(_onnx_dir(zoo, model, task)),
            "io_binding": name == "causal-lm-with-cache",
        }
    seq_cls = cases["sequence-classification"]
    cases["pipeline-text-classification"] = {
        "kind": "pipeline",
        "class": seq_cls["class"],
        "task": "text-classification",
        "model_dir": seq_cls["model_dir"],
        "onnx_dir": seq_cls["onnx_dir"],
    }
    spec = scratch / "cases.json"
    spec.write_text(json.dumps(cases))
    script = Path(__file__).with_name("ortmodel_checks.py")
    completed = python(
        f"import runpy, sys; sys.argv = ['checks', {str(spec)!r}]; "
        f"runpy.run_path({str(script)!r}, run_name='__main__')"
    )
    assert completed.returncode == 0, completed.stderr[-5000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _case(results: dict, name: str) -> dict:
    result = results[name]
    assert "error" not in result, result.get("error")
    return result


def _assert_on_ipu_emulator(result: dict) -> None:
    assert result["provider"] == "IPUExecutionProvider"
    assert result["sessions"], "no session found on the model"
    for session in result["sessions"]:
        assert session["type"] == "IPUInferenceSession" and session["is_inference_session"]
        assert session["options"]["device"] == "emulator" and session["options"]["emulated"] == "1"
    assert result["fallback_warnings"] == []


@pytest.mark.parametrize("name", list(FORWARD))
def test_forward_matches_cpu(results, name):
    result = _case(results, name)
    _assert_on_ipu_emulator(result)
    assert result["max_abs_diff"] <= ATOL
    # the 3 rows ran padded to the compiled batch 4
    assert all(session["compiled_batches"] == [4] for session in result["sessions"]), result["sessions"]


@pytest.mark.parametrize("name", list(GENERATE))
def test_generate_matches_cpu_tokens(results, name):
    result = _case(results, name)
    _assert_on_ipu_emulator(result)
    assert result["tokens_equal"], result["expected_tokens"]
    assert result["distinct_tokens"] >= 3, "degenerate generation cannot tell providers apart"


def test_io_binding(results):
    assert _case(results, "sequence-classification")["io_binding_max_abs_diff"] <= ATOL
    assert _case(results, "causal-lm-with-cache")["io_binding_tokens_equal"]


def test_save_pretrained_then_reload_with_ipu(results):
    result = _case(results, "sequence-classification")
    assert result["reload_provider"] == "IPUExecutionProvider"
    assert result["reload_max_abs_diff"] <= ATOL


def test_pipelines(results):
    result = _case(results, "pipeline-text-classification")
    assert result["transformers_max_abs_diff"] <= ATOL
    assert result["optimum_max_abs_diff"] <= ATOL
    assert result["optimum_pipeline_model_provider"] == "IPUExecutionProvider"
