"""The operator level: node cases generated once from onnx's case definitions, the provider's declared
support deciding what applies, compile-time operands bound as constants, ONNX's comparison."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from model_zoo import conformance_work_dir

from optimum_ipu_backend.compiler.op_table import COMPILE_TIME_OPERANDS, POPART_OPSET11_OPS
from optimum_ipu_backend.compiler.precheck import accepted_op_types
from optimum_ipu_backend.conformance.judging import static_status
from optimum_ipu_backend.conformance.operators import NodeCase, NodeCaseStore, run_operator_case
from optimum_ipu_backend.conformance.providers import OperatorSupport, resolve_provider
from optimum_ipu_backend.conformance.results import ERROR, FAILED, NOT_APPLICABLE, OUT_OF_TABLE, PASSED


@pytest.fixture(scope="module")
def store() -> NodeCaseStore:
    return NodeCaseStore(conformance_work_dir()).ensure()


@pytest.fixture(scope="module")
def cases(store: NodeCaseStore) -> dict[str, NodeCase]:
    return {case.name: case for case in store.cases()}


def test_generated_cases_know_their_operator_and_round_trip_their_data(store, cases) -> None:
    assert len(cases) > 1500
    add = cases["test_add"]
    assert add.operator == "Add" and add.operators == (("", "Add"),) and add.element_types == ("FLOAT",)
    (inputs, outputs), *_ = store.load(add)[1]
    np.testing.assert_array_equal(outputs[0], inputs[0] + inputs[1])
    # An expanded case belongs to its operator and lists the operators of the function body.
    expanded = cases["test_softmax_axis_0_expanded"]
    assert expanded.operator == "Softmax" and ("", "Softmax") not in expanded.operators
    assert {("", "Exp"), ("", "ReduceSum")} <= set(expanded.operators)


def test_declared_support_decides_what_applies(cases) -> None:
    support = OperatorSupport(
        table=frozenset({("", "Add"), ("", "Softmax"), ("", "Identity")}),
        element_types=frozenset({"FLOAT"}),
        element_types_reason="the test NPU holds float32 only",
        non_tensor_values=False,
        non_tensor_reason="the test NPU holds tensors only",
        source="test [operators]",
    )
    assert static_status(cases["test_add"], support) is None
    status, reason = static_status(cases["test_mul"], support)
    assert status == OUT_OF_TABLE and reason.startswith(
        "uses Mul, not in the provider's operator table (test"
    )
    status, reason = static_status(cases["test_add_uint8"], support)
    assert (status, reason) == (NOT_APPLICABLE, "element type(s) UINT8: the test NPU holds float32 only")
    status, reason = static_status(cases["test_identity_sequence"], support)
    assert status == NOT_APPLICABLE and "the test NPU holds tensors only" in reason
    # No declaration (onnxruntime's providers): everything applies.
    assert static_status(cases["test_mul"], OperatorSupport()) is None


def test_the_ipu_declaration_is_the_compilers_own_table() -> None:
    support = resolve_provider("ipu", {"device": "emulator"}).operator_support
    # What the session's pre-check accepts: PopART's table and every operator a rewrite lowers.
    # Names are "Op" or "domain::Op" (op_table.operator_name), parsed as the declaration's resolver does.
    assert support.table == {
        ("", name) if not sep else (domain, name)
        for domain, sep, name in (op.rpartition("::") for op in accepted_op_types())
    }
    assert {("", "LayerNormalization"), ("", "Einsum"), ("", "Trilu")} <= support.table
    assert {("", op) for op in POPART_OPSET11_OPS} < support.table
    assert "entry point 'ipu'" in support.source
    assert support.compile_time_operands == COMPILE_TIME_OPERANDS
    assert support.provider_options == {"executable_cache_dir": ""}


def test_compile_time_operands_become_constants_and_onnx_judges(store, cases) -> None:
    cpu = resolve_provider("CPUExecutionProvider", {})
    case = cases["test_reshape_reordered_all_dims"]
    plain = run_operator_case(case, store, cpu)
    assert plain.status == PASSED and "bound_operands" not in plain.info
    static = dataclasses.replace(
        cpu, operator_support=OperatorSupport(compile_time_operands=COMPILE_TIME_OPERANDS)
    )
    bound = run_operator_case(case, store, static)
    assert bound.status == PASSED and bound.info["bound_operands"] == ["shape"]


def test_pad_axes_are_bound_with_the_pads_they_place(store, cases) -> None:
    # The lowering folds Pad-18's axes into Pad-11's pads, so it needs them as constants too.
    static = dataclasses.replace(
        resolve_provider("CPUExecutionProvider", {}),
        operator_support=OperatorSupport(compile_time_operands=COMPILE_TIME_OPERANDS),
    )
    bound = run_operator_case(cases["test_constant_pad_axes"], store, static)
    assert bound.status == PASSED and bound.info["bound_operands"] == ["axes", "pads"]


class _OffByOne:
    """A session whose every output is 1 too large."""

    def __init__(self, session) -> None:
        self._session = session

    def run(self, names, feed):
        return [value + 1 for value in self._session.run(names, feed)]


def test_a_wrong_result_fails_onnx_comparison_and_a_crash_is_an_error(store, cases, monkeypatch) -> None:
    cpu = resolve_provider("CPUExecutionProvider", {})
    create = type(cpu).create_session
    monkeypatch.setattr(type(cpu), "create_session", lambda self, path: _OffByOne(create(self, path)))
    failed = run_operator_case(cases["test_add"], store, cpu)
    assert failed.status == FAILED
    assert failed.message.startswith(
        "op/test_add (Add): output 'sum' differs from ONNX's reference outputs beyond rtol 0.001"
    )
    assert failed.info["max_abs"] == pytest.approx(1.0, rel=1e-6)
    monkeypatch.setattr(type(cpu), "create_session", lambda self, path: 1 / 0)
    crashed = run_operator_case(cases["test_add"], store, cpu)
    assert crashed.status == ERROR
    assert "creating a CPUExecutionProvider session raised ZeroDivisionError" in crashed.message


def test_provider_options_pass_through_to_the_provider(store, cases, tmp_path) -> None:
    options = {"device": "emulator", "precision": "fp16", "sequence_lengths": "16,32", "batch_size": "1,4"}
    ipu = resolve_provider("ipu", options)
    assert ipu.ortmodel_kwargs() == {"provider": "IPUExecutionProvider", "provider_options": options}
    path = tmp_path / "add.onnx"
    path.write_bytes(store.load(cases["test_add"])[0].SerializeToString())
    reported = ipu.create_session(path).get_provider_options()["IPUExecutionProvider"]
    assert reported["device"] == "emulator" and reported["precision"] == "fp16"
    # The operator level adds the declared executable_cache_dir="" (no cache); the run's own options win.
    assert reported["executable_cache"] == "disabled"
    mine = resolve_provider("ipu", {"device": "emulator", "executable_cache_dir": str(tmp_path / "cache")})
    reported = mine.create_session(path).get_provider_options()["IPUExecutionProvider"]
    assert str(tmp_path / "cache") in reported["executable_cache"]
