"""The operator level: ONNX's backend node cases, generated from the installed onnx package's case
definitions (``onnx.backend.test.case.node``), each run through the provider's whole session path and
compared with ONNX's own reference outputs and tolerances.

onnx no longer ships the node-test data; generating it runs every case definition (several seconds), so
it is done once per onnx version into the work directory, in ONNX's directory format (``model.onnx``,
``test_data_set_0/input_0.pb``, ...), with an index of each case's operators and element types.
"""

from __future__ import annotations

import json
import tempfile
import time
import traceback
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from optimum_ipu_backend.compiler.op_table import DEFAULT_DOMAINS
from optimum_ipu_backend.conformance.definition import Tier
from optimum_ipu_backend.conformance.providers import (
    REFERENCE_PROVIDER,
    OperatorSupport,
    ProviderUnderTest,
    operator_name,
)
from optimum_ipu_backend.conformance.results import (
    ERROR,
    FAILED,
    NOT_APPLICABLE,
    OPERATOR,
    OUT_OF_TABLE,
    PASSED,
    REFERENCE,
    CaseResult,
    finite,
    first_line,
)
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


def _graph_operators(graph: Any) -> set[tuple[str, str]]:
    import onnx

    found = set()
    for node in graph.node:
        found.add(("" if node.domain in DEFAULT_DOMAINS else node.domain, node.op_type))
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                found |= _graph_operators(attribute.g)
            for subgraph in attribute.graphs:
                found |= _graph_operators(subgraph)
    return found


def _value_kinds(model: Any) -> tuple[set[str], list[str]]:
    import onnx

    element_types, non_tensor = set(), []
    for value in [*model.graph.input, *model.graph.output]:
        if value.type.HasField("tensor_type"):
            element_types.add(onnx.TensorProto.DataType.Name(value.type.tensor_type.elem_type))
        else:
            non_tensor.append(value.name)
    return element_types, non_tensor


def _value_format(value_info: Any) -> tuple[Any, Any, Any]:
    """How ONNX's test data holds a value of this type: (proto class, reader, writer)."""
    import onnx
    from onnx import numpy_helper as helper

    return {
        "sequence_type": (onnx.SequenceProto, helper.to_list, helper.from_list),
        "optional_type": (onnx.OptionalProto, helper.to_optional, helper.from_optional),
        "map_type": (onnx.MapProto, helper.to_dict, helper.from_dict),
    }.get(
        value_info.type.WhichOneof("value"),
        (onnx.TensorProto, helper.to_array, lambda value, name: helper.from_array(np.asarray(value), name)),
    )


def _serialise(value: Any, value_info: Any, name: str) -> bytes:
    """A case value in ONNX's test-data format, as onnx's own generate-data tool writes it."""
    import onnx

    if isinstance(value, onnx.TensorProto):
        return value.SerializeToString()
    return _value_format(value_info)[2](value, name).SerializeToString()


