"""RotaryEmbedding-23 lowered to Slice/Mul/Sub/Add/Concat: same outputs as onnxruntime CPU within atol 1e-5
(inputs and caches in [-1, 1]; each output is two products and one sum, rounded once each)."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
import pytest
from graph_testing import FLOAT, INT64
from hypothesis import strategies as st

ATOL = 1e-5
#: Cache rows: onnxruntime refuses caches shorter than the sequence ("updating the caches").
MAX_POSITIONS = 256


def _rotary(shape, half, with_positions, check=True, **attributes):
    batch, sequence = shape[0], shape[2] if len(shape) == 4 else shape[1]
    cache_shape = (MAX_POSITIONS, half) if with_positions else (batch, sequence, half)
    inputs = [("x", FLOAT, shape), ("cos", FLOAT, cache_shape), ("sin", FLOAT, cache_shape)]
    if with_positions:
        inputs.append(("pos", INT64, [batch, sequence]))
    model = lt.one_node_model(
        "RotaryEmbedding", inputs, [("y", FLOAT, shape)], opset=23, check=check, **attributes
    )
    rng = np.random.default_rng(half)
    feeds = {name: rng.uniform(-1, 1, dims).astype(np.float32) for name, _, dims in inputs if name != "pos"}
    if with_positions:
        feeds["pos"] = rng.integers(0, MAX_POSITIONS, (batch, sequence))
    return model, feeds


@lt.property_test(
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    sequence=st.integers(1, 4),
    half=st.integers(1, 4),
    extra=st.integers(0, 3),
    three_d=st.booleans(),
    interleaved=st.booleans(),
    with_positions=st.booleans(),
    explicit_dim=st.booleans(),
)
def test_same_outputs_as_rotary_embedding(
    batch, heads, sequence, half, extra, three_d, interleaved, with_positions, explicit_dim
):
    head_size = 2 * half + (extra if explicit_dim else 0)
    shape = (batch, sequence, heads * head_size) if three_d else (batch, heads, sequence, head_size)
    attributes = {"interleaved": int(interleaved)}
    if three_d:
        attributes["num_heads"] = heads
    if explicit_dim:
        attributes["rotary_embedding_dim"] = 2 * half
    model, feeds = _rotary(shape, half, with_positions, **attributes)
    lowered = lt.lower_and_compare(model, feeds, atol=ATOL)
    assert "RotaryEmbedding" not in lt.op_types(lowered)


@pytest.mark.parametrize("interleaved", [0, 1])
def test_a_llama_sized_input(interleaved):
    model, feeds = _rotary((2, 128, 32 * 64), 32, True, num_heads=32, interleaved=interleaved)
    lt.lower_and_compare(model, feeds, atol=ATOL)


def test_caches_of_another_width_are_refused():
    model, _ = _rotary((1, 2, 3, 8), 3, True, check=False)  # the head rotates 8 / 2 = 4 pairs
    lt.assert_refused(model, "the_RotaryEmbedding.*does not end in 4")
