"""com.microsoft Attention and MultiHeadAttention lowered to opset-11 operators: same outputs as
onnxruntime CPU running the original one-node model, within atol 1e-5 / rtol 1e-4 (float32, inputs in
[-1, 1]), for random sizes, masks of every lowered form (rows with every key masked included), biases,
causal attention and past state; and a refusal naming the node for each form that is not lowered."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
import onnx
import pytest
from graph_testing import FLOAT, make_model, tensor_info
from hypothesis import strategies as st
from onnx import TensorProto, helper

from optimum_ipu_backend.compiler.padding import PaddingAnalyzer
from optimum_ipu_backend.runtime.padding import padded_inputs

ATOL, RTOL = 1e-5, 1e-4
INT32 = TensorProto.INT32
FLT_LOWEST = float(np.finfo(np.float32).min)
MS = "com.microsoft"
#: mask_filter_value: the attribute absent (-10000), what ORTOptimizer writes (-FLT_MAX), another value.
MASK_FILTERS = st.sampled_from([None, FLT_LOWEST, -50.0])


@pytest.fixture(autouse=True)
def _scratch_directory(tmp_path_factory, monkeypatch):
    """onnxruntime's symbolic shape inference, which types the contrib outputs, saves
    sym_shape_infer_temp.onnx in the working directory when it cannot type everything."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


def _contrib_model(op_type, inputs, outputs, node_inputs, **attributes):
    node = helper.make_node(
        op_type,
        node_inputs,
        [n for n, _, _ in outputs],
        name=f"the_{op_type}",
        domain=MS,
        **{k: v for k, v in attributes.items() if v is not None},
    )
    return make_model(
        [node],
        [tensor_info(n, t, s) for n, t, s in inputs],
        [tensor_info(n, t, s) for n, t, s in outputs],
        extra_opsets={MS: 1},
        check=False,
    )


def _random_mask(rng, form, batch, sequence, total, index_length=None):
    """A mask of ``form``: 1-D end positions, 1-D end+start, 2-D or 3-D raw 0/1 (some rows all 0)."""
    if form == "end":
        return rng.integers(0, total + 1, size=batch).astype(np.int32)  # 0: every key masked
    if form == "end_start":
        ends = rng.integers(0, total + 1, size=batch)
        starts = rng.integers(0, total + 1, size=batch)  # start >= end: every key masked
        return np.concatenate([ends, starts]).astype(np.int32)
    shape = (batch, total) if form == "2d" else (batch, sequence, total)
    raw = rng.integers(0, 2, size=shape)
    raw[rng.random(shape[:-1]) < 0.3] = 0  # rows with every key masked
    return (raw * rng.integers(1, 3, size=shape)).astype(np.int32)  # any positive value keeps a key


def _mask_shape(form, batch, sequence, total):
    return {"end": [batch], "end_start": [2 * batch], "2d": [batch, total], "3d": [batch, sequence, total]}[
        form
    ]


@lt.property_test(
    batch=st.integers(1, 3),
    sequence=st.integers(1, 4),
    heads=st.integers(1, 3),
    head=st.integers(1, 4),
    v_head=st.integers(1, 4),
    past=st.sampled_from([None, 0, 1, 3]),
    mask_form=st.sampled_from([None, "end", "end_start", "2d", "3d"]),
    with_bias=st.booleans(),
    attention_bias=st.sampled_from([None, "full", "broadcast"]),
    unidirectional=st.booleans(),
    mask_filter=MASK_FILTERS,
    scale=st.sampled_from([None, 0.3]),
    seed=lt.seeds,
)
def test_attention_same_outputs_as_onnxruntime(
    batch,
    sequence,
    heads,
    head,
    v_head,
    past,
    mask_form,
    with_bias,
    attention_bias,
    unidirectional,
    mask_filter,
    scale,
    seed,
):
    rng = np.random.default_rng(seed)
    if past is not None:
        v_head = head  # past/present state needs equal widths
        attention_bias = None  # onnxruntime rejects past with attention_bias
    hidden_in = int(rng.integers(1, 6))
    widths = [heads * head, heads * head, heads * v_head]
    total = sequence + (past or 0)
    inputs = [("input", FLOAT, [batch, sequence, hidden_in]), ("weights", FLOAT, [hidden_in, sum(widths)])]
    node_inputs = ["input", "weights", "", "", "", ""]
    if with_bias:
        inputs.append(("bias", FLOAT, [sum(widths)]))
        node_inputs[2] = "bias"
    if mask_form:
        inputs.append(("mask", INT32, _mask_shape(mask_form, batch, sequence, total)))
        node_inputs[3] = "mask"
    if past is not None:
        inputs.append(("past", FLOAT, [2, batch, heads, past, head]))
        node_inputs[4] = "past"
    if attention_bias:
        dims = [batch, heads] if attention_bias == "full" else [1, 1]
        inputs.append(("attention_bias", FLOAT, [*dims, sequence, total]))
        node_inputs[5] = "attention_bias"
    outputs = [("output", FLOAT, [batch, sequence, widths[2]])]
    if past is not None:
        outputs.append(("present", FLOAT, [2, batch, heads, total, head]))
    model = _contrib_model(
        "Attention",
        inputs,
        outputs,
        node_inputs,
        num_heads=heads,
        qkv_hidden_sizes=widths if v_head != head else None,
        unidirectional=int(unidirectional),
        mask_filter_value=mask_filter,
        scale=scale,
    )
    feeds = {n: rng.uniform(-1, 1, s).astype(np.float32) for n, t, s in inputs if t == FLOAT}
    if mask_form:
        feeds["mask"] = _random_mask(rng, mask_form, batch, sequence, total)
    lowered = lt.lower_and_compare(model, feeds, atol=ATOL, rtol=RTOL)
    assert "Attention" not in lt.op_types(lowered)


