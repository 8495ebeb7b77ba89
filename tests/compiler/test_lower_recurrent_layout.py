"""Batch-first (layout=1) GRU/LSTM/RNN as the sequence-first op between Transposes.

onnxruntime CPU refuses layout=1, so the lowered graph (on onnxruntime CPU) is compared with two oracles:
onnxruntime CPU's own layout-0 kernel on the inputs transposed in numpy (every attribute), and ONNX's
reference implementation of the original batch-first node (the attributes it implements).
"""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
import onnx
import pytest
from graph_testing import FLOAT, INT32, assert_same_outputs, copy_model, make_model, run_ort, tensor_info
from hypothesis import strategies as st
from onnx import helper
from onnx.reference import ReferenceEvaluator

_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
_OUTPUTS = {"RNN": ("Y", "Y_h"), "GRU": ("Y", "Y_h"), "LSTM": ("Y", "Y_h", "Y_c")}
#: Batch-first to sequence-first, for X and the states (Y's own order is checked by the reference).
_SWAP_LEADING = (1, 0, 2)


def _recurrent_case(op_type, batch, seq, size, hidden, direction, seed, extras=(), outputs=None):
    """A one-node batch-first model and its feeds. ``extras`` picks optional operands: "B",
    "sequence_lens", "initial_h", "initial_c", "P"; ``outputs`` the outputs kept (others '')."""
    dirs = 2 if direction == "bidirectional" else 1
    gates = _GATES[op_type]
    rng = np.random.default_rng(seed)

    def uniform(*shape, scale=1.0):
        return rng.uniform(-scale, scale, size=shape).astype(np.float32)

    # Weights as torch initializes them (+-1/sqrt(hidden)): larger ones make the recurrence chaotic, and
    # float rounding alone then drifts apart over the steps.
    weight = hidden**-0.5
    feeds = {"X": uniform(batch, seq, size), "W": uniform(dirs, gates * hidden, size, scale=weight)}
    feeds["R"] = uniform(dirs, gates * hidden, hidden, scale=weight)
    optional = {
        "B": lambda: uniform(dirs, 2 * gates * hidden, scale=weight),
        "sequence_lens": lambda: rng.integers(1, seq + 1, size=batch).astype(np.int32),
        "initial_h": lambda: uniform(batch, dirs, hidden),
        "initial_c": lambda: uniform(batch, dirs, hidden),
        "P": lambda: uniform(dirs, 3 * hidden, scale=weight),
    }
    slots = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"][
        : 8 if op_type == "LSTM" else 6
    ]
    operands = [name if name in ("X", "W", "R") or name in extras else "" for name in slots]
    while not operands[-1]:
        operands.pop()
    feeds.update({name: optional[name]() for name in operands if name and name not in feeds})
    kept = outputs or _OUTPUTS[op_type]
    node_outputs = [name if name in kept else "" for name in _OUTPUTS[op_type]]
    while not node_outputs[-1]:
        node_outputs.pop()
    node = helper.make_node(
        op_type,
        operands,
        node_outputs,
        name=f"the_{op_type}",
        hidden_size=hidden,
        direction=direction,
        layout=1,
    )
    inputs = [tensor_info(n, INT32 if n == "sequence_lens" else FLOAT, feeds[n].shape) for n in operands if n]
    model = make_model([node], inputs, [tensor_info(n, FLOAT, None) for n in node_outputs if n], check=False)
    return _with_inferred_outputs(model), feeds


