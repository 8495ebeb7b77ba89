"""onnxruntime's fused normalizations lowered to opset 11: same outputs as onnxruntime CPU's kernels.

Each property test builds the one-node model ORTOptimizer would write (random batch, sequence, hidden
size, epsilon, optional inputs present or not, extra outputs read or not) and compares every output with
onnxruntime CPU. float32 within atol 1e-5 / rtol 1e-4 (inputs standard normal: the kernels take the
variance as E[x^2] - E[x]^2, the decomposition over centred values, which agree to rounding there);
float16 within one float16 ulp at the output's magnitude (both compute in float32 and round once).
Integer outputs (EmbedLayerNormalization's mask_index) are compared exactly.
"""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import FLOAT, FLOAT16, make_model, run_ort, tensor_info
from hypothesis import strategies as st
from onnx import TensorProto, helper

ATOL, RTOL = 1e-5, 1e-4
FP16_ATOL, FP16_RTOL = 1e-3, 2.0**-10
INT32 = TensorProto.INT32
MS = "com.microsoft"

epsilons = st.floats(1e-12, 1e-3).map(lambda e: float(np.float32(e)))


def _model(op_type, domain, inputs, outputs, node_inputs, node_outputs, **attributes):
    """A one-node model; ``inputs``/``outputs`` are (name, type, shape) of the graph's used values."""
    node = helper.make_node(
        op_type, node_inputs, node_outputs, name=f"the_{op_type}", domain=domain, **attributes
    )
    return make_model(
        [node],
        [tensor_info(*spec) for spec in inputs],
        [tensor_info(*spec) for spec in outputs],
        extra_opsets={MS: 1},
        check=False,
    )


def _compare(model, feeds, fp16=False):
    lowered = lt.lower(model)
    lt.assert_lowered(lowered)
    atol, rtol = (FP16_ATOL, FP16_RTOL) if fp16 else (ATOL, RTOL)
    lt.assert_equivalent(model, lowered, feeds, atol=atol, rtol=rtol)
    return lowered


def _skip_case(seed, op_type, shape, skip_shape, beta, bias, reads, fp16, epsilon):
    """SkipLayerNormalization or SkipSimplifiedLayerNormalization, with ``reads`` its optional outputs."""
    simplified = op_type == "SkipSimplifiedLayerNormalization"
    elem, dtype = (FLOAT16, np.float16) if fp16 else (FLOAT, np.float32)
    hidden = shape[-1]
    rng = np.random.default_rng(seed)
    feeds = {
        "x": rng.standard_normal(shape).astype(dtype),
        "skip": rng.standard_normal(skip_shape).astype(dtype),
        "gamma": rng.uniform(-2, 2, hidden).astype(dtype),
    }
    node_inputs = ["x", "skip", "gamma"]
    if not simplified:
        node_inputs.append("beta" if beta else "")
        if beta:
            feeds["beta"] = rng.uniform(-2, 2, hidden).astype(dtype)
    if bias:
        node_inputs.append("bias")
        feeds["bias"] = rng.uniform(-1, 1, hidden).astype(dtype)
    while node_inputs[-1] == "":
        node_inputs.pop()
    stats = list(shape[:-1]) + [1]
    candidates = [
        ("y", elem, shape),
        ("mean", FLOAT, stats),
        ("inv_std_var", FLOAT, stats),
        ("sum", elem, shape),
    ]
    outputs = [spec for i, spec in enumerate(candidates) if i == 0 or reads[i - 1]]
    node_outputs = [spec[0] if i == 0 or reads[i - 1] else "" for i, spec in enumerate(candidates)]
    while node_outputs[-1] == "":
        node_outputs.pop()
    inputs = [(name, elem, feeds[name].shape) for name in node_inputs if name]
    model = _model(op_type, MS, inputs, outputs, node_inputs, node_outputs, epsilon=epsilon)
    return model, feeds


