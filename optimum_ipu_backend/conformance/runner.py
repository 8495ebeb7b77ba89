"""One conformance run: the settings, the plan of cases, running a case, and the expectations applied to
what it found. The pytest plugin drives it, for ``pytest conformance/`` and ``optimum-ipu conformance``
alike, so both run the same cases."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optimum_ipu_backend.config import parse_assignments
from optimum_ipu_backend.conformance import onnx_models
from optimum_ipu_backend.conformance.definition import (
    ModelMatrix,
    OperatorSelection,
    Tier,
    load_models,
    load_operators,
    load_tiers,
    removal_command,
)
from optimum_ipu_backend.conformance.judging import static_status
from optimum_ipu_backend.conformance.models import ModelCase, run_model_case
from optimum_ipu_backend.conformance.onnx_models import OnnxModelCase, run_onnx_model_case
from optimum_ipu_backend.conformance.operators import (
    NodeCase,
    NodeCaseStore,
    run_operator_case,
    select_cases,
)
from optimum_ipu_backend.conformance.providers import (
    ProviderUnderTest,
    resolve_provider,
)
from optimum_ipu_backend.conformance.results import (
    ERROR,
    FAILED,
    MODEL,
    NOT_APPLICABLE,
    ONNX_MODEL,
    OPERATOR,
    PASSED,
    XFAIL,
    XPASS,
    CaseResult,
)
from optimum_ipu_backend.runtime.cache_files import CONFORMANCE_DIR
from optimum_ipu_backend.runtime.executable_cache import resolve_cache_root

WORK_DIR_ENV = "OPTIMUM_IPU_CONFORMANCE_DIR"


def default_work_dir() -> Path:
    """Built models, exports and generated node cases are kept here between runs: in
    ``$OPTIMUM_IPU_CONFORMANCE_DIR``, else in the cache root's ``conformance/``, which ``optimum-ipu
    cache`` reports and clears with the rest."""
    explicit = os.environ.get(WORK_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    return resolve_cache_root()[0] / CONFORMANCE_DIR


@dataclass(frozen=True)
class RunSettings:
    """What the command line (or pytest's options) asked for."""

    provider: str
    provider_options: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    model_dirs: tuple[str, ...] = ()
    ops: tuple[str, ...] = ()
    onnx_models: tuple[str, ...] = ()
    quick: bool = False
    tier: str = "fp32"
    report_dir: str | None = None
    work_dir: str | None = None
    expectations: tuple[str, ...] = ()

    def work_path(self) -> Path:
        return Path(self.work_dir).expanduser() if self.work_dir else default_work_dir()

    def describe(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "provider_options": list(self.provider_options),
            "models": list(self.models),
            "model_dirs": list(self.model_dirs),
            "ops": list(self.ops),
            "onnx_models": list(self.onnx_models),
            "quick": self.quick,
            "tier": self.tier,
            "expectations": list(self.expectations),
        }


@dataclass
class PlannedCase:
    """A case that runs; ``known_failure`` is the expectation entry listing it, if any."""

    case_id: str
    level: str
    model: ModelCase | None = None
    node: NodeCase | None = None
    onnx_model: OnnxModelCase | None = None
    known_failure: dict[str, str] | None = None


@dataclass
class ConformanceRun:
    settings: RunSettings
    provider: ProviderUnderTest
    tier: Tier
    matrix: ModelMatrix
    operators: OperatorSelection
    planned: list[PlannedCase] = field(default_factory=list)
    decided: list[CaseResult] = field(default_factory=list)  # out of the table or not applicable: never run
    _store: NodeCaseStore | None = None

    @classmethod
    def create(cls, settings: RunSettings) -> ConformanceRun:
        tiers = load_tiers()
        if settings.tier not in tiers:
            raise ValueError(f"--tier {settings.tier!r}: the tiers are {', '.join(tiers)}")
        provider = resolve_provider(
            settings.provider,
            parse_assignments(settings.provider_options, "--provider-option", "device=emulator"),
            [Path(path) for path in settings.expectations],
        )
        return cls(settings, provider, tiers[settings.tier], load_models(), load_operators())

    @property
    def input_sets(self) -> Sequence[Any]:
        return self.matrix.quick_input_sets if self.settings.quick else self.matrix.input_sets

    def node_store(self) -> NodeCaseStore:
        if self._store is None:
            self._store = NodeCaseStore(self.settings.work_path())
        return self._store

    def _expectation(self, case_id: str, kind: str) -> dict[str, str] | None:
        for entry in self.provider.expectations:
            if entry.kind == kind and entry.applies(case_id, self.tier.name, self.provider.options):
                return {
                    "kind": entry.kind,
                    "reason": entry.reason,
                    "source": entry.source,
                    "file": entry.file,
                }
        return None

    def plan(self) -> ConformanceRun:
        """Decide every case: planned to run, or settled by the provider's declaration and expectations."""
        settings = self.settings
        model_cases = []
        if not settings.model_dirs or settings.models:
            model_cases = [
                ModelCase.from_entry(e) for e in self.matrix.select(settings.quick, settings.models)
            ]
        model_cases += [ModelCase.from_directory(path) for path in settings.model_dirs]
        if settings.model_dirs and not settings.models and not settings.ops:
            chosen_ops: frozenset[str] | None = frozenset()  # --model-dir alone checks those models only
        else:
            chosen_ops = self.operators.select(settings.quick, settings.ops)
        for case in model_cases:
            self._add(case.case_id, MODEL, case.group, model=case)
        # With --model-dir, like the matrix's models, ONNX's model cases run only when named.
        if settings.onnx_models or not settings.model_dirs:
            chosen = onnx_models.select(onnx_models.discover(), settings.quick, settings.onnx_models)
            for case in chosen:
                if self._ruled_out(case, ONNX_MODEL, case.kind):
                    continue
                self._add(case.case_id, ONNX_MODEL, case.kind, onnx_model=case)
        if chosen_ops != frozenset():
            for node in select_cases(self.node_store().cases(), chosen_ops):
                if self._ruled_out(node, OPERATOR, node.operator):
                    continue
                self._add(node.case_id, OPERATOR, node.operator, node=node)
        return self

    def _ruled_out(self, case: Any, level: str, group: str) -> bool:
        """Settle a case the provider's declaration rules out (out of the table, not applicable)."""
        ruled_out = static_status(case, self.provider.operator_support)
        if ruled_out is not None:
            status, reason = ruled_out
            self.decided.append(
                CaseResult(case.case_id, level, group, status, message=f"{case.case_id}: {reason}")
            )
        return ruled_out is not None

    def _add(self, case_id: str, level: str, group: str, **case: Any) -> None:
        not_applicable = self._expectation(case_id, "not_applicable")
        if not_applicable is not None:
            message = f"{case_id}: {not_applicable['reason']}"
            self.decided.append(
                CaseResult(case_id, level, group, NOT_APPLICABLE, message=message, expectation=not_applicable)
            )
            return
        self.planned.append(
            PlannedCase(case_id, level, known_failure=self._expectation(case_id, "known_failure"), **case)
        )

    def execute(self, planned: PlannedCase, zoo: Any) -> CaseResult:
        """Run one planned case and apply its expectation: a listed failure is XFAIL, a listed pass XPASS."""
        if planned.model is not None:
            onnx_dir = planned.model.onnx_dir(zoo, self.settings.work_path())
            result = run_model_case(
                planned.model,
                onnx_dir,
                self.provider,
                self.tier,
                self.input_sets,
                self.matrix.generation_inputs,
            )
        elif planned.onnx_model is not None:
            result = run_onnx_model_case(planned.onnx_model, self.provider, self.tier)
        else:
            result = run_operator_case(planned.node, self.node_store(), self.provider, self.tier)
        return apply_known_failure(result, planned.known_failure)


def apply_known_failure(result: CaseResult, known_failure: dict[str, str] | None) -> CaseResult:
    if known_failure is None:
        return result
    result.expectation = known_failure
    if result.status in (FAILED, ERROR):
        result.status = XFAIL
    elif result.status == PASSED:
        result.status = XPASS
        result.message = (
            f"{result.case_id} passes but is listed as a known failure ({known_failure['source']}): "
            f"remove it with `{removal_command(known_failure['file'], result.case_id)}`"
        )
    return result
