"""What the operator level and the ONNX-model level share: reading ONNX's test-data format, the static
statuses a provider's declaration decides, and judging one case's data sets. The provider runs each data
set through its whole session path and is judged by ONNX's comparison against CPU onnxruntime's outputs
for the same data where CPU runs the case, else against ONNX's stored outputs; CPU itself is judged
against the stored outputs (the CPU column)."""

from __future__ import annotations

import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from optimum_ipu_backend.compiler.op_table import DEFAULT_DOMAINS
from optimum_ipu_backend.conformance.providers import REFERENCE_PROVIDER, OperatorSupport, ProviderUnderTest
from optimum_ipu_backend.conformance.results import (
    ERROR,
    FAILED,
    NOT_APPLICABLE,
    OUT_OF_TABLE,
    REFERENCE,
    CaseResult,
    finite,
    first_line,
)

#: ONNX's default tolerances for a case that states none (``onnx.backend.test.loader``).
DEFAULT_RTOL = 1e-3
DEFAULT_ATOL = 1e-7

# ------------------------------------------------------------------------------------------------
# ONNX's test-data format and what a model uses
# ------------------------------------------------------------------------------------------------


def value_format(value_info: Any) -> tuple[Any, Any, Any]:
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


def read_value(data: bytes, value_info: Any) -> Any:
    """One serialised value of ONNX's test data (``input_N.pb``, ``output_N.pb``) as the runtimes take it."""
    proto_class, read, _ = value_format(value_info)
    proto = proto_class()
    proto.ParseFromString(data)
    return read(proto)


def graph_operators(graph: Any) -> set[tuple[str, str]]:
    """Every (domain, op type) a graph uses, subgraphs included ("" for the default domain)."""
    import onnx

    found = set()
    for node in graph.node:
        found.add(("" if node.domain in DEFAULT_DOMAINS else node.domain, node.op_type))
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                found |= graph_operators(attribute.g)
            for subgraph in attribute.graphs:
                found |= graph_operators(subgraph)
    return found


def value_kinds(model: Any) -> tuple[set[str], list[str]]:
    """The element types of a model's tensor inputs and outputs, and the names of its non-tensor ones."""
    import onnx

    element_types, non_tensor = set(), []
    for value in [*model.graph.input, *model.graph.output]:
        if value.type.HasField("tensor_type"):
            element_types.add(onnx.TensorProto.DataType.Name(value.type.tensor_type.elem_type))
        else:
            non_tensor.append(value.name)
    return element_types, non_tensor


class CaseFacts(Protocol):
    """What a provider's declaration is checked against, for a node case and an ONNX model case alike."""

    operators: tuple[tuple[str, str], ...]
    element_types: tuple[str, ...]
    non_tensor: tuple[str, ...]


def static_status(case: CaseFacts, support: OperatorSupport) -> tuple[str, str] | None:
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


# ------------------------------------------------------------------------------------------------
# Compile-time operands
# ------------------------------------------------------------------------------------------------


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


def bind_compile_time_operands(
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


# ------------------------------------------------------------------------------------------------
# Comparison
# ------------------------------------------------------------------------------------------------


def error_figures(reference: Sequence[Any], actual: Sequence[Any]) -> tuple[float | None, float | None]:
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
    allclose), extended to every value a case returns: sequences of any element rank, maps, and an
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


