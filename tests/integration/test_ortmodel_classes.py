"""One tiny model per ORTModel class outside the main matrix (``CLASS_CASES`` of tests/class_zoo.py:
zero-shot image classification, Vision2Seq, Pix2Struct, image-to-image, EfficientNet, semantic
segmentation, CTC, audio classification, x-vectors, custom tasks) and the text-to-image, image-to-image
and inpainting pipelines, each through its class with provider="ipu" on the host emulator against the
same class on CPUExecutionProvider: outputs within atol 1e-4, generated tokens identical, images within
atol 1e-3.

All cases run in one fresh interpreter of the installed environment (ortmodel_class_checks.py); this
process builds the models and the inputs and applies the tolerances. Batches of 3 run padded to the
compiled batch of 4 where the padding proof allows it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from class_zoo import CLASS_CASES, class_inputs, class_zoo, diffusion_call
from subprocess_env import python_json

from integration.test_ortmodels import _assert_on_ipu_emulator

ATOL = 1e-4
IMAGE_ATOL = 1e-3
FORWARD = [name for name, case in CLASS_CASES.items() if case.kind == "forward"]
GENERATE = [name for name, case in CLASS_CASES.items() if case.kind == "generate"]
DIFFUSION = [name for name, case in CLASS_CASES.items() if case.kind == "diffusion"]


def class_case_specs(zoo, scratch: Path) -> dict[str, dict]:
    """The spec of every CLASS_CASES case for ortmodel_class_checks.py (also run on the SDK engines by
    tests/engines/ortmodels_on_engines.py), built beside the session's ``zoo``; inputs are written
    to ``scratch``."""
    zoo = class_zoo(zoo)
    cases = {}
    for name, case in CLASS_CASES.items():
        cases[name] = {
            "name": name,
            "matrix": "classes",
            "kind": case.kind,
            "class": case.ort_class,
            "onnx_dir": str(zoo.class_onnx(name)),
        }
        if case.kind != "diffusion":  # a pipeline is called with prompts (diffusion_call)
            feeds = scratch / f"{name}.npz"
            np.savez(feeds, **class_inputs(name, zoo.class_model(name)))
            cases[name]["feeds"] = str(feeds)
    return cases


@pytest.fixture(scope="module")
def results(tmp_path_factory, zoo) -> dict:
    scratch = tmp_path_factory.mktemp("ortmodel-classes")
    cases = class_case_specs(zoo, scratch)
    spec = scratch / "cases.json"
    spec.write_text(json.dumps(cases))
    script = Path(__file__).with_name("ortmodel_class_checks.py")
    return python_json(
        f"import runpy, sys; sys.argv = ['checks', {str(spec)!r}]; "
        f"runpy.run_path({str(script)!r}, run_name='__main__')"
    )


def _case(results: dict, name: str) -> dict:
    result = results[name]
    assert "error" not in result, result.get("error")
    _assert_on_ipu_emulator(result)
    _assert_sessions_are_inference_sessions(result)
    return result


def _assert_sessions_are_inference_sessions(result: dict) -> None:
    """Every session the model holds (model.model, model.session, the encoder, decoder and decoder with
    past of a seq2seq model, a pipeline's components) is an onnxruntime.InferenceSession, as optimum-onnx's
    own tests check before they compare outputs; and the walk found each session the model ran on."""
    held = result["held_sessions"]
    assert held and all(entry["is_inference_session"] for entry in held.values()), held
    # the same session can sit in two parts (a seq2seq model's `model` is its encoder): count each once
    ran_on = {facts["id"] for facts in result["sessions"]}
    assert {entry["id"] for entry in held.values()} == ran_on, (held, result["sessions"])


def test_every_class_optimum_onnx_exports_has_a_model() -> None:
    import optimum.onnxruntime

    from optimum_ipu_backend.conformance.zoo import PATTERN_TASKS, TASKS

    covered = {case.ort_class for case in CLASS_CASES.values()} | set(TASKS) | set(PATTERN_TASKS)
    exported = {
        name
        for name in dir(optimum.onnxruntime)
        if name.startswith("ORTModelFor") and name not in ("ORTModelForWhisper", "ORTModelForMoonshine")
    }
    # Whisper's and Moonshine's classes are what ORTModelForSpeechSeq2Seq loads for those model types
    assert exported <= covered, sorted(exported - covered)


@pytest.mark.parametrize("name", FORWARD)
def test_forward_matches_cpu(results, name):
    result = _case(results, name)
    assert result["max_abs_diff"] <= ATOL
    assert result["output_spread"] > 1e-6, "a constant output cannot tell providers apart"
    assert all(shape[0] == 3 for shape in result["output_shapes"]), result["output_shapes"]
    for session in result["sessions"]:
        # The 3 samples run padded to the compiled batch of 4, unless the padding proof refused to pad
        # a batch (then the reason is that batch's verdict and the call ran at its own size).
        verdicts = [v for dim, v in session["padding"].items() if dim.endswith("batch_size")]
        expected = [3] if any(verdict.startswith("exact") for verdict in verdicts) else [4]
        assert verdicts and session["compiled_batches"] == expected, session


@pytest.mark.parametrize("name", GENERATE)
def test_generate_matches_cpu_tokens(results, name):
    result = _case(results, name)
    assert result["tokens_equal"], result["expected_tokens"]
    assert result["distinct_tokens"] >= 3, "degenerate generation cannot tell providers apart"


def test_image_to_text_steps_run_one_token_unpadded(results):
    """Pattern 3 on its family: the decoder with past declares logits ['batch_size', '1', vocab] and names
    its new tokens decoder_sequence_length beside past_sequence_length; every step runs at one token."""
    sessions = _case(results, "vit-gpt2")["sessions"]
    with_past = [
        s for s in sessions if any("past_key_values.0.key" in shapes for shapes in s["compiled_shapes"])
    ]
    assert with_past, sessions
    for session in with_past:
        assert {shapes["input_ids"][1] for shapes in session["compiled_shapes"]} == {1}


@pytest.mark.parametrize("name", DIFFUSION)
def test_diffusion_pipeline_draws_the_cpu_image(results, name):
    """The same seed and steps give the same images: text encoder, UNet (a scalar timestep input, the batch
    doubled by classifier-free guidance), VAE decoder (and encoder, from an image) on the emulator."""
    result = _case(results, name)
    assert result["max_abs_diff"] <= IMAGE_ATOL
    call, _ = diffusion_call(name)
    assert result["image_shape"] == [len(call["prompt"]), 16, 16, 3]
    assert result["image_std"] > 0.01, "a flat image cannot tell providers apart"
    inputs = {
        name for session in result["sessions"] for shapes in session["compiled_shapes"] for name in shapes
    }
    assert {"input_ids", "sample", "timestep", "latent_sample"} <= inputs  # every component ran
