"""Architectures whose graphs defeat padding decided from input names, each with its ORTModel class and
provider="ipu" on the host emulator against CPUExecutionProvider: outputs within atol 1e-5, generated
tokens identical, and the padding verdict of each dimension is the one the graph calls for.

One model per pattern (``PATTERN_TASKS``): a convolution along the sequence (ConvBERT; wav2vec2's
feature encoder, padded through a generated frame mask), positions from a cumulative sum with a cache
(M2M100), local attention built with Pad and written with Einsum (LongT5), rotary embeddings written
with Einsum (ESM) and top-k experts selected by NonZero (Qwen3-MoE). Like test_ortmodels.py, the checks
run in a fresh interpreter of the installed environment (ortmodel_checks.py); this process builds the
models and applies the tolerances.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from full_matrix import FULL
from subprocess_env import python

from optimum_ipu_backend.conformance.zoo import PATTERN_TASKS

ATOL = 1e-5
PADDED = "padded (proven)"

#: New tokens per generation: 8 by default, 16 in the release check. Where the proof keeps the past exact
#: (M2M100's positions, Qwen3-MoE's experts) each step compiles its own executable.
GENERATED_TOKENS = 16 if FULL else 8
CASES = {case.model: (class_name, case.task) for class_name, cases in PATTERN_TASKS.items() for case in cases}


@pytest.fixture(scope="module")
def results(tmp_path_factory, zoo) -> dict:
    cases = {
        model: {
            "kind": "generate" if "generation" in task else "forward",
            "class": class_name,
            "model": model,
            "model_dir": str(zoo.model(model, task)),
            "onnx_dir": str(zoo.onnx(model, task)),
            "new_tokens": GENERATED_TOKENS,
        }
        for model, (class_name, task) in CASES.items()
    }
    spec = tmp_path_factory.mktemp("patterns") / "cases.json"
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
    assert result["provider"] == "IPUExecutionProvider"
    assert result["sessions"] and all(s["type"] == "IPUInferenceSession" for s in result["sessions"])
    assert result["fallback_warnings"] == []
    return result


def _verdicts(result: dict, dim: str) -> list[str]:
    """The verdicts of ``dim`` in every session that has it."""
    return [s["padding"][dim] for s in result["sessions"] if dim in s["padding"]]


def _matches_cpu(result: dict) -> None:
    if "tokens_equal" in result:
        assert result["tokens_equal"], result["expected_tokens"]
        assert result["distinct_tokens"] >= 3, "degenerate generation cannot tell providers apart"
    else:
        assert result["max_abs_diff"] <= ATOL


def test_sequence_convolution_is_compiled_at_exact_lengths(results):
    """ConvBERT's span convolution reads neighbouring tokens without the mask: 11 tokens are never padded."""
    result = _case(results, "convbert")
    _matches_cpu(result)
    (verdict,) = _verdicts(result, "sequence_length")
    assert verdict.startswith("exact sizes:") and "node '/convbert/encoder/layer.0/" in verdict, verdict
    assert _verdicts(result, "batch_size") == [PADDED]
    assert [shapes["input_ids"] for shapes in result["sessions"][0]["compiled_shapes"]] == [[4, 11]]


def test_cumulative_sum_positions_with_a_cache_compile_the_past_exactly(results):
    """M2M100 counts decoder positions from the past's length: the past is not padded, the rest is."""
    result = _case(results, "m2m100")
    _matches_cpu(result)
    (past,) = _verdicts(result, "past_decoder_sequence_length")
    assert past.startswith("exact sizes:") and "embed_positions" in past, past
    assert set(_verdicts(result, "encoder_sequence_length")) == {PADDED}


def test_local_attention_compiles_the_encoder_exactly_and_pads_the_decoder(results):
    """LongT5's local attention pads blocks of tokens itself (Pad) and multiplies them with Einsum."""
    result = _case(results, "longt5")
    _matches_cpu(result)
    encoder, *_ = _verdicts(result, "encoder_sequence_length")
    assert encoder.startswith("exact sizes:") and "LocalSelfAttention/Pad" in encoder, encoder
    assert set(_verdicts(result, "past_decoder_sequence_length")) == {PADDED}


def test_einsum_rotary_encoder_is_padded_with_proof(results):
    result = _case(results, "esm")
    _matches_cpu(result)
    assert _verdicts(result, "sequence_length") == [PADDED]
    assert [shapes["input_ids"] for shapes in result["sessions"][0]["compiled_shapes"]] == [[4, 12]]


def test_audio_frames_are_cut_by_dataflow(results):
    """wav2vec2 names the frame axis of its logits like the sample axis of its input; the two are unrelated
    sizes. Its feature encoder normalises per frame (feat_extract_norm="layer"), so with the generated
    frame mask (compiler/graph_rewrites/audio_frame_mask.py) the samples are padded to the audio plan's
    first size, one second, and the logits are cut to the frames the caller's samples yield."""
    result = _case(results, "wav2vec2")
    _matches_cpu(result)
    (verdict,) = _verdicts(result, "sequence_length")
    assert verdict == PADDED, verdict
    # 3 waveforms of 220 samples run as one micro-batch of 4 at 16,000 samples (1 s at 16 kHz)
    assert [shapes["input_values"] for shapes in result["sessions"][0]["compiled_shapes"]] == [[4, 16000]]


def test_top_k_experts_run_densely(results):
    result = _case(results, "qwen3_moe")
    _matches_cpu(result)
    (notes,) = {tuple(s["graph_notes"]) for s in result["sessions"]}
    assert any(
        "computed densely" in note and "2x the expert compute of top-2 routing" in note for note in notes
    )