@lt.property_test(
    seed=lt.seeds,
    batch=st.integers(1, 3),
    sequence=st.integers(1, 6),
    hidden=st.integers(2, 48),
    skip_form=st.sampled_from(["full", "one_batch", "two_d"]),
    rank2=st.booleans(),
    beta=st.booleans(),
    bias=st.booleans(),
    reads=st.tuples(st.booleans(), st.booleans(), st.booleans()),
    epsilon=epsilons,
)
def test_skip_layer_normalization(
    seed, batch, sequence, hidden, skip_form, rank2, beta, bias, reads, epsilon
):
    shape = (sequence, hidden) if rank2 else (batch, sequence, hidden)
    skip_shape = {"full": shape, "one_batch": (1, sequence, hidden), "two_d": (sequence, hidden)}[skip_form]
    if rank2:
        skip_shape = shape
    model, feeds = _skip_case(
        seed, "SkipLayerNormalization", shape, skip_shape, beta, bias, reads, False, epsilon
    )
    _compare(model, feeds)


@lt.property_test(
    seed=lt.seeds,
    batch=st.integers(1, 3),
    sequence=st.integers(1, 6),
    hidden=st.integers(1, 48),
    rank2=st.booleans(),
    bias=st.booleans(),
    reads=st.tuples(st.booleans(), st.booleans()),
    epsilon=epsilons,
)
def test_skip_simplified_layer_normalization(seed, batch, sequence, hidden, rank2, bias, reads, epsilon):
    shape = (sequence, hidden) if rank2 else (batch, sequence, hidden)
    model, feeds = _skip_case(
        seed, "SkipSimplifiedLayerNormalization", shape, shape, False, bias, (False, *reads), False, epsilon
    )
    _compare(model, feeds)


@lt.property_test(
    seed=lt.seeds,
    op_type=st.sampled_from(["SkipLayerNormalization", "SkipSimplifiedLayerNormalization"]),
    sequence=st.integers(1, 6),
    hidden=st.integers(2, 32),
    bias=st.booleans(),
    reads_sum=st.booleans(),
)
def test_skip_normalizations_in_float16(seed, op_type, sequence, hidden, bias, reads_sum):
    shape = (2, sequence, hidden)
    beta = op_type == "SkipLayerNormalization"
    model, feeds = _skip_case(seed, op_type, shape, shape, beta, bias, (False, True, reads_sum), True, 1e-5)
    _compare(model, feeds, fp16=True)


def test_the_mean_of_skip_simplified_layer_normalization_is_refused():
    model, _ = _skip_case(
        0,
        "SkipSimplifiedLayerNormalization",
        (1, 2, 4),
        (1, 2, 4),
        False,
        False,
        (True, False, False),
        False,
        1e-5,
    )
    lt.assert_refused(model, "the_SkipSimplifiedLayerNormalization.*mean output is read")


def test_a_skip_that_does_not_broadcast_to_the_input_is_refused():
    model, _ = _skip_case(
        0, "SkipLayerNormalization", (1, 2, 4), (3, 2, 4), True, False, (False,) * 3, False, 1e-5
    )
    lt.assert_refused(model, "the_SkipLayerNormalization.*not shapes onnxruntime's kernel takes")


@lt.property_test(
    seed=lt.seeds,
    shape=lt.shapes(min_rank=1, max_rank=4, min_side=1, max_side=6),
    axis_back=st.integers(1, 2),
    reads_inv=st.booleans(),
    fp16=st.booleans(),
    epsilon=epsilons,
)
def test_simplified_layer_normalization(seed, shape, axis_back, reads_inv, fp16, epsilon):
    axis_back = min(axis_back, len(shape))
    axis = -axis_back if seed % 2 else len(shape) - axis_back
    elem, dtype = (FLOAT16, np.float16) if fp16 else (FLOAT, np.float32)
    rng = np.random.default_rng(seed)
    feeds = {
        "x": rng.standard_normal(shape).astype(dtype),
        "scale": rng.uniform(-2, 2, shape[len(shape) - axis_back :]).astype(dtype),
    }
    outputs = [("y", elem, shape)]
    if reads_inv:
        outputs.append(("inv_std_var", FLOAT, list(shape[: len(shape) - axis_back]) + [1] * axis_back))
    model = _model(
        "SimplifiedLayerNormalization",
        "",
        [("x", elem, shape), ("scale", elem, feeds["scale"].shape)],
        outputs,
        ["x", "scale"],
        [name for name, _, _ in outputs],
        axis=axis,
        epsilon=epsilon,
    )
    _compare(model, feeds, fp16=fp16)


