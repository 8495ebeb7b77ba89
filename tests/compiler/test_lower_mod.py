"""Mod-28 with fmod=0 on floats (A - floor(A / B) * B, B's sign) as Mod(fmod=1) moved to B's sign.

The source graph runs on onnxruntime CPU (its Mod kernel computes fmod=0 on floats as Python's %, the
meaning Mod-28 wrote down), the lowered opset-11 graph too; both are also held to numpy's ``np.mod``,
ONNX's reference, including signed zeros and the special cases Mod-28 lists (inf, zero divisors, NaN).
"""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import FLOAT, FLOAT16, INT32, run_ort
from hypothesis import strategies as st

_DTYPES = {FLOAT: np.float32, FLOAT16: np.float16}
_EDGES = [0.0, -0.0, 1.0, -1.0, 2.5, -2.5, np.inf, -np.inf, np.nan, 1e-3, -7.0, 3.0]


def _mod_model(elem_type, shape_a, shape_b, fmod=0, opset=28):
    return lt.one_node_model(
        "Mod",
        [("a", elem_type, shape_a), ("b", elem_type, shape_b)],
        [("y", elem_type, None)],
        opset=opset,
        fmod=fmod,
    )


def _assert_matches_reference(model, feeds):
    lowered = lt.lower(model)
    lt.assert_lowered(lowered)
    want = np.mod(feeds["a"], feeds["b"])
    for name, got in (
        ("onnxruntime, source", run_ort(model, feeds)["y"]),
        ("lowered", run_ort(lowered, feeds)["y"]),
    ):
        np.testing.assert_array_equal(got, want, err_msg=name)
        finite_zero = (want == 0) & ~np.isnan(want)
        np.testing.assert_array_equal(
            np.signbit(got[finite_zero]), np.signbit(want[finite_zero]), err_msg=name
        )
    return lowered


def test_every_pair_of_special_values_matches_np_mod():
    edges = np.array(_EDGES, np.float32)
    a, b = np.meshgrid(edges, edges)
    for elem_type, dtype in _DTYPES.items():
        model = _mod_model(elem_type, a.shape, b.shape)
        _assert_matches_reference(model, {"a": a.astype(dtype), "b": b.astype(dtype)})


@lt.property_test(
    elem_type=st.sampled_from(sorted(_DTYPES)),
    shape=lt.shapes(1, 3),
    broadcast_b=st.booleans(),
    seed=lt.seeds,
)
def test_float_fmod_0_matches(elem_type, shape, broadcast_b, seed):
    shape_b = (1,) if broadcast_b else shape
    dtype = _DTYPES[elem_type]
    feeds = {
        "a": lt.random_array(seed, shape, dtype, -50, 50),
        "b": lt.random_array(seed + 1, shape_b, dtype, -9, 9),
    }
    lowered = _assert_matches_reference(_mod_model(elem_type, shape, shape_b), feeds)
    assert "Where" in lt.op_types(lowered)


def test_integer_and_fmod_1_mods_stay_one_node():
    for elem_type, fmod in ((INT32, 0), (INT32, 1), (FLOAT, 1)):
        model = _mod_model(elem_type, (4,), (4,), fmod=fmod)
        dtype = np.int32 if elem_type == INT32 else np.float32
        feeds = {"a": np.array([7, -7, 5, -3], dtype), "b": np.array([3, 3, -2, -4], dtype)}
        lowered = lt.lower_and_compare(model, feeds)
        assert [n.op_type for n in lowered.graph.node] == ["Mod"]
