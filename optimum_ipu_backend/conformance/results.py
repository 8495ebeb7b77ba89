"""What one conformance case found, in the shape every report is written from."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

PASSED = "passed"
FAILED = "failed"  # a check did not hold
ERROR = "error"  # the provider (or the reference) raised
XFAIL = "xfail"  # listed as a known failure, and it did not pass
XPASS = "xpass"  # listed as a known failure, but it passed: the entry can go
NOT_APPLICABLE = "not_applicable"  # outside what the provider declares it takes (element types, listed cases)
OUT_OF_TABLE = "out_of_table"  # uses an operator the provider does not declare

STATUSES = (PASSED, FAILED, ERROR, XFAIL, XPASS, NOT_APPLICABLE, OUT_OF_TABLE)
#: Statuses that make a run fail.
FAILING = frozenset({FAILED, ERROR})

MODEL = "model"
ONNX_MODEL = "onnx_model"  # the model cases the onnx wheel ships
OPERATOR = "operator"
#: The levels, in the order the reports list them.
LEVELS = (MODEL, ONNX_MODEL, OPERATOR)
#: What each level's case ids start with.
CASE_PREFIXES = {MODEL: ("model/", "model-dir/"), ONNX_MODEL: ("onnx-model/",), OPERATOR: ("op/",)}

#: What an operator or ONNX model case is judged against where CPU onnxruntime cannot run it.
REFERENCE = "ONNX's reference outputs"


@dataclass
class OutputComparison:
    """One output of one input set, provider against CPU."""

    input_set: str
    output: str
    shape: list[int]
    compared: int  # elements compared (positions an attention mask hides are left out)
    max_abs: float | None  # None: not finite (NaN or infinity on either side)
    max_rel: float | None  # over elements whose CPU value is not zero
    cosine: float | None
    within_tolerance: bool | None  # None when the tier sets no element-wise tolerance


@dataclass
class TaskMetric:
    """One task-level figure (top-1 agreement, span agreement, embedding cosine, identical tokens)."""

    input_set: str
    metric: str
    value: float | None
    threshold: float | None  # None: reported only, this tier does not judge it
    passed: bool | None


@dataclass
class CaseResult:
    case_id: str
    level: str  # one of LEVELS
    # the model entry (model level), the kind (ONNX-model level) or the operator under test (operator level)
    group: str
    status: str
    message: str = ""  # one line: for a failure, the case, the output and the error
    detail: str = ""  # longer text: every failed check, or the traceback
    duration_s: float = 0.0
    expectation: dict[str, str] | None = None  # the expectation entry that matched: kind, reason, source
    failures: list[str] = field(default_factory=list)  # one line per failed check
    outputs: list[OutputComparison] = field(default_factory=list)
    metrics: list[TaskMetric] = field(default_factory=list)
    # Level-specific facts (ORTModel class, bound operands).
    info: dict[str, Any] = field(default_factory=dict)
    # Operator and ONNX-model levels: what the provider was judged against (CPUExecutionProvider, or
    # REFERENCE where CPU cannot run the case), and the CPU column: CPU against ONNX's reference outputs
    # (status agrees, differs or raises; its message and errors). None where the provider is CPU itself
    # or the case did not run.
    oracle: str | None = None
    cpu: dict[str, Any] | None = None

    @property
    def is_failing(self) -> bool:
        return self.status in FAILING

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> CaseResult:
        raw = json.loads(text)
        raw["outputs"] = [OutputComparison(**item) for item in raw.get("outputs", [])]
        raw["metrics"] = [TaskMetric(**item) for item in raw.get("metrics", [])]
        return cls(**raw)


def level_of(case_id: str) -> str:
    """The level a case id belongs to, by its prefix (the operator level for an id of none)."""
    return next((level for level in LEVELS if case_id.startswith(CASE_PREFIXES[level])), OPERATOR)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def finite(value: float) -> float | None:
    """A figure as JSON can hold it: NaN and infinity become None (and fail every threshold)."""
    value = float(value)
    return value if math.isfinite(value) else None
