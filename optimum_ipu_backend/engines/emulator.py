"""The host emulator engine: the exact graph an IPU would get, run by onnxruntime on the CPU.

It enforces what it can of the IPU contract, so that a pipeline that works here fails for the same
reasons on hardware: one fixed shape per executable, only dtypes Poplar has, and feeds whose shape
and dtype equal the compiled ones. It is not a cycle or memory simulator.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import onnx

from optimum_ipu_backend.engines.base import (
    CompileOptions,
    Engine,
    EngineContractError,
    Executable,
    TensorSpec,
)
from optimum_ipu_backend.engines.probe import EMULATION_NOTICE

_logger = logging.getLogger(__name__)

# Poplar device types (graphcore-sdk-api.md §2.3); INT64, DOUBLE and BFLOAT16 have no device type.
IPU_DTYPES = {
    onnx.TensorProto.FLOAT: np.dtype(np.float32),
    onnx.TensorProto.FLOAT16: np.dtype(np.float16),
    onnx.TensorProto.INT32: np.dtype(np.int32),
    onnx.TensorProto.UINT32: np.dtype(np.uint32),
    onnx.TensorProto.INT16: np.dtype(np.int16),
    onnx.TensorProto.UINT16: np.dtype(np.uint16),
    onnx.TensorProto.INT8: np.dtype(np.int8),
    onnx.TensorProto.UINT8: np.dtype(np.uint8),
    onnx.TensorProto.BOOL: np.dtype(np.bool_),
}


def _io_specs(values) -> tuple[TensorSpec, ...]:
    specs = []
    for value in values:
        tensor_type = value.type.tensor_type
        if tensor_type.elem_type not in IPU_DTYPES:
            raise EngineContractError(
                f"graph input/output {value.name!r} has dtype "
                f"{onnx.TensorProto.DataType.Name(tensor_type.elem_type)}, which the IPU does not have; "
                "the compiler's int64_to_int32 / precision passes must run first"
            )
        dims = []
        for dim in tensor_type.shape.dim:
            if not dim.HasField("dim_value"):
                raise EngineContractError(
                    f"graph input/output {value.name!r} has a dynamic dimension "
                    f"({dim.dim_param or '?'}); an IPU executable has one fixed shape"
                )
            dims.append(dim.dim_value)
        specs.append(TensorSpec(value.name, tuple(dims), IPU_DTYPES[tensor_type.elem_type]))
    return tuple(specs)


class HostEmulatorExecutable(Executable):
    def __init__(self, model: onnx.ModelProto, model_bytes: bytes, options: CompileOptions) -> None:
        import onnxruntime as ort

        initializer_names = {init.name for init in model.graph.initializer}
        self.inputs = _io_specs([v for v in model.graph.input if v.name not in initializer_names])
        self.outputs = _io_specs(model.graph.output)
        session_options = ort.SessionOptions()
        if options.threads:
            session_options.intra_op_num_threads = options.threads
        self._session = ort.InferenceSession(
            model_bytes, sess_options=session_options, providers=["CPUExecutionProvider"]
        )
        self._output_names = [spec.name for spec in self.outputs]

    def run(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        for spec in self.inputs:
            array = feed.get(spec.name)
            if array is None:
                raise EngineContractError(f"executable input {spec.name!r} was not fed")
            if array.shape != spec.shape or array.dtype != spec.dtype:
                raise EngineContractError(
                    f"executable input {spec.name!r} was compiled for {spec.dtype}{list(spec.shape)} and "
                    f"got {array.dtype}{list(array.shape)}; the runtime must pad or split to compiled shapes"
                )
        results = self._session.run(self._output_names, {spec.name: feed[spec.name] for spec in self.inputs})
        return dict(zip(self._output_names, results, strict=True))


class HostEmulatorEngine(Engine):
    name = "emulator"
    emulated = True

    def compile(self, model_bytes: bytes, options: CompileOptions) -> Executable:
        model = onnx.load_from_string(model_bytes)
        _logger.info("compiling for the host emulator (%s)", EMULATION_NOTICE)
        return HostEmulatorExecutable(model, model_bytes, options)

    def describe(self) -> str:
        return f"emulator ({EMULATION_NOTICE})"
