"""onnxruntime's RotaryEmbedding (com.microsoft, what ORTOptimizer writes for Llama at O4) lowered to
opset 11: same outputs as onnxruntime CPU's kernel. float32 within atol 1e-5 (inputs and caches in
[-1, 1]; each output is two products and one sum); float16 computed in float32 and rounded once, as the
kernel does, so within one float16 ulp of the output (|y| <= 2)."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
import pytest
from graph_testing import FLOAT, FLOAT16, INT64, make_model, tensor_info
from hypothesis import strategies as st
from onnx import helper

ATOL = 1e-5
FP16_ATOL = 2.0**-9
MS = "com.microsoft"
#: Cache rows; positions stay below them (the kernel does not check).
MAX_POSITIONS = 64


def _contrib_rotary(shape, half, offset, fp16=False, seed=0, **attributes):
    """A one-node model of ``shape``'s input; ``offset``: one start position instead of one per token."""
    batch, sequence = shape[0], shape[2] if len(shape) == 4 else shape[1]
    elem, dtype = (FLOAT16, np.float16) if fp16 else (FLOAT, np.float32)
    position_shape = [1] if offset else [batch, sequence]
    inputs = [
        ("x", elem, list(shape)),
        ("pos", INT64, position_shape),
        ("cos", elem, [MAX_POSITIONS, half]),
        ("sin", elem, [MAX_POSITIONS, half]),
    ]
    node = helper.make_node(
        "RotaryEmbedding",
        [n for n, _, _ in inputs],
        ["y"],
        name="the_RotaryEmbedding",
        domain=MS,
        **attributes,
    )
    model = make_model(
        [node],
        [tensor_info(*spec) for spec in inputs],
        [tensor_info("y", elem, list(shape))],
        extra_opsets={MS: 1},
        check=False,
    )
    rng = np.random.default_rng(seed)
    feeds = {name: rng.uniform(-1, 1, dims).astype(dtype) for name, _, dims in inputs if name != "pos"}
    high = MAX_POSITIONS - sequence if offset else MAX_POSITIONS
    feeds["pos"] = rng.integers(0, high, position_shape).astype(np.int64)
    return model, feeds


def _compare(model, feeds, fp16):
    lowered = lt.lower(model)
    lt.assert_lowered(lowered)
    lt.assert_equivalent(model, lowered, feeds, atol=FP16_ATOL if fp16 else ATOL)
    assert "RotaryEmbedding" not in lt.op_types(lowered)


@lt.property_test(
    seed=st.integers(0, 2**16),
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    sequence=st.integers(1, 4),
    half=st.integers(1, 4),
    extra=st.integers(0, 3),
    three_d=st.booleans(),
    interleaved=st.booleans(),
    offset=st.booleans(),
    explicit_dim=st.booleans(),
    named_heads=st.booleans(),
    fp16=st.booleans(),
)
def test_same_outputs_as_onnxruntime(
    seed, batch, heads, sequence, half, extra, three_d, interleaved, offset, explicit_dim, named_heads, fp16
):
    head_size = 2 * half + (extra if explicit_dim else 0)
    shape = (batch, sequence, heads * head_size) if three_d else (batch, heads, sequence, head_size)
    attributes = {"interleaved": int(interleaved)}
    # onnxruntime requires num_heads with rotary_embedding_dim; without either, a 3-D input's heads are
    # as wide as the caches say.
    if named_heads or explicit_dim:
        attributes["num_heads"] = heads
    if explicit_dim:
        attributes["rotary_embedding_dim"] = 2 * half
    _compare(*_contrib_rotary(shape, half, offset, fp16, seed, **attributes), fp16)


@pytest.mark.parametrize("fp16", [False, True])
def test_the_llama_o4_form(fp16):
    """What ORTOptimizer writes for the zoo's Llama: 4-D [batch, heads, sequence, head] after a
    Transpose, positions per token, no attributes but interleaved=0, caches far longer than the text."""
    _compare(*_contrib_rotary((2, 4, 12, 8), 4, offset=False, fp16=fp16, interleaved=0), fp16)


def test_unsupported_attributes_are_refused():
    model, _ = _contrib_rotary((1, 2, 3, 8), 4, False, scale=0.5)
    lt.assert_refused(model, "scale=0.5 is not lowered")
    model, _ = _contrib_rotary((1, 2, 3, 8), 4, False, is_packed_batching=1)
    lt.assert_refused(model, "is_packed_batching=1")
    model, _ = _contrib_rotary((1, 2, 3, 8), 3, False)  # the head rotates 8 / 2 = 4 pairs
    lt.assert_refused(model, "the_RotaryEmbedding.*does not end in 4")
