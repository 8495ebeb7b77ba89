"""``runtime.boundary``: host values narrowed to the device's dtypes are checked, never wrapped or
rounded."""

from __future__ import annotations

import numpy as np
import pytest

from optimum_ipu_backend.runtime.boundary import BoundaryCastError, to_device_dtype


def test_integers_that_float32_holds_exactly_are_converted():
    values = np.array([0, 1, -(2**24), 2**24], np.int64)
    converted = to_device_dtype("mask", values, np.dtype(np.float32))
    assert converted.dtype == np.float32
    np.testing.assert_array_equal(converted.astype(np.int64), values)


@pytest.mark.parametrize(
    ("dtype", "value"), [(np.float32, 2**24 + 1), (np.float16, 2049), (np.float32, -(2**30))]
)
def test_an_integer_a_float_would_round_is_refused_naming_the_input(dtype, value):
    with pytest.raises(BoundaryCastError, match=f"input 'mask' holds {abs(value)}; the device keeps it as"):
        to_device_dtype("mask", np.array([1, value], np.int32), np.dtype(dtype))


def test_an_int64_beyond_int32_is_refused():
    with pytest.raises(BoundaryCastError, match="outside the device's int32 range"):
        to_device_dtype("input_ids", np.array([2**31], np.int64), np.dtype(np.int32))
