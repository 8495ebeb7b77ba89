"""The host emulator engine: the exact graph an IPU would get, run by onnxruntime on the CPU.

It enforces what it can of the IPU contract, so that a pipeline that works here fails for the same
reasons on hardware: one fixed shape per executable, only dtypes Poplar has, and feeds whose shape
and dtype equal the compiled ones. It is not a cycle or memory simulator.

Carried state (``base.state_updates``): onnxruntime has no ``ai.graphcore`` CopyVarUpdate, so the emulator
runs a copy of the graph where each state tensor is an input and its update an output, and keeps the
values in host memory between runs, where an IPU keeps them in its own. What crosses the link is then
exactly what crosses it on a device: the feed, the outputs, and ``write_state``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from optimum_ipu_backend.engines.base import (
    STATE_UPDATE_DOMAIN,
    Availability,
    CompileOptions,
    Engine,
    EngineContractError,
    Executable,
    TensorSpec,
    state_updates,
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
    shutil.rmtree(holder.pop("scratch", None) or "", ignore_errors=True)


#: The output an emulated graph gives for a state tensor's new value.
_NEXT_STATE = "ipu_emulator_next_state::"


def _stateless_copy(model_path: str) -> tuple[str, dict[str, str]] | None:
    """For a graph with carried state: a copy where each state tensor is an input and its update the output
    ``_NEXT_STATE + name``, written to a new directory (with the weights file beside the graph);
    its path and the state mapping. None for a graph without state (run as it is)."""
    import onnx
    from onnx import helper

    model = onnx.load(model_path, load_external_data=False)
    graph = model.graph
    updates = state_updates(graph)
    if not updates:
        return None
    kept = []
    for node in graph.node:
        if node.domain == STATE_UPDATE_DOMAIN:  # CopyVarUpdate returns the updated variable: its updater
            kept.append(helper.make_node("Identity", [node.input[1]], [node.output[0]]))
        else:
            kept.append(node)
    states = [tensor for tensor in graph.initializer if tensor.name in updates]
    others = [tensor for tensor in graph.initializer if tensor.name not in updates]
    del graph.node[:]
    graph.node.extend(kept)
    del graph.initializer[:]
    graph.initializer.extend(others)
    for tensor in states:
        graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
        graph.node.append(helper.make_node("Identity", [updates[tensor.name]], [_NEXT_STATE + tensor.name]))
        graph.output.append(
            helper.make_tensor_value_info(_NEXT_STATE + tensor.name, tensor.data_type, list(tensor.dims))
        )
    imports = [entry for entry in model.opset_import if entry.domain != STATE_UPDATE_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(imports)
    scratch = tempfile.mkdtemp(prefix="optimum-ipu-emulated-")
    source_dir = os.path.dirname(os.path.abspath(model_path))
    for location in {
        entry.value for tensor in others for entry in tensor.external_data if entry.key == "location"
    }:
        # onnxruntime resolves links and refuses weights outside the graph's directory: a hard link where
        # the file system allows one, else a copy
        source, target = os.path.join(source_dir, location), os.path.join(scratch, location)
        try:
            os.link(source, target)
        except OSError:
            shutil.copyfile(source, target)
    path = os.path.join(scratch, os.path.basename(model_path))
    onnx.save(model, path)
    return path, updates


class HostEmulatorExecutable(Executable):
    def __init__(self, model: str, options: CompileOptions) -> None:
        import onnxruntime as ort

        session_options = ort.SessionOptions()
        if options.threads:
            session_options.intra_op_num_threads = options.threads
        stateless = _stateless_copy(model)
        self._session = ort.InferenceSession(
            model if stateless is None else stateless[0],
            sess_options=session_options,
            providers=["CPUExecutionProvider"],
        )
        self._holder = {
            "session": self._session,
            "scratch": None if stateless is None else os.path.dirname(stateless[0]),
        }
        self._on_close(_drop_session, self._holder)
        names = set() if stateless is None else set(stateless[1])
        specs = _io_specs(self._session.get_inputs())
        self.inputs = tuple(spec for spec in specs if spec.name not in names)
        self.state = tuple(spec for spec in specs if spec.name in names)
        self.outputs = tuple(
            spec for spec in _io_specs(self._session.get_outputs()) if not spec.name.startswith(_NEXT_STATE)
        )
        self._output_names = [spec.name for spec in self.outputs]
        # the device's copy of the state: zeros until written (the runtime writes before it relies on it)
        self._state_values = {spec.name: np.zeros(spec.shape, spec.dtype) for spec in self.state}
        self._state_lock = threading.Lock()

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
        inputs = {spec.name: feed[spec.name] for spec in self.inputs}
        if not self.state:
            results = self._session.run(self._output_names, inputs)
            return dict(zip(self._output_names, results, strict=True))
        fetched = [*self._output_names, *(_NEXT_STATE + spec.name for spec in self.state)]
        with self._state_lock:  # one run at a time reads and replaces the state
            results = self._session.run(fetched, {**inputs, **self._state_values})
            for spec, value in zip(self.state, results[len(self._output_names) :], strict=True):
                self._state_values[spec.name] = value
        return dict(zip(self._output_names, results, strict=False))

    def write_state(self, values: Mapping[str, np.ndarray]) -> None:
        self._check_open()
        self._check_state(values)
        with self._state_lock:
            for name, value in values.items():
                self._state_values[name] = np.array(value, copy=True)


class HostEmulatorEngine(Engine):
    name = "emulator"
    devices = ("emulator",)
    priority = 0
    # onnxruntime sessions may be run from several threads at once.
    thread_safe = True
    # It runs a sharded graph as it is: onnxruntime skips the ``__``-prefixed placement attributes.
    shards = True
    #: A test hook: called with the graph before each compile, so a test can make a compile as slow as an
    #: IPU's (wait on an event) without any sleep here. None in production.
    compile_hook: Callable[[Path], None] | None = None

    @classmethod
    def probe(cls) -> Availability:
        return Availability(True, f"device 'emulator' was asked for: {EMULATION_NOTICE}")

    def compile(self, graph: Path, options: CompileOptions, artifacts: Path | None = None) -> Executable:
        self._check_open()
        if self.compile_hook is not None:
            self.compile_hook(graph)
        _logger.info("compiling for the host emulator (%s)", EMULATION_NOTICE)
        # onnxruntime reads the file itself (external data beside it included): no copy through Python.
        return self._track(HostEmulatorExecutable(str(graph), options))

    def describe(self) -> str:
        return f"emulator ({EMULATION_NOTICE})"