def _deserialise(data: bytes, value_info: Any) -> Any:
    proto_class, read, _ = _value_format(value_info)
    proto = proto_class()
    proto.ParseFromString(data)
    return read(proto)


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
        element_types, non_tensor = _value_kinds(case.model)
        # An expanded case (the operator's function body) belongs to the operator of its plain twin.
        twin = by_name.get(case.name.split("_expanded")[0], case)
        tested = twin.model.graph.node[0] if len(twin.model.graph.node) == 1 else case.model.graph.node[0]
        index.append(
            {
                "name": case.name,
                "operator": operator_name(tested.domain, tested.op_type),
                "operators": sorted(_graph_operators(case.model.graph)),
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
                    _deserialise((data_dir / f"{kind}_{index}.pb").read_bytes(), info)
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


def static_status(case: NodeCase, support: OperatorSupport) -> tuple[str, str] | None:
    """OUT_OF_TABLE or NOT_APPLICABLE with the reason, when the provider's declaration rules the case out."""
    missing = support.out_of_table(case.operators)
    if missing:
        return (
            OUT_OF_TABLE,
            f"uses {', '.join(missing)}, not in the provider's operator table ({support.source})",
        )
    if case.non_tensor and not support.non_tensor_values:
        return (
            NOT_APPLICABLE,
            f"sequence, optional or map values {list(case.non_tensor)}: {support.non_tensor_reason}",
        )
    foreign = support.foreign_element_types(case.element_types)
    if foreign:
        return NOT_APPLICABLE, f"element type(s) {', '.join(foreign)}: {support.element_types_reason}"
    return None


def _compile_time_sources(graph: Any, operands: frozenset[tuple[str, int]]) -> set[str]:
    """Every tensor whose values a declared compile-time operand depends on, in any scope: through
    producers (not shape-only ones, whose outputs do not depend on values) and control-flow bodies."""
    from optimum_ipu_backend.compiler.graphs import SHAPE_ONLY, iter_graphs, node_reads, reach

    nodes = [node for scope in iter_graphs(graph) for node in scope.node]
    producer = {output: node for node in nodes for output in node.output}

    def sources(name: str) -> set[str]:
        node = producer.get(name)
        return set() if node is None or node.op_type in SHAPE_ONLY else node_reads(node)

    starts = [
        name for node in nodes for index, name in enumerate(node.input) if (node.op_type, index) in operands
    ]
    return reach(starts, sources)


def _bind_compile_time_operands(
    model: Any, feed: Mapping[str, Any], support: OperatorSupport
) -> tuple[Any, dict[str, Any], list[str]]:
    """Turn the graph inputs whose values a declared compile-time operand depends on (directly, or
    computed from them, as an expanded function body computes a Pad's pads from a shape input) into
    constants with the case's values, as they are in exported models."""
    if not support.compile_time_operands:
        return model, dict(feed), []
    from optimum_ipu_backend.compiler import bind_constant_inputs

    sources = _compile_time_sources(model.graph, support.compile_time_operands)
    bound = sorted(
        value.name
        for value in model.graph.input
        if value.name in sources and isinstance(feed.get(value.name), np.ndarray)
    )
    if not bound:
        return model, dict(feed), []
    model = bind_constant_inputs(model, {name: feed[name] for name in bound})
    return model, {key: value for key, value in feed.items() if key not in bound}, bound


def _error_figures(reference: Sequence[Any], actual: Sequence[Any]) -> tuple[float | None, float | None]:
    """Max abs and rel error over the numeric tensor outputs (for the report; pass/fail is ONNX's check)."""
    worst_abs, worst_rel = 0.0, 0.0
    for ref, got in zip(reference, actual, strict=False):
        if not isinstance(ref, np.ndarray) or not isinstance(got, np.ndarray) or ref.shape != got.shape:
            continue
        if ref.dtype.kind not in "biuf" or got.dtype.kind not in "biuf" or not ref.size:
            continue
        with np.errstate(all="ignore"):
            r, g = ref.astype(np.float64), got.astype(np.float64)
            diff = np.abs(g - r)
            same_nan = np.isnan(r) & np.isnan(g)
            diff = np.where(same_nan | (r == g), 0.0, diff)
            worst_abs = max(worst_abs, float(np.nanmax(diff)) if not np.isnan(diff).all() else float("nan"))
            nonzero = r != 0
            if nonzero.any():
                worst_rel = max(worst_rel, float(np.nanmax(diff[nonzero] / np.abs(r[nonzero]))))
    return finite(worst_abs), finite(worst_rel)


def _assert_similar(expected: Any, got: Any, rtol: float, atol: float) -> None:
    """ONNX's comparison of one output (``Runner.assert_similar_outputs``: shape, element type, then
    allclose), extended to every value a node case returns: sequences of any element rank, maps, and an
    empty optional (None) on both sides, which ONNX's runner cannot take."""
    from onnx.backend.test.runner import Runner

    if expected is None or got is None:
        if expected is not got:
            raise AssertionError(f"expected {'no value' if expected is None else 'a value'}, got {got!r:.80}")
    elif isinstance(expected, dict):
        if not isinstance(got, dict) or set(got) != set(expected):
            raise AssertionError(f"expected a map with keys {sorted(expected)}, got {got!r:.80}")
        for key in expected:
            _assert_similar(expected[key], got[key], rtol, atol)
    elif isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(expected):
            raise AssertionError(f"expected a sequence of {len(expected)} values, got {got!r:.80}")
        for expected_item, got_item in zip(expected, got, strict=True):
            _assert_similar(expected_item, got_item, rtol, atol)
    else:
        Runner.assert_similar_outputs([np.asarray(expected)], [np.asarray(got)], rtol=rtol, atol=atol)


def _differences(
    oracle: Sequence[Any], actual: Sequence[Any], names: Sequence[str], rtol: float, atol: float
) -> list[str]:
    """One line per output of ``actual`` that is not within tolerance of ``oracle``, naming the output."""
    if len(actual) != len(oracle):
        return [f"{len(actual)} outputs where {len(oracle)} were expected"]
    found = []
    for name, expected, got in zip(names, oracle, actual, strict=False):
        try:
            _assert_similar(expected, got, rtol, atol)
        except (AssertionError, TypeError) as exc:
            found.append(f"output {name!r}: {_summary(str(exc).strip())}")
    return found


@dataclass
class _Outcome:
    """What one runtime made of one data set: its outputs, or the exception it raised."""

    outputs: list[Any] | None = None
    error: BaseException | None = None
    phase: str = ""  # what was being done when it raised
    traceback: str = ""


def _cpu_outcome(model_bytes: bytes, feed: Mapping[str, Any]) -> _Outcome:
    import onnxruntime

    try:
        session = onnxruntime.InferenceSession(model_bytes, providers=[REFERENCE_PROVIDER])
        return _Outcome(outputs=session.run(None, dict(feed)))
    except Exception as exc:  # CPU's own refusal: the provider is then judged against ONNX's reference
        return _Outcome(error=exc)


def _cpu_column(
    outcome: _Outcome, expected: Sequence[Any], names: Sequence[str], rtol: float, atol: float
) -> dict[str, Any]:
    """CPU against ONNX's reference outputs: the column every operator case reports beside its own."""
    if outcome.error is not None:
        return {"status": "raises", "message": f"{type(outcome.error).__name__}: {first_line(outcome.error)}"}
    differences = _differences(expected, outcome.outputs, names, rtol, atol)
    max_abs, max_rel = _error_figures(expected, outcome.outputs)
    return {
        "status": "differs" if differences else "agrees",
        "message": "; ".join(differences),
        "max_abs": max_abs,
        "max_rel": max_rel,
    }


def run_operator_case(
    case: NodeCase, store: NodeCaseStore, provider: ProviderUnderTest, tier: Tier | None = None
) -> CaseResult:
    """Run one in-table, applicable node case and judge the provider against CPU onnxruntime's outputs
    for the same data; where CPU raises, against ONNX's reference outputs. A case CPU refuses too is not
    the provider's failure (NOT_APPLICABLE, saying so). CPU itself is judged against ONNX's reference.
    The status is PASSED, FAILED, ERROR or NOT_APPLICABLE."""
    started = time.perf_counter()
    result = CaseResult(case_id=case.case_id, level=OPERATOR, group=case.operator, status=PASSED)
    rtol, atol = (case.rtol, case.atol) if tier is None else tier.operator_tolerance(case.rtol, case.atol)
    result.info["tolerance"] = {"rtol": rtol, "atol": atol}
    is_cpu = provider.name == REFERENCE_PROVIDER
    try:
        model, data_sets = store.load(case)
    except Exception as exc:
        return _raised(result, case, _Outcome(error=exc, phase="loading the case"), started)
    names = [value.name for value in model.graph.output]
    with tempfile.TemporaryDirectory(prefix="conformance-op-") as scratch:
        for number, (inputs, expected) in enumerate(data_sets):
            feed = {info.name: value for info, value in zip(model.graph.input, inputs, strict=False)}
            cpu = None if is_cpu else _cpu_outcome(model.SerializeToString(), feed)
            if cpu is not None:
                result.cpu = _cpu_column(cpu, expected, names, rtol, atol)
            mine = _provider_outcome(case, number, model, feed, provider, Path(scratch), result)
            if mine.error is not None:
                if cpu is not None and cpu.error is not None:
                    result.status = NOT_APPLICABLE
                    result.message = (
                        f"{case.case_id} ({case.operator}): {REFERENCE_PROVIDER} refuses it too "
                        f"({result.cpu['message']}); {provider.name}: {type(mine.error).__name__}: "
                        f"{first_line(mine.error)}"
                    )
                    break
                return _raised(result, case, mine, started)
            use_cpu = cpu is not None and cpu.outputs is not None
            oracle, oracle_name = (cpu.outputs, REFERENCE_PROVIDER) if use_cpu else (expected, REFERENCE)
            result.oracle = oracle_name
            result.info["max_abs"], result.info["max_rel"] = _error_figures(oracle, mine.outputs)
            differences = _differences(oracle, mine.outputs, names, rtol, atol)
            if differences:
                result.status = FAILED
                result.failures = [
                    f"{case.case_id} ({case.operator}): data set {number}: {line}" for line in differences
                ]
                result.message = (
                    f"{case.case_id} ({case.operator}): {differences[0].partition(':')[0]} differs from "
                    f"{oracle_name} beyond rtol {rtol:g}, atol {atol:g}: {differences[0].partition(': ')[2]}"
                )
                result.detail = "\n".join(result.failures)
                break
    result.duration_s = round(time.perf_counter() - started, 4)
    return result


def _provider_outcome(
    case: NodeCase,
    number: int,
    model: Any,
    feed: Mapping[str, Any],
    provider: ProviderUnderTest,
    scratch: Path,
    result: CaseResult,
) -> _Outcome:
    phase = "binding compile-time operands"
    try:
        bound_model, feed, bound = _bind_compile_time_operands(model, feed, provider.operator_support)
        if bound:
            result.info["bound_operands"] = bound
        path = scratch / f"{case.name}-{number}.onnx"
        path.write_bytes(bound_model.SerializeToString())
        phase = f"creating a {provider.name} session"
        session = provider.create_session(path)
        phase = f"running data set {number}"
        return _Outcome(outputs=session.run(None, feed))
    except Exception as exc:  # the provider's refusal or crash is the finding
        return _Outcome(error=exc, phase=phase, traceback=traceback.format_exc())


def _raised(result: CaseResult, case: NodeCase, outcome: _Outcome, started: float) -> CaseResult:
    exc = outcome.error
    result.status = ERROR
    result.message = (
        f"{case.case_id} ({case.operator}): {outcome.phase} raised {type(exc).__name__}: {first_line(exc)}"
    )
    result.failures.append(result.message)
    result.detail = outcome.traceback or "".join(traceback.format_exception(exc))
    result.duration_s = round(time.perf_counter() - started, 4)
    return result


def _summary(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return "; ".join(lines[:4])[:400]