def differences(
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


def _summary(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return "; ".join(lines[:4])[:400]


# ------------------------------------------------------------------------------------------------
# Running and judging
# ------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one runtime made of one data set: its outputs, or the exception it raised."""

    outputs: list[Any] | None = None
    error: BaseException | None = None
    phase: str = ""  # what was being done when it raised
    traceback: str = ""


def cpu_outcome(model_bytes: bytes, feed: Mapping[str, Any]) -> Outcome:
    import onnxruntime

    try:
        session = onnxruntime.InferenceSession(model_bytes, providers=[REFERENCE_PROVIDER])
        return Outcome(outputs=session.run(None, dict(feed)))
    except Exception as exc:  # CPU's own refusal: the provider is then judged against ONNX's reference
        return Outcome(error=exc)


def cpu_column(
    outcome: Outcome, expected: Sequence[Any], names: Sequence[str], rtol: float, atol: float
) -> dict[str, Any]:
    """CPU against ONNX's reference outputs: the column every case reports beside its own."""
    if outcome.error is not None:
        return {"status": "raises", "message": f"{type(outcome.error).__name__}: {first_line(outcome.error)}"}
    found = differences(expected, outcome.outputs, names, rtol, atol)
    max_abs, max_rel = error_figures(expected, outcome.outputs)
    return {
        "status": "differs" if found else "agrees",
        "message": "; ".join(found),
        "max_abs": max_abs,
        "max_rel": max_rel,
    }


@dataclass(frozen=True)
class Subject:
    """The case being judged, as the messages and the scratch files name it."""

    label: str  # how a message names the case: "op/test_add (Add)", "onnx-model/simple/test_sign_model"
    stem: str  # the scratch model's file name before "-<data set>.onnx"


def judge(
    subject: Subject,
    result: CaseResult,
    model: Any,
    data_sets: Sequence[tuple[Mapping[str, Any], Sequence[Any]]],
    provider: ProviderUnderTest,
    rtol: float,
    atol: float,
    started: float,
) -> CaseResult:
    """Run every data set (feed by input name, reference outputs) through the provider and judge it against
    CPU onnxruntime's outputs for the same data; where CPU raises, against the reference outputs. A case
    CPU refuses too is not the provider's failure (NOT_APPLICABLE, saying so). CPU itself is judged
    against the reference. ``result`` comes in PASSED and leaves PASSED, FAILED, ERROR or NOT_APPLICABLE."""
    result.info["tolerance"] = {"rtol": rtol, "atol": atol}
    is_cpu = provider.name == REFERENCE_PROVIDER
    names = [value.name for value in model.graph.output]
    with tempfile.TemporaryDirectory(prefix="conformance-case-") as scratch:
        for number, (feed, expected) in enumerate(data_sets):
            cpu = None if is_cpu else cpu_outcome(model.SerializeToString(), feed)
            if cpu is not None:
                result.cpu = cpu_column(cpu, expected, names, rtol, atol)
            mine = _provider_outcome(subject, number, model, feed, provider, Path(scratch), result)
            if mine.error is not None:
                if cpu is not None and cpu.error is not None:
                    result.status = NOT_APPLICABLE
                    result.message = (
                        f"{subject.label}: {REFERENCE_PROVIDER} refuses it too "
                        f"({result.cpu['message']}); {provider.name}: {type(mine.error).__name__}: "
                        f"{first_line(mine.error)}"
                    )
                    break
                return raised(result, subject.label, mine, started)
            use_cpu = cpu is not None and cpu.outputs is not None
            oracle, oracle_name = (cpu.outputs, REFERENCE_PROVIDER) if use_cpu else (expected, REFERENCE)
            result.oracle = oracle_name
            result.info["max_abs"], result.info["max_rel"] = error_figures(oracle, mine.outputs)
            found = differences(oracle, mine.outputs, names, rtol, atol)
            if found:
                result.status = FAILED
                result.failures = [f"{subject.label}: data set {number}: {line}" for line in found]
                result.message = (
                    f"{subject.label}: {found[0].partition(':')[0]} differs from "
                    f"{oracle_name} beyond rtol {rtol:g}, atol {atol:g}: {found[0].partition(': ')[2]}"
                )
                result.detail = "\n".join(result.failures)
                break
    result.duration_s = round(time.perf_counter() - started, 4)
    return result


def _provider_outcome(
    subject: Subject,
    number: int,
    model: Any,
    feed: Mapping[str, Any],
    provider: ProviderUnderTest,
    scratch: Path,
    result: CaseResult,
) -> Outcome:
    phase = "binding compile-time operands"
    try:
        bound_model, feed, bound = bind_compile_time_operands(model, feed, provider.operator_support)
        if bound:
            result.info["bound_operands"] = bound
        path = scratch / f"{subject.stem}-{number}.onnx"
        path.write_bytes(bound_model.SerializeToString())
        phase = f"creating a {provider.name} session"
        session = provider.create_session(path)
        phase = f"running data set {number}"
        return Outcome(outputs=session.run(None, feed))
    except Exception as exc:  # the provider's refusal or crash is the finding
        return Outcome(error=exc, phase=phase, traceback=traceback.format_exc())


def raised(result: CaseResult, label: str, outcome: Outcome, started: float) -> CaseResult:
    """The case ends in ERROR: what was being done, and what it raised."""
    exc = outcome.error
    result.status = ERROR
    result.message = f"{label}: {outcome.phase} raised {type(exc).__name__}: {first_line(exc)}"
    result.failures.append(result.message)
    result.detail = outcome.traceback or "".join(traceback.format_exception(exc))
    result.duration_s = round(time.perf_counter() - started, 4)
    return result