def _with_inferred_outputs(model):
    """``model`` with the output shapes ONNX infers (the full checker wants them), checked."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    for output, found in zip(model.graph.output, inferred.graph.output, strict=True):
        output.type.CopyFrom(found.type)
    onnx.checker.check_model(model, full_check=True)
    return model


def _sequence_first_oracle(model, feeds):
    """onnxruntime CPU's layout-0 kernel on the feeds transposed in numpy, its outputs transposed back."""
    sequence_first = copy_model(model)
    (node,) = sequence_first.graph.node
    kept = [a for a in node.attribute if a.name != "layout"]
    del node.attribute[:]
    node.attribute.extend(kept)
    for value in [*sequence_first.graph.input, *sequence_first.graph.output]:
        value.type.tensor_type.ClearField("shape")  # inputs are fed transposed
    swapped = {
        n: v.transpose(_SWAP_LEADING) if n in ("X", "initial_h", "initial_c") else v for n, v in feeds.items()
    }
    outputs = run_ort(sequence_first, swapped)
    return {
        n: v.transpose(2, 0, 1, 3) if n == "Y" else v.transpose(_SWAP_LEADING) for n, v in outputs.items()
    }


def _lowered_outputs(model, feeds):
    lowered = lt.lower(model)
    lt.assert_lowered(lowered)
    assert lt.op_types(lowered) <= {model.graph.node[0].op_type, "Transpose"}
    return run_ort(lowered, feeds)


def test_onnxruntime_cpu_refuses_batch_first():
    """Why the oracles: onnxruntime CPU has no layout=1 kernel."""
    model, feeds = _recurrent_case("GRU", 2, 3, 2, 4, "forward", 0)
    with pytest.raises(Exception, match="(?i)batchwise"):
        run_ort(model, feeds)


def test_layout_zero_is_dropped():
    model, feeds = _recurrent_case("RNN", 2, 3, 2, 4, "forward", 1)
    for attr in model.graph.node[0].attribute:
        if attr.name == "layout":
            attr.i = 0
    for value in model.graph.output:
        value.type.tensor_type.ClearField("shape")  # X now reads as [seq, batch, input]
    lowered = lt.lower_and_compare(_with_inferred_outputs(model), feeds)
    assert lt.op_types(lowered) == {"RNN"}
    assert "layout" not in {a.name for a in lowered.graph.node[0].attribute}


@pytest.mark.parametrize("op_type", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_same_outputs_as_the_onnx_reference(op_type, direction):
    extras = ("B", "initial_h", "initial_c") if op_type == "LSTM" else ("B", "initial_h")
    model, feeds = _recurrent_case(op_type, 3, 5, 4, 6, direction, 2, extras)
    expected = ReferenceEvaluator(model).run(None, feeds)
    names = [o.name for o in model.graph.output]
    assert_same_outputs(dict(zip(names, expected, strict=True)), _lowered_outputs(model, feeds), atol=1e-5)


def test_realistic_bidirectional_lstm_matches():
    """Batch 8, 64 steps, 128 features, 256 hidden units each way, all outputs and initial states."""
    model, feeds = _recurrent_case(
        "LSTM", 8, 64, 128, 256, "bidirectional", 3, ("B", "initial_h", "initial_c")
    )
    assert_same_outputs(_sequence_first_oracle(model, feeds), _lowered_outputs(model, feeds), atol=1e-5)
    expected = dict(zip(["Y", "Y_h", "Y_c"], ReferenceEvaluator(model).run(None, feeds), strict=True))
    assert_same_outputs(expected, _lowered_outputs(model, feeds), atol=1e-5)


@lt.property_test(
    op_type=st.sampled_from(sorted(_GATES)),
    direction=st.sampled_from(["forward", "reverse", "bidirectional"]),
    dims=st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 4), st.integers(1, 4)),
    data=st.data(),
    seed=lt.seeds,
)
def test_same_outputs_as_the_sequence_first_kernel(op_type, direction, dims, data, seed):
    optional = ["B", "sequence_lens", "initial_h"] + (["initial_c", "P"] if op_type == "LSTM" else [])
    extras = data.draw(st.lists(st.sampled_from(optional), unique=True))
    outputs = data.draw(st.lists(st.sampled_from(_OUTPUTS[op_type]), min_size=1, unique=True))
    model, feeds = _recurrent_case(op_type, *dims, direction, seed, extras, outputs)
    assert_same_outputs(_sequence_first_oracle(model, feeds), _lowered_outputs(model, feeds), atol=1e-5)
