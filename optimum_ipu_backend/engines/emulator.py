"""The host emulator engine: the exact graph an IPU would get, run by onnxruntime on the CPU.

It enforces what it can of the IPU contract, so that a pipeline that works here fails for the same
reasons on hardware: one fixed shape per executable, only dtypes Poplar has, and feeds whose shape
and dtype equal the compiled ones. It is not a cycle or memory simulator.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from optimum_ipu_backend.engines.base import (
    Availability,
    CompileOptions,
    Engine,
    EngineContractError,
    Executable,
    TensorSpec,
)
from optimum_ipu_backend.engines.probe import EMULATION_NOTICE

_logger = logging.getLogger(__name__)

# The dtypes Poplar has a device type for (per the SDK's documentation: no INT64, DOUBLE, BFLOAT16), as
# onnxruntime names them.
_ORT_TYPES = {
    f"tensor({name})": dtype
    for name, dtype in (
        ("float", np.float32),
        ("float16", np.float16),
        ("int32", np.int32),
        ("uint32", np.uint32),
        ("int16", np.int16),
        ("uint16", np.uint16),
        ("int8", np.int8),
        ("uint8", np.uint8),
        ("bool", np.bool_),
    )
}


def _io_specs(values) -> tuple[TensorSpec, ...]:
    """Specs from onnxruntime's NodeArgs, refusing what an IPU executable cannot have."""
    specs = []
    for value in values:
        if value.type not in _ORT_TYPES:
            raise EngineContractError(
                f"graph input/output {value.name!r} has type {value.type}, which the IPU does not have; "
                "the compiler's int64_to_int32 / precision passes must run first"
            )
        if not all(isinstance(dim, int) for dim in value.shape):
            raise EngineContractError(
                f"graph input/output {value.name!r} has a dynamic shape {value.shape}; an IPU executable "
                "has one fixed shape"
            )
        specs.append(TensorSpec(value.name, tuple(value.shape), np.dtype(_ORT_TYPES[value.type])))
    return tuple(specs)


def _drop_session(holder: dict) -> None:
    holder.clear()  # the onnxruntime session and its memory go with the last reference


class HostEmulatorExecutable(Executable):
    def __init__(self, model: str, options: CompileOptions) -> None:
        import onnxruntime as ort

        session_options = ort.SessionOptions()
        if options.threads:
            session_options.intra_op_num_threads = options.threads
        self._session = ort.InferenceSession(
            model, sess_options=session_options, providers=["CPUExecutionProvider"]
        )
        self.inputs = _io_specs(self._session.get_inputs())
        self.outputs = _io_specs(self._session.get_outputs())
        self._output_names = [spec.name for spec in self.outputs]
        self._holder = {"session": self._session}
        self._on_close(_drop_session, self._holder)

    def close(self) -> None:
        super().close()
        self._session = None

    def run(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self._check_open()
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
    devices = ("emulator",)
    priority = 0
    # onnxruntime sessions may be run from several threads at once.
    thread_safe = True
    # It runs a sharded graph as it is: onnxruntime skips the ``__``-prefixed placement attributes.
    shards = True

    @classmethod
    def probe(cls) -> Availability:
        return Availability(True, f"device 'emulator' was asked for: {EMULATION_NOTICE}")

    def compile(self, graph: Path, options: CompileOptions, artifacts: Path | None = None) -> Executable:
        self._check_open()
        _logger.info("compiling for the host emulator (%s)", EMULATION_NOTICE)
        # onnxruntime reads the file itself (external data beside it included): no copy through Python.
        return self._track(HostEmulatorExecutable(str(graph), options))

    def describe(self) -> str:
        return f"emulator ({EMULATION_NOTICE})"
