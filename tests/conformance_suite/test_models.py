"""The model level's measures: element-wise errors at real positions, the tiers' thresholds, the task
measures, and model directories given by the user."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from optimum_ipu_backend.conformance.definition import load_tiers
from optimum_ipu_backend.conformance.models import ModelCase, compare_output, task_measures

TIERS = load_tiers()
FP32, FP16 = TIERS["fp32"], TIERS["fp16"]


def test_fp32_tolerance_is_atol_plus_rtol_times_the_cpu_value() -> None:
    reference = np.array([[0.0, 2.0, -4.0]], dtype=np.float32)
    allowed = 1e-4 + 1e-4 * np.abs(reference.astype(np.float64))
    inside, failure = compare_output("b1-s3", "logits", reference, reference + 0.99 * allowed, None, FP32)
    assert failure is None and inside.within_tolerance is True
    assert inside.max_abs == pytest.approx(0.99 * 5e-4, rel=1e-3)
    outside, failure = compare_output("b1-s3", "logits", reference, reference + 1.5 * allowed, None, FP32)
    assert outside.within_tolerance is False
    assert failure.startswith("output logits on input set b1-s3: max abs error 0.00075")
    assert "3 of 3 elements outside" in failure


def test_padding_positions_are_left_out_and_real_ones_are_not() -> None:
    mask = np.array([[1, 1, 0], [1, 0, 0]])
    reference = np.zeros((2, 3, 4), dtype=np.float32)
    garbage_in_padding = reference.copy()
    garbage_in_padding[0, 2] = 7.0  # a masked position: carries no meaning
    comparison, failure = compare_output("s", "last_hidden_state", reference, garbage_in_padding, mask, FP32)
    assert failure is None and comparison.compared == 3 * 4
    wrong_real = reference.copy()
    wrong_real[1, 0, 3] = 1e-3  # a real position of the padded row
    _, failure = compare_output("s", "last_hidden_state", reference, wrong_real, mask, FP32)
    assert failure is not None and "max abs error 0.001" in failure


def test_nan_and_shape_mismatch_fail_and_serialise() -> None:
    reference = np.ones((2, 2), dtype=np.float32)
    comparison, failure = compare_output(
        "s", "logits", reference, np.full_like(reference, np.nan), None, FP32
    )
    assert failure is not None and comparison.max_abs is None and comparison.within_tolerance is False
    comparison, failure = compare_output("s", "logits", reference, np.ones((2, 3), np.float32), None, FP32)
    assert "shape (2, 3) != CPU's (2, 2)" in failure and comparison.within_tolerance is False


def test_fp16_tier_judges_task_measures_not_elements() -> None:
    reference = np.array([[1.0, 2.0]], dtype=np.float32)
    comparison, failure = compare_output("s", "logits", reference, reference + 0.5, None, FP16)
    assert failure is None and comparison.within_tolerance is None and comparison.max_abs == 0.5


def test_task_measures() -> None:
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    logits = np.zeros((2, 4, 5))
    logits[..., 1] = 1.0
    flipped = logits.copy()
    flipped[0, 0, 2] = 2.0  # one real position of five changes its top-1 class
    flipped[1, 3, 4] = 9.0  # a padded position does not count
    agreement = task_measures("ORTModelForTokenClassification", {"logits": logits}, {"logits": flipped}, mask)
    assert agreement == {"top1_agreement": pytest.approx(4 / 5)}

    start = np.array([[0.0, 3.0, 1.0, 9.0], [2.0, 0.0, 0.0, 9.0]])  # the 9s sit at padded positions
    spans = task_measures(
        "ORTModelForQuestionAnswering",
        {"start_logits": start, "end_logits": start},
        {"start_logits": start, "end_logits": start[:, [1, 0, 2, 3]]},
        mask,
    )
    assert spans == {"start_agreement": 1.0, "end_agreement": 0.0}

    hidden = np.random.default_rng(0).standard_normal((2, 4, 8))
    other = hidden.copy()
    other[0, 3] = 100.0  # padding: ignored by mean pooling over real tokens
    same = task_measures(
        "ORTModelForFeatureExtraction", {"last_hidden_state": hidden}, {"last_hidden_state": other}, mask
    )
    assert same["embedding_cosine"] == pytest.approx(1.0)
    other[1, 0] *= -1
    assert (
        task_measures(
            "ORTModelForFeatureExtraction", {"last_hidden_state": hidden}, {"last_hidden_state": other}, mask
        )["embedding_cosine"]
        < 0.999
    )


def test_model_directories_take_their_task_from_the_config(tmp_path: Path) -> None:
    (tmp_path / "qa").mkdir()
    (tmp_path / "qa" / "config.json").write_text(
        json.dumps({"architectures": ["DistilBertForQuestionAnswering"]})
    )
    case = ModelCase.from_directory(tmp_path / "qa")
    assert (case.case_id, case.task, case.ort_class) == (
        "model-dir/qa",
        "question-answering",
        "ORTModelForQuestionAnswering",
    )
    (tmp_path / "speech").mkdir()
    (tmp_path / "speech" / "config.json").write_text(
        json.dumps({"architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper"})
    )
    assert ModelCase.from_directory(tmp_path / "speech").ort_class == "ORTModelForSpeechSeq2Seq"
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelCase.from_directory(tmp_path)
