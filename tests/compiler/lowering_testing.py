"""Helpers for the opset-11 lowering tests: one-node models, the pass run on a copy, and the checks.

Every property test compares onnxruntime CPU runs of the graph at its source opset (18 unless a test says
otherwise) and of the lowered opset-11 graph on the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import pytest
from graph_testing import assert_same_outputs, copy_model, make_model, run_ort, tensor_info
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from optimum_ipu_backend.compiler.errors import LegalizationError
from optimum_ipu_backend.compiler.graphs import iter_graphs, iter_nodes
from optimum_ipu_backend.compiler.op_table import DEFAULT_DOMAINS, POPART_OPSET11_OPS
from optimum_ipu_backend.compiler.passes.base import PassContext
from optimum_ipu_backend.compiler.passes.lower_opset11 import LowerToOpset11

#: Hypothesis settings shared by the property tests: no deadline (ORT session start-up varies).
PROPERTY_SETTINGS: dict[str, Any] = {"deadline": None, "max_examples": 30}

TensorSpec = tuple[str, int, Sequence[int] | None]


def property_test(**strategies: st.SearchStrategy) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """hypothesis' ``@given(**strategies)`` run with the shared PROPERTY_SETTINGS."""

    def decorate(test: Callable[..., None]) -> Callable[..., None]:
        return given(**strategies)(settings(**PROPERTY_SETTINGS)(test))

    return decorate


def one_node_model(
    op_type: str,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    initializers: Mapping[str, np.ndarray] | None = None,
    opset: int = 18,
    node_inputs: Sequence[str] | None = None,
    check: bool = True,
    **attributes: Any,
) -> onnx.ModelProto:
    """A checked model of one node; ``inputs`` are graph inputs, ``initializers`` constant operands.

    ``node_inputs`` gives the node's operand order (with '' for skipped optional inputs) when it is not
    graph inputs followed by initializers.
    """
    initializers = dict(initializers or {})
    operands = (
        list(node_inputs) if node_inputs is not None else [n for n, _, _ in inputs] + list(initializers)
    )
    node = helper.make_node(
        op_type, operands, [n for n, _, _ in outputs], name=f"the_{op_type}", **attributes
    )
    model = make_model(
        [node],
        [tensor_info(n, t, s) for n, t, s in inputs],
        [tensor_info(n, t, s) for n, t, s in outputs],
        initializers,
        opset=opset,
        check=False,
    )
    if any(shape is None for _, _, shape in outputs):
        # The full checker wants output shapes: take the ones shape inference finds.
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=check)
        for output, found in zip(model.graph.output, inferred.graph.output, strict=True):
            output.type.CopyFrom(found.type)
    if check:
        onnx.checker.check_model(model, full_check=True)
    return model


def lower(model: onnx.ModelProto) -> onnx.ModelProto:
    """LowerToOpset11 run on a copy (the pass may mutate its argument)."""
    return LowerToOpset11().run(copy_model(model), PassContext(input_shapes={}))


def assert_refused(model: onnx.ModelProto, match: str) -> LegalizationError:
    """Lowering ``model`` raises a LegalizationError whose message matches the regex ``match``."""
    with pytest.raises(LegalizationError, match=match) as raised:
        lower(model)
    return raised.value


def op_types(model: onnx.ModelProto) -> set[str]:
    """Every op type of the model, subgraphs included."""
    return {node.op_type for node in iter_nodes(model.graph)}


def assert_lowered(model: onnx.ModelProto) -> None:
    """Opset 11 imported, the full checker passes, and every node is a PopART opset-11 operator."""
    versions = {o.domain: o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS}
    assert set(versions.values()) == {11}, versions
    onnx.checker.check_model(model, full_check=True)
    for graph in iter_graphs(model.graph):
        for node in graph.node:
            assert node.domain in DEFAULT_DOMAINS, node
            assert node.op_type in POPART_OPSET11_OPS, f"{node.op_type} is not in PopART's opset-11 table"
            onnx.defs.get_schema(node.op_type, 11, "")  # raises when the op has no opset-11 schema


def assert_equivalent(
    before: onnx.ModelProto,
    after: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    atol: float = 1e-6,
    rtol: float = 0.0,
) -> None:
    """Both graphs run on ORT CPU; integer/bool outputs exactly equal, floats within ``atol``/``rtol``."""
    assert_same_outputs(run_ort(before, feeds), run_ort(after, feeds), atol=atol, rtol=rtol)


def lower_and_compare(
    model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], atol: float = 1e-6, rtol: float = 0.0
) -> onnx.ModelProto:
    """Lower ``model``, check the result is PopART opset 11, and that it computes the same outputs."""
    lowered = lower(model)
    assert_lowered(lowered)
    assert_equivalent(model, lowered, feeds, atol=atol, rtol=rtol)
    return lowered


def shapes(min_rank: int = 1, max_rank: int = 4, min_side: int = 1, max_side: int = 5) -> st.SearchStrategy:
    """Static tensor shapes, as tuples."""
    return st.lists(st.integers(min_side, max_side), min_size=min_rank, max_size=max_rank).map(tuple)


def random_array(
    seed: int, shape: Sequence[int], dtype: np.dtype | type, low: float = -10, high: float = 10
) -> np.ndarray:
    """Values drawn from a seeded generator: hypothesis picks the seed, shapes and attributes."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(max(int(low), info.min), min(int(high), info.max) + 1, size=shape).astype(dtype)
    return rng.uniform(low, high, size=shape).astype(dtype)


seeds = st.integers(0, 2**32 - 1)
