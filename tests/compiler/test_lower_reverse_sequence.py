"""ReverseSequence with constant lengths lowered to one Gather: the same output as onnxruntime CPU."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
import pytest
from graph_testing import FLOAT, INT64
from hypothesis import strategies as st


def _reverse_sequence(shape, lengths, time_axis, batch_axis, lengths_constant=True, opset=11):
    lengths = np.asarray(lengths, np.int64)
    inputs = [("x", FLOAT, shape)]
    initializers = {"lens": lengths} if lengths_constant else None
    if not lengths_constant:
        inputs.append(("lens", INT64, list(lengths.shape)))
    return lt.one_node_model(
        "ReverseSequence",
        inputs,
        [("y", FLOAT, shape)],
        initializers,
        opset=opset,
        time_axis=time_axis,
        batch_axis=batch_axis,
    )


@lt.property_test(
    steps=st.integers(1, 6),
    batch=st.integers(1, 4),
    rest=lt.shapes(0, 2, 1, 3),
    batch_first=st.booleans(),
    seed=lt.seeds,
)
def test_same_outputs_as_reverse_sequence(steps, batch, rest, batch_first, seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, steps + 1, batch)
    time_axis, batch_axis = (1, 0) if batch_first else (0, 1)
    shape = (batch, steps, *rest) if batch_first else (steps, batch, *rest)
    model = _reverse_sequence(shape, lengths, time_axis, batch_axis)
    lowered = lt.lower_and_compare(model, {"x": lt.random_array(seed, shape, np.float32)}, atol=0)
    assert "ReverseSequence" not in lt.op_types(lowered)


@pytest.mark.parametrize("opset", [11, 28])  # ReverseSequence-28 added bfloat16 only
def test_transformer_sized_batch_first_input(opset):
    shape = (4, 128, 768)
    model = _reverse_sequence(shape, [128, 1, 77, 0], time_axis=1, batch_axis=0, opset=opset)
    lt.lower_and_compare(model, {"x": lt.random_array(0, shape, np.float32)}, atol=0)


@pytest.mark.parametrize("lengths", [[5, 2], [-1, 2]])
def test_lengths_outside_the_time_axis_are_refused(lengths):
    lt.assert_refused(_reverse_sequence((4, 2, 3), lengths, 0, 1), "the_ReverseSequence.*sequence_lens")


def test_lengths_known_only_at_run_time_are_refused():
    model = _reverse_sequence((4, 2, 3), [1, 2], 0, 1, lengths_constant=False)
    lt.assert_refused(model, "the_ReverseSequence.*sequence_lens.*constant")
