"""Host-side casts between what callers hold and what the device graph takes.

The legalized graph uses int32 where the exported one used int64, and fp16 where the user asked for
it. Callers keep their dtypes: narrowing is checked (a token id that does not fit in int32 is an
error, never a wrap-around), and outputs go back to the exported graph's declared dtypes.
"""

from __future__ import annotations

import numpy as np

from optimum_ipu_backend.errors import InvalidFeedError


class BoundaryCastError(InvalidFeedError):
    """A host value does not fit the device dtype."""


def to_device_dtype(name: str, array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if array.dtype == dtype:
        return np.asarray(array, order="C")
    if np.issubdtype(dtype, np.integer) and np.issubdtype(array.dtype, np.integer) and array.size:
        info = np.iinfo(dtype)
        low, high = array.min(), array.max()
        if low < info.min or high > info.max:
            raise BoundaryCastError(
                f"input {name!r} holds values in [{low}, {high}], outside the device's {dtype} range "
                f"[{info.min}, {info.max}]; the IPU has no 64-bit integers, so such values cannot be fed"
            )
    if np.issubdtype(dtype, np.floating) and np.issubdtype(array.dtype, np.integer) and array.size:
        exact = 2 ** (np.finfo(dtype).nmant + 1)  # every integer up to this magnitude is exact
        largest = int(np.abs(array.astype(np.int64)).max())
        if largest > exact:
            raise BoundaryCastError(
                f"input {name!r} holds {largest}; the device keeps it as {np.dtype(dtype).name}, exact for "
                f"integers up to {exact} only"
            )
    return np.asarray(array.astype(dtype, copy=False), order="C")


def to_host_dtype(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if array.dtype == dtype:
        return array
    return array.astype(dtype)
