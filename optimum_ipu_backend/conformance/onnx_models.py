"""The ONNX-model level: the model cases the onnx wheel ships (``onnx/backend/test/data``), each run
through the provider's whole session path and judged like a node case (``judging.judge``): against CPU
onnxruntime's outputs for the same data where CPU runs the model, else against ONNX's stored outputs.

Four kinds, read in onnx's own formats (``onnx.backend.test.loader`` and ``runner``):

* ``simple``, ``pytorch-converted``, ``pytorch-operator``: a directory with ``model.onnx`` and
  ``test_data_set_N/input_N.pb``, ``output_N.pb``; tolerances from its ``data.json`` when present, else
  ONNX's rtol 1e-3, atol 1e-7.
* ``light``: ``light_X.onnx`` and ``light_X_output_0.pb`` (outputs of ONNX's reference evaluator), fed
  with the runner's deterministic input (``generate_dummy_data(random=False)``); its tolerances are
  those of the ``real/test_X/data.json`` entry whose url names the light file (densenet121: rtol 2e-3),
  exactly as ONNX's runner applies them. ``real`` itself holds only download URLs: skipped (no network).
"""

from __future__ import annotations

import fnmatch
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from optimum_ipu_backend.conformance.definition import DefinitionError, Tier
from optimum_ipu_backend.conformance.judging import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    Outcome,
    Subject,
    graph_operators,
    judge,
    raised,
    read_value,
    value_kinds,
)
from optimum_ipu_backend.conformance.providers import ProviderUnderTest
from optimum_ipu_backend.conformance.results import ONNX_MODEL, PASSED, CaseResult

LIGHT = "light"
#: The kinds of model case the onnx wheel ships with their data, in the order the reports list them.
KINDS = ("simple", "pytorch-converted", "pytorch-operator", LIGHT)
CASE_PREFIX = "onnx-model/"
_LIGHT_SUFFIX = "_output_{index}.pb"


def data_dir() -> Path:
    """``onnx/backend/test/data`` of the installed onnx package."""
    from onnx.backend.test.loader import DATA_DIR

    return Path(DATA_DIR)


@dataclass(frozen=True)
class OnnxModelCase:
    """One model case of the onnx wheel."""

    kind: str
    name: str  # the directory's name, or a light model's file name without .onnx
    path: str  # the case directory, or the light model's .onnx file
    rtol: float
    atol: float

    @property
    def case_id(self) -> str:
        return f"{CASE_PREFIX}{self.kind}/{self.name}"

    @cached_property
    def model(self) -> Any:
        import onnx

        model_file = Path(self.path) if self.kind == LIGHT else Path(self.path) / "model.onnx"
        return onnx.load(model_file, load_external_data=False)

    @cached_property
    def operators(self) -> tuple[tuple[str, str], ...]:
        return tuple(sorted(graph_operators(self.model.graph)))

    @cached_property
    def element_types(self) -> tuple[str, ...]:
        return tuple(sorted(value_kinds(self.model)[0]))

    @cached_property
    def non_tensor(self) -> tuple[str, ...]:
        return tuple(value_kinds(self.model)[1])


def _tolerances(raw: dict[str, Any]) -> tuple[float, float]:
    return float(raw.get("rtol", DEFAULT_RTOL)), float(raw.get("atol", DEFAULT_ATOL))


def _light_tolerances(root: Path) -> dict[str, tuple[float, float]]:
    """The tolerances ONNX's runner judges each light model with: its ``real`` entry's, by url."""
    found = {}
    for entry in sorted((root / "real").glob("*/data.json")):
        raw = json.loads(entry.read_text(encoding="utf-8"))
        url = str(raw.get("url", ""))
        if url.startswith(f"onnx/backend/test/data/{LIGHT}/"):
            found[Path(url).stem] = _tolerances(raw)
    return found


def discover(root: Path | None = None) -> list[OnnxModelCase]:
    """Every model case of the four kinds, from the directory listing (no model is loaded)."""
    root = data_dir() if root is None else Path(root)
    cases = []
    for kind in KINDS[:-1]:
        for directory in sorted((root / kind).iterdir()):
            if not (directory / "model.onnx").is_file():
                continue  # onnx's own __init__.py and the like
            raw = {}
            if (directory / "data.json").is_file():
                raw = json.loads((directory / "data.json").read_text(encoding="utf-8"))
            cases.append(OnnxModelCase(kind, directory.name, str(directory), *_tolerances(raw)))
    light = _light_tolerances(root)
    for model_file in sorted((root / LIGHT).glob("*.onnx")):
        rtol, atol = light.get(model_file.stem, (DEFAULT_RTOL, DEFAULT_ATOL))
        cases.append(OnnxModelCase(LIGHT, model_file.stem, str(model_file), rtol, atol))
    return cases


