"""The operator level: ONNX's backend node cases, generated from the installed onnx package's case
definitions (``onnx.backend.test.case.node``), each run through the provider's whole session path and
compared with ONNX's own reference outputs and tolerances.

onnx no longer ships the node-test data; generating it runs every case definition (several seconds), so
it is done once per onnx version into the work directory, in ONNX's directory format (``model.onnx``,
``test_data_set_0/input_0.pb``, ...), with an index of each case's operators and element types.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optimum_ipu_backend.conformance.definition import Tier
from optimum_ipu_backend.conformance.judging import (
    Outcome,
    Subject,
    graph_operators,
    judge,
    raised,
    read_value,
    value_format,
    value_kinds,
)
from optimum_ipu_backend.conformance.providers import ProviderUnderTest, operator_name
from optimum_ipu_backend.conformance.results import OPERATOR, PASSED, CaseResult
from optimum_ipu_backend.conformance.zoo import build_once

_INDEX_FILE = "index.json"
_INDEX_FORMAT = 1


@dataclass(frozen=True)
class NodeCase:
    """One generated node case, as the index describes it."""

    name: str
    operator: str  # the operator under test: "Op", or "domain::Op" outside the default domain
    operators: tuple[tuple[str, str], ...]  # every (domain, op type) its graph uses, subgraphs included
    element_types: tuple[str, ...]  # ONNX names of its inputs' and outputs' tensor element types
    non_tensor: tuple[str, ...]  # inputs and outputs that are sequences, optionals or maps
    rtol: float
    atol: float

    @property
    def case_id(self) -> str:
        return f"op/{self.name}"


def _serialise(value: Any, value_info: Any, name: str) -> bytes:
    """A case value in ONNX's test-data format, as onnx's own generate-data tool writes it."""
    import onnx

    if isinstance(value, onnx.TensorProto):
        return value.SerializeToString()
    return value_format(value_info)[2](value, name).SerializeToString()


def _write_case(case: Any, directory: Path) -> None:
    directory.mkdir(parents=True)
    (directory / "model.onnx").write_bytes(case.model.SerializeToString())
    for number, (inputs, outputs) in enumerate(case.data_sets):
        data_dir = directory / f"test_data_set_{number}"
        data_dir.mkdir()
        for kind, values, infos in (
            ("input", inputs, case.model.graph.input),
            ("output", outputs, case.model.graph.output),
        ):
            for index, (value, info) in enumerate(zip(values, infos, strict=False)):
                (data_dir / f"{kind}_{index}.pb").write_bytes(_serialise(value, info, info.name))


def _generate(root: Path) -> None:
    """Run onnx's node case definitions and write every case plus the index into ``root``."""
    import onnx.backend.test.case.node as node_cases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the case definitions overflow and divide by zero on purpose
        cases = node_cases.collect_testcases()
    by_name = {case.name: case for case in cases}
    index = []
    for case in cases:
        _write_case(case, root / case.name)
        element_types, non_tensor = value_kinds(case.model)
        # An expanded case (the operator's function body) belongs to the operator of its plain twin.
        twin = by_name.get(case.name.split("_expanded")[0], case)
        tested = twin.model.graph.node[0] if len(twin.model.graph.node) == 1 else case.model.graph.node[0]
        index.append(
            {
                "name": case.name,
                "operator": operator_name(tested.domain, tested.op_type),
                "operators": sorted(graph_operators(case.model.graph)),
                "element_types": sorted(element_types),
                "non_tensor": non_tensor,
                "rtol": case.rtol,
                "atol": case.atol,
            }
        )
    (root / _INDEX_FILE).write_text(json.dumps({"format": _INDEX_FORMAT, "cases": index}), encoding="utf-8")


class NodeCaseStore:
    """The generated node cases of the installed onnx version, under ``work_dir``."""

    def __init__(self, work_dir: Path) -> None:
        import onnx

        self.root = Path(work_dir) / "onnx-node-cases" / f"onnx-{onnx.__version__}-format{_INDEX_FORMAT}"

    def ensure(self) -> NodeCaseStore:
        """Generate the cases once (file-locked, renamed into place: a half-written store is never read)."""
        build_once(self.root, _generate, lambda root: (root / _INDEX_FILE).is_file())
        return self

    def cases(self) -> list[NodeCase]:
        raw = json.loads((self.ensure().root / _INDEX_FILE).read_text(encoding="utf-8"))
        return [
            NodeCase(
                name=item["name"],
                operator=item["operator"],
                operators=tuple((domain, op) for domain, op in item["operators"]),
                element_types=tuple(item["element_types"]),
                non_tensor=tuple(item["non_tensor"]),
                rtol=item["rtol"],
                atol=item["atol"],
            )
            for item in raw["cases"]
        ]

    def load(self, case: NodeCase) -> tuple[Any, list[tuple[list[Any], list[Any]]]]:
        """The case's model and its data sets (inputs, reference outputs)."""
        import onnx

        directory = self.root / case.name
        model = onnx.load(directory / "model.onnx")
        data_sets = []
        for data_dir in sorted(directory.glob("test_data_set_*")):
            values = {}
            for kind, infos in (("input", model.graph.input), ("output", model.graph.output)):
                values[kind] = [
                    read_value((data_dir / f"{kind}_{index}.pb").read_bytes(), info)
                    for index, info in enumerate(infos)
                    if (data_dir / f"{kind}_{index}.pb").is_file()
                ]
            data_sets.append((values["input"], values["output"]))
        return model, data_sets


def select_cases(cases: Sequence[NodeCase], operators: frozenset[str] | None) -> list[NodeCase]:
    """The cases of the chosen operators (by the operator under test); None keeps them all."""
    if operators is None:
        return list(cases)
    return [case for case in cases if case.operator in operators]


def run_operator_case(
    case: NodeCase, store: NodeCaseStore, provider: ProviderUnderTest, tier: Tier | None = None
) -> CaseResult:
    """Run one in-table, applicable node case and judge it (``judging.judge``): against CPU onnxruntime's
    outputs for the same data, else against ONNX's reference outputs. The status is PASSED, FAILED,
    ERROR or NOT_APPLICABLE."""
    started = time.perf_counter()
    result = CaseResult(case_id=case.case_id, level=OPERATOR, group=case.operator, status=PASSED)
    rtol, atol = (case.rtol, case.atol) if tier is None else tier.operator_tolerance(case.rtol, case.atol)
    subject = Subject(label=f"{case.case_id} ({case.operator})", stem=case.name)
    try:
        model, data_sets = store.load(case)
    except Exception as exc:
        result.info["tolerance"] = {"rtol": rtol, "atol": atol}
        return raised(result, subject.label, Outcome(error=exc, phase="loading the case"), started)
    feeds = [
        ({info.name: value for info, value in zip(model.graph.input, inputs, strict=False)}, expected)
        for inputs, expected in data_sets
    ]
    return judge(subject, result, model, feeds, provider, rtol, atol, started)
