"""Every ai.onnx operator up to the newest opset an optimum export carries is accepted by the compiler or
refused with a listed reason; activations, normalisations and attention only with a plan; and
docs/operators.md is the list as tools/operators_table.py writes it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import lowering_testing as lt
import numpy as np
import onnx
from graph_testing import make_model, tensor_info
from onnx import TensorProto, helper

from optimum_ipu_backend.compiler.precheck import accepted_op_types, precheck_operators
from optimum_ipu_backend.compiler.refused_operators import (
    NEWEST_EXPORTED_OPSET,
    REFUSAL_REASONS,
    REPLACED_BELOW_OPSET11,
    is_planned,
)

TOOL = Path(__file__).resolve().parents[2] / "tools" / "operators_table.py"

#: The activation functions of ai.onnx up to opset 23 (ONNX's operator list has no category field).
ACTIVATIONS = frozenset(
    {
        "Celu", "Elu", "Gelu", "HardSigmoid", "HardSwish", "Hardmax", "LeakyRelu", "LogSoftmax", "Mish",
        "PRelu", "Relu", "Selu", "Sigmoid", "Softmax", "Softplus", "Softsign", "Tanh", "ThresholdedRelu",
    }
)  # fmt: skip
TRANSFORMER_BLOCKS = frozenset({"Attention", "RotaryEmbedding"})


def _default_domain_schemas() -> dict[str, onnx.defs.OpSchema]:
    """Each ai.onnx operator that exists at NEWEST_EXPORTED_OPSET, as that opset defines it."""
    names = {
        schema.name
        for schema in onnx.defs.get_all_schemas_with_history()
        if schema.domain == "" and schema.since_version <= NEWEST_EXPORTED_OPSET
    }
    return {name: onnx.defs.get_schema(name, NEWEST_EXPORTED_OPSET, "") for name in names}


def test_every_operator_is_accepted_or_has_a_reason():
    schemas = _default_domain_schemas()
    unexplained = {
        name
        for name, schema in schemas.items()
        if not schema.deprecated and name not in accepted_op_types() and name not in REFUSAL_REASONS
    }
    assert not unexplained, f"refused with no reason: {sorted(unexplained)}"
    # No stale entries: a listed operator exists and is not accepted after all.
    assert set(REFUSAL_REASONS) <= set(schemas)
    assert not set(REFUSAL_REASONS) & accepted_op_types()


def test_activations_normalisations_and_attention_are_refused_only_with_a_plan():
    schemas = _default_domain_schemas()
    normalisations = {name for name in schemas if name.endswith("Normalization")}
    assert {"GroupNormalization", "LayerNormalization", "RMSNormalization"} <= normalisations
    for name in sorted((ACTIVATIONS | normalisations | TRANSFORMER_BLOCKS) & set(schemas)):
        assert name in accepted_op_types() or is_planned(REFUSAL_REASONS[name]), name


def test_the_precheck_refusal_quotes_the_reason():
    model = make_model(
        [helper.make_node("Unique", ["x"], ["y"], name="distinct")],
        [tensor_info("x", TensorProto.FLOAT, [6])],
        [tensor_info("y", TensorProto.FLOAT, None)],
        opset=13,
        check=False,
    )
    (refused,) = precheck_operators(model)
    assert (refused.name, refused.op_type) == ("distinct", "Unique")
    assert REFUSAL_REASONS["Unique"] in refused.reason


def test_the_lowering_pass_quotes_the_reason_too():
    """What optimum-ipu check and a compile-time LegalizationError say."""
    model = lt.one_node_model(
        "Det", [("x", TensorProto.FLOAT, [2, 3, 3])], [("y", TensorProto.FLOAT, [2])], opset=13
    )
    lt.assert_refused(model, "the_Det.*no rewrite handles it: matrix determinant")


def _upsample_model(opset: int) -> onnx.ModelProto:
    return make_model(
        [helper.make_node("Upsample", ["x", "scales"], ["y"], name="up", mode="nearest")],
        [tensor_info("x", TensorProto.FLOAT, [1, 1, 2, 2])],
        [tensor_info("y", TensorProto.FLOAT, None)],
        {"scales": np.array([1, 1, 2, 2], np.float32)},
        opset=opset,
        check=False,
    )


def test_deprecated_operators_are_accepted_below_opset_11_only():
    """The compiler raises such models to opset 11 with onnx.version_converter, which replaces them."""
    assert REPLACED_BELOW_OPSET11 <= {name for name, s in _default_domain_schemas().items() if s.deprecated}
    assert precheck_operators(_upsample_model(9)) == []
    (refused,) = precheck_operators(_upsample_model(11))
    assert refused.op_type == "Upsample" and "deprecated" in refused.reason


def test_docs_operators_md_is_generated():
    spec = importlib.util.spec_from_file_location("operators_table", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.DOC.read_text(encoding="utf-8") == tool.render(), "run: python tools/operators_table.py"
