"""IO binding on host memory, for ``use_io_binding=True``.

optimum-onnx binds torch tensors by raw pointer (``bind_input(name, "cpu", 0, np_type, shape, ptr)``)
and reads results from the output buffers it bound. An IPU is fed from host memory anyway, so the
binding reads inputs from those pointers when the session runs and copies results into the bound
output buffers.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from optimum_ipu_backend.errors import InvalidFeedError


class IOBindingError(InvalidFeedError):
    pass


@dataclass
class _Binding:
    dtype: np.dtype | None
    shape: tuple[int, ...] | None
    pointer: int | None
    array: np.ndarray | None = None  # bound by value (bind_cpu_input) or produced by a run

    def view(self, name: str) -> np.ndarray:
        if self.array is not None:
            return self.array
        if self.pointer is None or self.dtype is None or self.shape is None:
            raise IOBindingError(f"{name!r} is bound without a buffer")
        count = int(np.prod(self.shape, dtype=np.int64))
        if count == 0:
            return np.empty(self.shape, dtype=self.dtype)
        raw = (ctypes.c_char * (count * self.dtype.itemsize)).from_address(self.pointer)
        return np.frombuffer(raw, dtype=self.dtype, count=count).reshape(self.shape)


class _HostValue:
    """Stands in for ``OrtValue`` in ``get_outputs()``."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def numpy(self) -> np.ndarray:
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def device_name(self) -> str:
        return "cpu"


def _check_device(name: str, device_type: str) -> None:
    if str(device_type).lower() != "cpu":
        raise IOBindingError(
            f"{name!r} is bound to device {device_type!r}; the IPU provider is fed from host memory, so "
            "bind CPU tensors (optimum uses the CPU for this provider unless the model was moved)"
        )


class HostIOBinding:
    """The subset of ``onnxruntime.IOBinding`` that optimum-onnx uses, on host memory."""

    def __init__(
        self,
        run: Callable[[Sequence[str] | None, dict[str, np.ndarray]], list[np.ndarray]],
        output_names: Sequence[str],
    ) -> None:
        self._run = run
        self._all_outputs = list(output_names)
        self._inputs: dict[str, _Binding] = {}
        self._outputs: dict[str, _Binding] = {}
        self._results: list[np.ndarray] = []

    def bind_cpu_input(self, name: str, array: np.ndarray) -> None:
        self._inputs[name] = _Binding(None, None, None, np.asarray(array, order="C"))

    def bind_input(
        self,
        name: str,
        device_type: str,
        device_id: int,
        element_type: Any,
        shape: Sequence[int],
        buffer_ptr: int,
    ) -> None:
        _check_device(name, device_type)
        self._inputs[name] = _Binding(np.dtype(element_type), tuple(int(d) for d in shape), int(buffer_ptr))

    def bind_output(
        self,
        name: str,
        device_type: str = "cpu",
        device_id: int = 0,
        element_type: Any = None,
        shape: Sequence[int] | None = None,
        buffer_ptr: int | None = None,
    ) -> None:
        _check_device(name, device_type)
        if name not in self._all_outputs:
            raise IOBindingError(f"{name!r} is not an output of this model; outputs: {self._all_outputs}")
        if buffer_ptr is not None and (element_type is None or shape is None):
            raise IOBindingError(f"output {name!r}: a buffer pointer needs element_type and shape")
        self._outputs[name] = _Binding(
            None if element_type is None else np.dtype(element_type),
            None if shape is None else tuple(int(d) for d in shape),
            None if buffer_ptr is None else int(buffer_ptr),
        )

    def clear_binding_inputs(self) -> None:
        self._inputs.clear()

    def clear_binding_outputs(self) -> None:
        self._outputs.clear()
        self._results = []

    def synchronize_inputs(self) -> None:  # host memory: nothing in flight
        pass

    def synchronize_outputs(self) -> None:
        pass

    def run(self) -> None:
        """Run the session on the bound inputs and fill the bound outputs."""
        feed = {name: binding.view(name).copy() for name, binding in self._inputs.items()}
        names = list(self._outputs) or self._all_outputs
        results = self._run(names, feed)
        for name, result in zip(names, results, strict=True):
            binding = self._outputs.get(name)
            if binding is None or binding.pointer is None:
                if binding is not None:
                    binding.array = result
                continue
            if binding.shape != tuple(result.shape):
                raise IOBindingError(
                    f"output {name!r} was bound with shape {list(binding.shape or ())} "
                    "but the model produced "
                    f"{list(result.shape)}"
                )
            np.copyto(binding.view(name), result.astype(binding.dtype, copy=False))
        self._results = results

    def get_outputs(self) -> list[_HostValue]:
        return [_HostValue(array) for array in self._results]

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        return [array.copy() for array in self._results]