@lt.property_test(
    batch=st.integers(1, 3),
    sequence=st.integers(1, 4),
    kv_sequence=st.integers(1, 4),
    heads=st.integers(1, 3),
    head=st.integers(1, 4),
    v_head=st.integers(1, 4),
    past=st.sampled_from([None, 0, 2]),
    kv_in_heads=st.booleans(),
    mask_form=st.sampled_from([None, "end", "2d", "3d"]),
    with_bias=st.booleans(),
    attention_bias=st.sampled_from([None, "full", "broadcast"]),
    unidirectional=st.booleans(),
    present=st.booleans(),
    mask_filter=MASK_FILTERS,
    scale=st.sampled_from([None, 0.3]),
    seed=lt.seeds,
)
def test_multi_head_attention_same_outputs_as_onnxruntime(
    batch,
    sequence,
    kv_sequence,
    heads,
    head,
    v_head,
    past,
    kv_in_heads,
    mask_form,
    with_bias,
    attention_bias,
    unidirectional,
    present,
    mask_filter,
    scale,
    seed,
):
    rng = np.random.default_rng(seed)
    if unidirectional and sequence > 1:
        kv_sequence = sequence  # onnxruntime's causal mask is defined only for as many keys as queries
    if kv_in_heads:
        past, with_bias = None, False  # key and value already in heads take neither
        v_head = head  # and must have the same shape
    if past is not None:
        v_head, present = head, True  # past state needs value heads of the key's size, and the present
    total = kv_sequence + (past or 0)
    inputs = [("query", FLOAT, [batch, sequence, heads * head])]
    if kv_in_heads:
        inputs += [
            ("key", FLOAT, [batch, heads, kv_sequence, head]),
            ("value", FLOAT, [batch, heads, kv_sequence, v_head]),
        ]
    else:
        inputs += [
            ("key", FLOAT, [batch, kv_sequence, heads * head]),
            ("value", FLOAT, [batch, kv_sequence, heads * v_head]),
        ]
    node_inputs = ["query", "key", "value", "", "", "", "", ""]
    if with_bias:
        inputs.append(("bias", FLOAT, [heads * (2 * head + v_head)]))
        node_inputs[3] = "bias"
    if mask_form:
        inputs.append(("mask", INT32, _mask_shape(mask_form, batch, sequence, total)))
        node_inputs[4] = "mask"
    if attention_bias:
        dims = [batch, heads] if attention_bias == "full" else [1, 1]
        inputs.append(("attention_bias", FLOAT, [*dims, sequence, total]))
        node_inputs[5] = "attention_bias"
    if past is not None:
        inputs += [
            ("past_key", FLOAT, [batch, heads, past, head]),
            ("past_value", FLOAT, [batch, heads, past, v_head]),
        ]
        node_inputs[6:8] = ["past_key", "past_value"]
    outputs = [("output", FLOAT, [batch, sequence, heads * v_head])]
    if present:
        outputs += [
            ("present_key", FLOAT, [batch, heads, total, head]),
            ("present_value", FLOAT, [batch, heads, total, v_head]),
        ]
    model = _contrib_model(
        "MultiHeadAttention",
        inputs,
        outputs,
        node_inputs,
        num_heads=heads,
        unidirectional=int(unidirectional),
        mask_filter_value=mask_filter,
        scale=scale,
    )
    feeds = {n: rng.uniform(-1, 1, s).astype(np.float32) for n, t, s in inputs if t == FLOAT}
    if mask_form:
        feeds["mask"] = _random_mask(rng, mask_form, batch, sequence, total)
    lowered = lt.lower_and_compare(model, feeds, atol=ATOL, rtol=RTOL)
    assert "MultiHeadAttention" not in lt.op_types(lowered)


