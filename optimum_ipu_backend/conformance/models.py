"""The model level: one ORTModel class with the provider under test against the same class on CPU
onnxruntime in fp32, on identical seeded inputs, output by output and by the task's own measure."""

from __future__ import annotations

import hashlib
import json
import time
import traceback
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from optimum_ipu_backend.conformance.definition import InputSet, ModelEntry, Tier
from optimum_ipu_backend.conformance.providers import REFERENCE_PROVIDER, ProviderUnderTest
from optimum_ipu_backend.conformance.results import (
    ERROR,
    FAILED,
    MODEL,
    PASSED,
    CaseResult,
    OutputComparison,
    TaskMetric,
    finite,
    first_line,
)
from optimum_ipu_backend.conformance.zoo import (
    TASK_ROUTES,
    ModelZoo,
    export_onnx,
    preprocessed_inputs,
    task_of_config,
)

# How each ORTModel class is judged beyond its outputs: (metric, tier threshold field, how it is computed).
_TOP1 = "top1_agreement"
_SPAN = "span_agreement"
_EMBEDDING = "embedding_cosine"
_GENERATION = "identical_new_tokens"

_TASK_MEASURES: Mapping[str, str] = {
    "ORTModelForSequenceClassification": _TOP1,
    "ORTModelForTokenClassification": _TOP1,
    "ORTModelForMaskedLM": _TOP1,
    "ORTModelForMultipleChoice": _TOP1,
    "ORTModelForImageClassification": _TOP1,
    "ORTModelForAudioFrameClassification": _TOP1,
    "ORTModelForQuestionAnswering": _SPAN,
    "ORTModelForFeatureExtraction": _EMBEDDING,
    "ORTModelForCausalLM": _GENERATION,
    "ORTModelForSeq2SeqLM": _GENERATION,
    "ORTModelForSpeechSeq2Seq": _GENERATION,
}
# Inputs the model's generate() computes itself.
_GENERATE_DROPS = ("decoder_input_ids", "position_ids")