def select(cases: Sequence[OnnxModelCase], quick: bool, names: Sequence[str] | None) -> list[OnnxModelCase]:
    """The cases to run: ``names`` win over ``quick`` (which runs none); ``all``, ``none``, a kind, or a glob
    over ``<kind>/<name>`` (``pytorch-operator/test_operator_add*``), with or without ``onnx-model/``;
    comma-separated values are split."""
    chosen = [name for part in names or () for name in part.split(",") if name]
    if chosen == ["none"]:
        return []
    if chosen == ["all"] or (not chosen and not quick):
        return list(cases)
    if not chosen:
        return []
    patterns = []
    for name in chosen:
        name = name.removeprefix(CASE_PREFIX)
        patterns.append(f"{CASE_PREFIX}{name}/*" if name in KINDS else f"{CASE_PREFIX}{name}")
    selected = [case for case in cases if any(fnmatch.fnmatchcase(case.case_id, p) for p in patterns)]
    if not selected:
        raise DefinitionError(
            f"--onnx-models {chosen} matches no ONNX model case; give all, none, a kind "
            f"({', '.join(KINDS)}) or a glob over <kind>/<name>"
        )
    return selected


def dummy_input(value_info: Any) -> np.ndarray:
    """ONNX's runner's deterministic input for a light model (``generate_dummy_data(random=False)``):
    ``arange(n) / n`` in float32, unknown dimensions 1; like ONNX's runner, float inputs only."""
    tensor_type = value_info.type.tensor_type
    if not value_info.type.HasField("tensor_type") or tensor_type.elem_type != 1:  # 1: FLOAT
        raise NotImplementedError(f"input {value_info.name!r}: ONNX's runner generates float tensors only")
    shape = tuple(dim.dim_value if dim.HasField("dim_value") else 1 for dim in tensor_type.shape.dim)
    count = int(np.prod(shape))
    return (np.arange(count).reshape(shape) / count).astype(np.float32)


def load_data_sets(case: OnnxModelCase) -> list[tuple[dict[str, Any], list[Any]]]:
    """The case's data sets: (feed by input name, ONNX's stored outputs)."""
    graph = case.model.graph
    if case.kind == LIGHT:
        initialised = {tensor.name for tensor in graph.initializer}
        feed = {value.name: dummy_input(value) for value in graph.input if value.name not in initialised}
        stem = Path(case.path).with_suffix("")
        outputs = []
        for index, info in enumerate(graph.output):
            stored = Path(f"{stem}{_LIGHT_SUFFIX.format(index=index)}")
            if not stored.is_file():
                raise FileNotFoundError(f"{stored}: the light model's stored output {index} is missing")
            outputs.append(read_value(stored.read_bytes(), info))
        return [(feed, outputs)]
    data_sets = []
    for data in sorted(Path(case.path).glob("test_data_set_*")):
        # As ONNX's runner does: input_N.pb is the N-th graph input, output_N.pb the N-th output.
        feed = {
            info.name: read_value((data / f"input_{index}.pb").read_bytes(), info)
            for index, info in enumerate(graph.input)
            if (data / f"input_{index}.pb").is_file()
        }
        outputs = [
            read_value((data / f"output_{index}.pb").read_bytes(), info)
            for index, info in enumerate(graph.output)
            if (data / f"output_{index}.pb").is_file()
        ]
        data_sets.append((feed, outputs))
    return data_sets


def run_onnx_model_case(
    case: OnnxModelCase, provider: ProviderUnderTest, tier: Tier | None = None
) -> CaseResult:
    """Run one applicable ONNX model case through the provider and judge it (``judging.judge``). The status
    is PASSED, FAILED, ERROR or NOT_APPLICABLE."""
    started = time.perf_counter()
    result = CaseResult(case_id=case.case_id, level=ONNX_MODEL, group=case.kind, status=PASSED)
    rtol, atol = (case.rtol, case.atol) if tier is None else tier.operator_tolerance(case.rtol, case.atol)
    subject = Subject(label=case.case_id, stem=case.name)
    try:
        data_sets = load_data_sets(case)
    except Exception as exc:
        result.info["tolerance"] = {"rtol": rtol, "atol": atol}
        return raised(result, subject.label, Outcome(error=exc, phase="loading the case"), started)
    return judge(subject, result, case.model, data_sets, provider, rtol, atol, started)