def _bert_like_attention(batch="batch_size", sequence="sequence_length") -> onnx.ModelProto:
    """What ORTOptimizer makes of BERT's self-attention: the 0/1 mask summed into end positions."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Cast", ["attention_mask"], ["mask_i32"], name="mask_cast", to=INT32),
        helper.make_node("ReduceSum", ["mask_i32", "axes"], ["mask_index"], name="mask_sum", keepdims=0),
        helper.make_node(
            "Attention",
            ["x", "w", "b", "mask_index"],
            ["y"],
            name="the_Attention",
            domain=MS,
            num_heads=2,
            mask_filter_value=FLT_LOWEST,
        ),
    ]
    initializers = {
        "axes": np.array([1], np.int64),
        "w": rng.uniform(-1, 1, (4, 12)).astype(np.float32),
        "b": rng.uniform(-1, 1, 12).astype(np.float32),
    }
    return make_model(
        nodes,
        [
            tensor_info("x", FLOAT, [batch, sequence, 4]),
            tensor_info("attention_mask", TensorProto.INT64, [batch, sequence]),
        ],
        [tensor_info("y", FLOAT, [batch, sequence, 4])],
        initializers,
        extra_opsets={MS: 1},
        check=False,
    )


def test_a_bert_like_attention_is_lowered_with_its_mask_index():
    model = _bert_like_attention(2, 5)
    rng = np.random.default_rng(1)
    mask = np.array([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], np.int64)  # the second row: every key masked
    feeds = {"x": rng.uniform(-1, 1, (2, 5, 4)).astype(np.float32), "attention_mask": mask}
    lowered = lt.lower_and_compare(model, feeds, atol=ATOL, rtol=RTOL)
    assert "Attention" not in lt.op_types(lowered)


def test_padding_is_not_proven_through_attention_and_the_verdict_names_it():
    """The padding proof follows no com.microsoft node (it cannot even run one for its output shape): the
    call is compiled at exact sizes, and the reason names the Attention node."""
    model = _bert_like_attention()
    shapes = {"x": ("batch_size", "sequence_length", 4), "attention_mask": ("batch_size", "sequence_length")}
    inputs = padded_inputs(
        shapes, {"x": 0, "attention_mask": 0}, {"batch_size": 2, "sequence_length": 5}, {"sequence_length": 8}
    )
    proof = PaddingAnalyzer(model).prove(inputs)
    assert not proof.exact
    (problem,) = proof.problems
    assert problem.startswith("node 'the_Attention' (Attention)"), problem
    assert (
        "onnxruntime's own operator com.microsoft::Attention, which the padding proof has no rule" in problem
    )


def _attention(
    x_shape=(1, 2, 4),
    w_shape=(4, 12),
    mask_shape=None,
    past_shape=None,
    bias_shape=None,
    outputs=1,
    **attributes,
):
    inputs = [("x", FLOAT, list(x_shape)), ("w", FLOAT, list(w_shape))]
    node_inputs = ["x", "w", "", "", "", ""]
    if mask_shape:
        inputs.append(("mask", INT32, list(mask_shape)))
        node_inputs[3] = "mask"
    if past_shape:
        inputs.append(("past", FLOAT, list(past_shape)))
        node_inputs[4] = "past"
    if bias_shape:
        inputs.append(("attention_bias", FLOAT, list(bias_shape)))
        node_inputs[5] = "attention_bias"
    names = [("y", FLOAT, [x_shape[0], x_shape[1], w_shape[1] // 3]), ("present", FLOAT, None)][:outputs]
    return _contrib_model("Attention", inputs, names, node_inputs, **{"num_heads": 2, **attributes})


@pytest.mark.parametrize(
    ("model", "match"),
    [
        (lambda: _attention(do_rotary=1), "do_rotary=1"),
        (lambda: _attention(past_present_share_buffer=1), "past_present_share_buffer=1"),
        (lambda: _attention(mask_shape=[1, 1, 2, 2]), r"mask 'mask' of shape \[1, 1, 2, 2\].*4-D Megatron"),
        (lambda: _attention(mask_shape=[5]), r"of shape \[5\] is none of the forms.*\(3·batch \+ 2\)"),
        (lambda: _attention(past_shape=[2, 1, 2, 3, 2]), "without the present output"),
        (
            lambda: _attention(past_shape=[2, 1, 2, 3, 2], bias_shape=[1, 2, 2, 5], outputs=2),
            "past with attention_bias",
        ),
        (lambda: _attention(qkv_hidden_sizes=[4, 2, 6]), r"qkv_hidden_sizes \[4, 2, 6\]"),
    ],
)
def test_attention_forms_not_lowered_are_refused_naming_the_node(model, match):
    lt.assert_refused(model(), "the_Attention.*" + match)


def _mha(q=(1, 2, 4), k=(1, 3, 4), v=(1, 3, 4), outputs=("y",), past=None, **attributes):
    inputs = [("q", FLOAT, list(q))]
    node_inputs = ["q", "", "", "", "", "", "", ""]
    for index, (name, shape) in enumerate((("k", k), ("v", v)), start=1):
        if shape:
            inputs.append((name, FLOAT, list(shape)))
            node_inputs[index] = name
    if past:
        inputs += [("past_key", FLOAT, list(past)), ("past_value", FLOAT, list(past))]
        node_inputs[6:8] = ["past_key", "past_value"]
    return _contrib_model(
        "MultiHeadAttention",
        inputs,
        [(o, FLOAT, None) for o in outputs],
        node_inputs,
        **{"num_heads": 2, **attributes},
    )


@pytest.mark.parametrize(
    ("model", "match"),
    [
        (lambda: _mha(k=None, v=None), "packed QKV"),
        (lambda: _mha(q=(1, 2, 2, 3, 2), k=None, v=None), "packed QKV"),
        (lambda: _mha(k=(1, 3, 2, 2, 2), v=None), "packed QKV or KV"),
        (lambda: _mha(k=(1, 3, 2, 2, 2), v=(1, 3, 4)), "packed 5-D KV"),
        (lambda: _mha(past=(1, 2, 1, 2)), "without the present output"),
        (lambda: _mha(unidirectional=1), "unidirectional attention of 2 queries over 3 new keys"),
        (lambda: _mha(outputs=("y", "", "", "qk")), "output qk"),
    ],
)
def test_multi_head_attention_forms_not_lowered_are_refused_naming_the_node(model, match):
    lt.assert_refused(model(), "the_MultiHeadAttention.*" + match)


@lt.property_test(
    batch=st.integers(1, 3),
    sequence=st.integers(1, 4),
    heads=st.integers(1, 3),
    head=st.integers(1, 4),
    mask_form=st.sampled_from([None, "end", "2d"]),
    past=st.sampled_from([None, 2]),
    seed=lt.seeds,
)
def test_float16_attention_runs_in_float32_as_onnxruntime_runs_it(
    batch, sequence, heads, head, mask_form, past, seed
):
    """An O4-optimized model's Attention takes float16: onnxruntime's session runs its float32-only kernel
    between Casts, and the lowering computes the same (within one float16 rounding of the result)."""
    rng = np.random.default_rng(seed)
    hidden_in, width = int(rng.integers(1, 6)), heads * head
    half = TensorProto.FLOAT16
    total = sequence + (past or 0)
    inputs = [("input", half, [batch, sequence, hidden_in]), ("weights", half, [hidden_in, 3 * width])]
    node_inputs = ["input", "weights", "bias", "", ""]
    inputs.append(("bias", half, [3 * width]))
    if mask_form:
        inputs.append(("mask", INT32, _mask_shape(mask_form, batch, sequence, total)))
        node_inputs[3] = "mask"
    outputs = [("output", half, [batch, sequence, width])]
    if past is not None:
        inputs.append(("past", half, [2, batch, heads, past, head]))
        node_inputs[4] = "past"
        outputs.append(("present", half, [2, batch, heads, total, head]))
    model = _contrib_model("Attention", inputs, outputs, node_inputs, num_heads=heads)
    feeds = {n: rng.uniform(-1, 1, s).astype(np.float16) for n, t, s in inputs if t == half}
    if mask_form:
        feeds["mask"] = _random_mask(rng, mask_form, batch, sequence, total)
    lowered = lt.lower_and_compare(model, feeds, atol=1e-3, rtol=1e-3)
    assert "Attention" not in lt.op_types(lowered)