@dataclass(frozen=True)
class ModelCase:
    """A model to check: a matrix entry (built by the zoo) or a user's directory (``--model-dir``)."""

    case_id: str
    group: str
    task: str  # build task, e.g. "text-classification"
    entry: ModelEntry | None = None
    model_dir: Path | None = None

    @property
    def ort_class(self) -> str:
        return TASK_ROUTES[self.task].ort_class

    @classmethod
    def from_entry(cls, entry: ModelEntry) -> ModelCase:
        return cls(entry.case_id, entry.case_id.removeprefix("model/"), entry.task, entry=entry)

    @classmethod
    def from_directory(cls, path: str | Path) -> ModelCase:
        """A user's exported (``*.onnx``) or transformers model directory; the task comes from its config."""
        model_dir = Path(path).expanduser().resolve()
        config_file = model_dir / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(
                f"--model-dir {path}: no config.json there; give a transformers model directory or an "
                "optimum export (ORTModel.save_pretrained keeps config.json beside the .onnx files)"
            )
        task = task_of_config(json.loads(config_file.read_text(encoding="utf-8")))
        if task not in TASK_ROUTES:
            raise ValueError(f"--model-dir {path}: task {task!r} has no ORTModel class the suite checks")
        return cls(f"model-dir/{model_dir.name}", model_dir.name, task, model_dir=model_dir)

    def onnx_dir(self, zoo: ModelZoo, work_dir: Path) -> Path:
        """The exported model: built and exported by the zoo, the user's export, or exported once here."""
        if self.entry is not None:
            entry = self.entry
            if entry.optimization:
                return zoo.optimized(entry.architecture, entry.export_task, entry.optimization)
            return zoo.onnx(entry.architecture, entry.export_task)
        assert self.model_dir is not None
        if any(self.model_dir.glob("*.onnx")):
            return self.model_dir
        # Keyed by the directory's path and its files' sizes and times, so an edited model is exported again.
        stamp = hashlib.sha256(str(self.model_dir).encode())
        for file in sorted(p for p in self.model_dir.rglob("*") if p.is_file()):
            stat = file.stat()
            stamp.update(f"{file.relative_to(self.model_dir)}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        out_dir = work_dir / "model-dirs" / f"{self.model_dir.name}-{stamp.hexdigest()[:12]}"
        return export_onnx(self.model_dir, TASK_ROUTES[self.task].export_task, out_dir)


# ------------------------------------------------------------------------------------------------
# Measures
# ------------------------------------------------------------------------------------------------


def _float_outputs(outputs: Any) -> dict[str, np.ndarray]:
    """The float tensors of a ModelOutput by field name (caches are checked through generation)."""
    import torch

    return {
        key: value.detach().float().numpy()
        for key, value in outputs.items()
        if isinstance(value, torch.Tensor) and value.is_floating_point()
    }


def _real_positions(array: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """The elements at positions the attention mask marks real; padding positions carry no meaning."""
    if mask is None or array.shape[: mask.ndim] != mask.shape:
        return array.reshape(-1)
    return array[mask.astype(bool)].reshape(-1)


def compare_output(
    input_set: str, name: str, reference: np.ndarray, actual: np.ndarray, mask: np.ndarray | None, tier: Tier
) -> tuple[OutputComparison, str | None]:
    """Error figures of one output, and the failure line when the tier's tolerance does not hold."""
    if reference.shape != actual.shape:
        comparison = OutputComparison(input_set, name, list(actual.shape), 0, None, None, None, False)
        return (
            comparison,
            f"output {name} on input set {input_set}: shape {actual.shape} != CPU's {reference.shape}",
        )
    ref = _real_positions(reference, mask).astype(np.float64)
    got = _real_positions(actual, mask).astype(np.float64)
    with np.errstate(all="ignore"):
        diff = np.abs(got - ref)
        nonzero = ref != 0
        max_abs = float(diff.max()) if diff.size else 0.0
        max_rel = float((diff[nonzero] / np.abs(ref[nonzero])).max()) if nonzero.any() else 0.0
        norms = float(np.linalg.norm(ref) * np.linalg.norm(got))
        if np.array_equal(ref, got):
            cosine = 1.0  # exactly, not whatever rounding of the norms gives
        else:
            cosine = float(np.dot(ref, got) / norms) if norms else 0.0
    within = None
    failure = None
    if tier.atol is not None:
        allowed = tier.atol + tier.rtol * np.abs(ref)
        outside = ~(diff <= allowed)  # NaN counts as outside
        within = not outside.any()
        if not within:
            failure = (
                f"output {name} on input set {input_set}: max abs error {max_abs:.3g} "
                f"(allowed {tier.atol:g} + {tier.rtol:g} x |cpu|), {int(outside.sum())} of {diff.size} "
                f"elements outside, max rel error {max_rel:.3g}, cosine {cosine:.9f}"
            )
    comparison = OutputComparison(
        input_set=input_set,
        output=name,
        shape=list(actual.shape),
        compared=int(diff.size),
        max_abs=finite(max_abs),
        max_rel=finite(max_rel),
        cosine=finite(cosine),
        within_tolerance=within,
    )
    return comparison, failure


def _agreement(reference: np.ndarray, actual: np.ndarray) -> float:
    return float(np.mean(reference == actual)) if reference.size else 1.0


def _masked_argmax(logits: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """Arg-max over the last axis of (batch, seq) span logits, among real positions only."""
    if mask is not None and logits.shape == mask.shape:
        logits = np.where(mask.astype(bool), logits, -np.inf)
    return logits.argmax(axis=-1)


def _mean_pooled(hidden: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    if mask is None or hidden.shape[:2] != mask.shape:
        return hidden.reshape(hidden.shape[0], -1)
    weights = mask.astype(np.float64)[..., None]
    return (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1.0)


def task_measures(
    ort_class: str,
    reference: Mapping[str, np.ndarray],
    actual: Mapping[str, np.ndarray],
    mask: np.ndarray | None,
) -> dict[str, float]:
    """The task's own figures for one forward call (generation is measured separately)."""
    measure = _TASK_MEASURES[ort_class]
    if measure == _TOP1 or (measure == _GENERATION and "logits" in reference):
        ref_top = reference["logits"].argmax(axis=-1)
        got_top = actual["logits"].argmax(axis=-1)
        if mask is not None and ref_top.shape == mask.shape:
            keep = mask.astype(bool)
            ref_top, got_top = ref_top[keep], got_top[keep]
        return {_TOP1: _agreement(ref_top, got_top)}
    if measure == _SPAN:
        return {
            f"{side}_agreement": _agreement(
                _masked_argmax(reference[f"{side}_logits"], mask),
                _masked_argmax(actual[f"{side}_logits"], mask),
            )
            for side in ("start", "end")
        }
    if measure == _EMBEDDING:
        ref = _mean_pooled(reference["last_hidden_state"].astype(np.float64), mask)
        got = _mean_pooled(actual["last_hidden_state"].astype(np.float64), mask)
        norms = np.linalg.norm(ref, axis=-1) * np.linalg.norm(got, axis=-1)
        cosines = np.where(norms > 0, (ref * got).sum(axis=-1) / np.where(norms > 0, norms, 1.0), 1.0)
        return {_EMBEDDING: float(cosines.min())}
    return {}


def _threshold(tier: Tier, metric: str, ort_class: str) -> float | None:
    """The tier's threshold for a figure; teacher-forced top-1 of generative models is reported only."""
    if metric in ("start_agreement", "end_agreement"):
        return tier.span_agreement
    if metric == _TOP1 and _TASK_MEASURES[ort_class] == _GENERATION:
        return None
    return getattr(tier, metric, None)


def _metric(input_set: str, metric: str, value: float, threshold: float | None) -> TaskMetric:
    value = finite(value)
    passed = None if threshold is None else (value is not None and value >= threshold)
    return TaskMetric(input_set, metric, value, threshold, passed)


# ------------------------------------------------------------------------------------------------
# Running one case
# ------------------------------------------------------------------------------------------------


def run_model_case(
    case: ModelCase,
    onnx_dir: Path,
    provider: ProviderUnderTest,
    tier: Tier,
    input_sets: Sequence[InputSet],
    generation_inputs: InputSet,
) -> CaseResult:
    """Check one model; the result's status is PASSED, FAILED or ERROR (expectations are applied later)."""
    started = time.perf_counter()
    check = _ModelCheck(case, onnx_dir, provider, tier)
    result = check.result
    try:
        check.run(input_sets, generation_inputs)
    except Exception as exc:  # the provider's (or the reference's) error is the finding
        result.status = ERROR
        result.message = f"{case.case_id}: {check.phase} raised {type(exc).__name__}: {first_line(exc)}"
        result.detail = traceback.format_exc()
    else:
        if result.failures:
            result.status = FAILED
            more = len(result.failures) - 1
            result.message = f"{case.case_id}: {result.failures[0]}" + (f" (and {more} more)" if more else "")
            result.detail = "\n".join(result.failures)
    result.duration_s = round(time.perf_counter() - started, 3)
    return result


def _torch(inputs: Mapping[str, np.ndarray], drop: Sequence[str] = ()) -> dict[str, Any]:
    import torch

    return {key: torch.from_numpy(value) for key, value in inputs.items() if key not in drop}


class _ModelCheck:
    """One model case in progress; ``phase`` names what was being done, for an error's message."""

    def __init__(self, case: ModelCase, onnx_dir: Path, provider: ProviderUnderTest, tier: Tier) -> None:
        self.case, self.onnx_dir, self.provider, self.tier = case, onnx_dir, provider, tier
        self.phase = "starting"
        self.result = CaseResult(
            case_id=case.case_id,
            level=MODEL,
            group=case.group,
            status=PASSED,
            info={
                "ort_class": case.ort_class,
                "task": case.task,
                "onnx_dir": str(onnx_dir),
                "tier": tier.name,
            },
        )

    def run(self, input_sets: Sequence[InputSet], generation_inputs: InputSet) -> None:
        import optimum.onnxruntime

        case = self.case
        model_class = getattr(optimum.onnxruntime, case.ort_class)
        self.phase = f"loading {case.ort_class} on {REFERENCE_PROVIDER} (the reference)"
        reference = model_class.from_pretrained(
            self.onnx_dir, provider=REFERENCE_PROVIDER, local_files_only=True
        )
        self.phase = f"loading {case.ort_class} on {self.provider.name}"
        candidate = model_class.from_pretrained(
            self.onnx_dir, local_files_only=True, **self.provider.ortmodel_kwargs()
        )
        for input_set in input_sets:
            self._forward(reference, candidate, input_set)
        if _TASK_MEASURES[case.ort_class] == _GENERATION:
            self._generation(reference, candidate, generation_inputs)

    def _inputs(self, input_set: InputSet) -> dict[str, np.ndarray]:
        self.phase = f"preparing input set {input_set.label}"
        return preprocessed_inputs(self.onnx_dir, input_set.batch, input_set.sequence_length, input_set.seed)

    def _forward(self, reference: Any, candidate: Any, input_set: InputSet) -> None:
        import torch

        result, tier, label = self.result, self.tier, input_set.label
        inputs = self._inputs(input_set)
        mask = inputs.get("attention_mask")
        outputs = {}
        for name, model in ((REFERENCE_PROVIDER, reference), (self.provider.name, candidate)):
            self.phase = f"running input set {label} on {name}"
            with torch.no_grad():
                outputs[name] = _float_outputs(model(**_torch(inputs)))
        expected, actual = outputs[REFERENCE_PROVIDER], outputs[self.provider.name]
        missing = sorted(set(expected) - set(actual))
        if missing:
            result.failures.append(
                f"outputs {missing} on input set {label}: missing from the provider's results"
            )
        for name in sorted(set(expected) & set(actual)):
            comparison, failure = compare_output(label, name, expected[name], actual[name], mask, tier)
            result.outputs.append(comparison)
            if failure:
                result.failures.append(failure)
        if missing:
            return
        for metric, value in task_measures(self.case.ort_class, expected, actual, mask).items():
            entry = _metric(label, metric, value, _threshold(tier, metric, self.case.ort_class))
            result.metrics.append(entry)
            if entry.passed is False:
                result.failures.append(
                    f"{metric} on input set {label}: {entry.value} < {entry.threshold} "
                    f"required by tier {tier.name}"
                )

    def _generation(self, reference: Any, candidate: Any, generation_inputs: InputSet) -> None:
        new_tokens = self.tier.identical_new_tokens
        label = f"generate-{generation_inputs.label}"
        prompt = _torch(self._inputs(generation_inputs), drop=_GENERATE_DROPS)
        settings = {
            "max_new_tokens": new_tokens,
            "min_new_tokens": new_tokens,
            "do_sample": False,
            "num_beams": 1,
        }
        tokens = []
        for name, model in ((REFERENCE_PROVIDER, reference), (self.provider.name, candidate)):
            self.phase = f"greedy generation on {name}"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # generation-config notes, the same for both sides
                tokens.append(model.generate(**prompt, **settings)[:, -new_tokens:].numpy())
        expected, actual = tokens
        same = expected == actual
        # Per row, how many tokens agree before the first difference; the case's figure is the worst row.
        prefix = [int(np.argmin(row)) if not row.all() else len(row) for row in same]
        entry = _metric(label, _GENERATION, min(prefix), float(new_tokens))
        self.result.metrics.append(entry)
        self.result.info["generation"] = {"reference": expected.tolist(), "provider": actual.tolist()}
        if not entry.passed:
            row = prefix.index(min(prefix))
            self.result.failures.append(
                f"greedy generation ({label}): row {row} differs from CPU at new token {min(prefix)} of "
                f"{new_tokens} ({actual[row].tolist()} vs CPU {expected[row].tolist()})"
            )