def _embed_case(
    seed, batch, sequence, hidden, segments, position_ids, mask, reads, epsilon, mask_values=(0, 1)
):
    rng = np.random.default_rng(seed)
    vocabulary, positions = 11, sequence + 3
    feeds = {
        "input_ids": rng.integers(0, vocabulary, (batch, sequence)).astype(np.int32),
        "word": rng.standard_normal((vocabulary, hidden)).astype(np.float32),
        "position": rng.standard_normal((positions, hidden)).astype(np.float32),
        "gamma": rng.uniform(-2, 2, hidden).astype(np.float32),
        "beta": rng.uniform(-2, 2, hidden).astype(np.float32),
    }
    ids_segment, table_segment = segments
    if ids_segment:
        feeds["segment_ids"] = rng.integers(0, 2, (batch, sequence)).astype(np.int32)
    if table_segment:
        feeds["segment"] = rng.standard_normal((2, hidden)).astype(np.float32)
    if mask:
        feeds["mask"] = rng.choice(np.asarray(mask_values, np.int32), (batch, sequence))
    if position_ids:
        rows = batch if position_ids == "per_row" else 1
        feeds["position_ids"] = rng.integers(0, positions, (rows, sequence)).astype(np.int32)
    order = [
        "input_ids",
        "segment_ids",
        "word",
        "position",
        "segment",
        "gamma",
        "beta",
        "mask",
        "position_ids",
    ]
    node_inputs = [name if name in feeds else "" for name in order]
    while node_inputs[-1] == "":
        node_inputs.pop()
    candidates = [
        ("y", FLOAT, (batch, sequence, hidden)),
        ("mask_index", INT32, (batch,)),
        ("embedding_sum", FLOAT, (batch, sequence, hidden)),
    ]
    outputs = [spec for i, spec in enumerate(candidates) if i == 0 or reads[i - 1]]
    node_outputs = [spec[0] if i == 0 or reads[i - 1] else "" for i, spec in enumerate(candidates)]
    while node_outputs[-1] == "":
        node_outputs.pop()
    inputs = [
        (name, INT32 if feeds[name].dtype == np.int32 else FLOAT, feeds[name].shape)
        for name in node_inputs
        if name
    ]
    model = _model(
        "EmbedLayerNormalization",
        MS,
        inputs,
        outputs,
        node_inputs,
        node_outputs,
        epsilon=epsilon,
        # onnxruntime's shape inference wants the mask_index output exactly when this is 1.
        mask_index_type=int(reads[0]),
    )
    return model, feeds


@lt.property_test(
    seed=lt.seeds,
    batch=st.integers(1, 3),
    sequence=st.integers(1, 8),
    hidden=st.integers(2, 48),
    segments=st.sampled_from([(True, True), (False, False), (False, True)]),
    position_ids=st.sampled_from([None, "per_row", "shared"]),
    mask=st.booleans(),
    mask_values=st.sampled_from([(0, 1), (0, 1, 2, -1)]),
    reads=st.tuples(st.booleans(), st.booleans()),
    epsilon=epsilons,
)
def test_embed_layer_normalization(
    seed, batch, sequence, hidden, segments, position_ids, mask, mask_values, reads, epsilon
):
    model, feeds = _embed_case(
        seed, batch, sequence, hidden, segments, position_ids, mask, reads, epsilon, mask_values
    )
    _compare(model, feeds)


def test_mask_index_counts_the_ones_of_each_row():
    model, feeds = _embed_case(0, 3, 4, 8, (True, True), None, True, (True, False), 1e-12)
    feeds["mask"] = np.array([[1, 1, 0, 0], [1, 2, 1, -1], [0, 0, 0, 0]], np.int32)
    lowered = _compare(model, feeds)
    np.testing.assert_array_equal(run_ort(lowered, feeds)["mask_index"], [2, 2, 0])


def test_segment_ids_without_a_segment_table_are_refused():
    model, _ = _embed_case(0, 1, 2, 4, (True, False), None, False, (False, False), 1e-12)
    lt.assert_refused(model, "the_EmbedLayerNormalization.*segment_ids without a segment_embedding")
