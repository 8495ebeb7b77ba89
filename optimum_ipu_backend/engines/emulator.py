"""The host emulator engine: the exact graph an IPU would get, run by onnxruntime on the CPU.

It enforces what it can of the IPU contract, so that a pipeline that works here fails for the same
reasons on hardware: one fixed shape per executable, only dtypes Poplar has, and feeds whose shape
and dtype equal the compiled ones. It is not a cycle or memory simulator.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from optimum_ipu_backend.engines.base import (
    CompileOptions,
    Engine,
    EngineContractError,
    Executable,
    TensorSpec,
)
from optimum_ipu_backend.engines.probe import EMULATION_NOTICE

_logger = logging.getLogger(__name__)

# The dtypes Poplar has a device type for (graphcore-sdk-api.md §2.3; no INT64, DOUBLE, BFLOAT16), as
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


OPTIMIZED_GRAPH_FILE = "emulator-optimized.onnx"


class HostEmulatorExecutable(Executable):
    """An onnxruntime CPU session over the legalized graph.

    ``optimized`` says whether ``model`` is onnxruntime's own optimized form of the graph (the
    emulator's "compiled executable", cached beside the legalized graph): then it is loaded with graph
    optimizations off, which is what makes a warm load as fast as a plain onnxruntime one.
    """

    def __init__(
        self, model: bytes | str, options: CompileOptions, optimized: bool = False, save_to: str | None = None
    ) -> None:
        import onnxruntime as ort

        session_options = ort.SessionOptions()
        if options.threads:
            session_options.intra_op_num_threads = options.threads
        # EXTENDED, not ALL: ALL adds layout rewrites for this very CPU that must not be cached.
        session_options.graph_optimization_level = (
            ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            if optimized
            else ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        )
        if save_to is not None:
            session_options.optimized_model_filepath = save_to
        self._session = ort.InferenceSession(
            model, sess_options=session_options, providers=["CPUExecutionProvider"]
        )
        self.inputs = _io_specs(self._session.get_inputs())
        self.outputs = _io_specs(self._session.get_outputs())
        self._output_names = [spec.name for spec in self.outputs]
        self.optimized_graph: bytes | None = None

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
        _logger.info("compiling for the host emulator (%s)", EMULATION_NOTICE)
        with tempfile.TemporaryDirectory(prefix="optimum-ipu-emulator-") as scratch:
            target = os.path.join(scratch, OPTIMIZED_GRAPH_FILE)
            executable = HostEmulatorExecutable(model_bytes, options, save_to=target)
            if os.path.exists(target) and not any(
                name != OPTIMIZED_GRAPH_FILE for name in os.listdir(scratch)
            ):
                # a single self-contained file (graphs over 2 GB spill weights beside it: not cached)
                with open(target, "rb") as handle:
                    executable.optimized_graph = handle.read()
        return executable

    def export(self, executable: Executable) -> dict[str, bytes]:
        optimized = getattr(executable, "optimized_graph", None)
        return {} if optimized is None else {OPTIMIZED_GRAPH_FILE: optimized}

    def load(self, graph_path: Path, artifacts: Mapping[str, Path], options: CompileOptions) -> Executable:
        # onnxruntime reads the cached file itself: no copy of the weights through Python.
        if OPTIMIZED_GRAPH_FILE in artifacts:
            return HostEmulatorExecutable(str(artifacts[OPTIMIZED_GRAPH_FILE]), options, optimized=True)
        return HostEmulatorExecutable(str(graph_path), options)

    def describe(self) -> str:
        return f"emulator ({EMULATION_NOTICE})"
