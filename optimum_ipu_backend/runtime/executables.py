"""Compiled executables, one per set of input shapes, created on first use and reused after.

An IPU executable has one fixed shape, so every distinct input-shape signature is legalized and
compiled once and then served from this table. Compilation of one signature happens once even when
several threads ask for it at the same time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx

from optimum_ipu_backend.compiler import legalize
from optimum_ipu_backend.compiler.passes.fold_constants import bind_constant_inputs
from optimum_ipu_backend.engines.base import CompileOptions, Engine, Executable
from optimum_ipu_backend.runtime.boundary import to_device_dtype, to_host_dtype

_logger = logging.getLogger(__name__)

ShapeKey = tuple[tuple[str, object], ...]


def branch_inputs(model: onnx.ModelProto) -> frozenset[str]:
    """Boolean graph inputs that are the condition of an ``If`` (optimum's ``use_cache_branch``).

    The two branches of a merged decoder return tensors of different shapes, so no single static
    graph serves both: each value gets its own executable, with the branch chosen at compile time.
    """
    bool_inputs = {
        value.name for value in model.graph.input if value.type.tensor_type.elem_type == onnx.TensorProto.BOOL
    }
    return frozenset(
        node.input[0] for node in model.graph.node if node.op_type == "If" and node.input[0] in bool_inputs
    )


@dataclass
class CompiledEntry:
    shapes: dict[str, tuple[int, ...]]
    executable: Executable
    compile_seconds: float
    calls: int = 0
    device_input_dtypes: dict[str, np.dtype] = field(default_factory=dict)


class ExecutableTable:
    """Legalizes and compiles ``model`` per input-shape signature, and runs feeds on the right one."""

    def __init__(
        self,
        model: onnx.ModelProto,
        engine: Engine,
        options: CompileOptions,
        output_dtypes: Mapping[str, np.dtype],
    ) -> None:
        self._model = model
        self._engine = engine
        self._options = options
        self._output_dtypes = dict(output_dtypes)
        self._branch_inputs = branch_inputs(model)
        self._entries: dict[ShapeKey, CompiledEntry] = {}
        self._key_locks: dict[ShapeKey, threading.Lock] = {}
        self._lock = threading.Lock()

    def _compile(self, shapes: dict[str, tuple[int, ...]], branches: dict[str, bool]) -> CompiledEntry:
        started = time.perf_counter()
        model = bind_constant_inputs(self._model, branches) if branches else self._model
        legalized = legalize(model, shapes, precision=self._options.precision)
        executable = self._engine.compile(legalized.model.SerializeToString(), self._options)
        seconds = time.perf_counter() - started
        _logger.info("compiled %s for shapes %s in %.2f s", self._engine.describe(), shapes, seconds)
        device_dtypes = {spec.name: spec.dtype for spec in executable.inputs}
        return CompiledEntry(shapes, executable, seconds, device_input_dtypes=device_dtypes)

    def entry_for(self, feed: Mapping[str, np.ndarray]) -> CompiledEntry:
        branches = {name: bool(np.asarray(feed[name]).reshape(-1)[0]) for name in self._branch_inputs}
        shapes = {name: tuple(array.shape) for name, array in feed.items() if name not in branches}
        key: ShapeKey = tuple(sorted(shapes.items())) + tuple(sorted(branches.items()))
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        with self._lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._compile(shapes, branches)
                self._entries[key] = entry
        return entry

    def run(self, feed: Mapping[str, np.ndarray], output_names: Sequence[str]) -> list[np.ndarray]:
        entry = self.entry_for(feed)
        device_feed = {
            name: to_device_dtype(name, feed[name], dtype)
            for name, dtype in entry.device_input_dtypes.items()
        }
        results = entry.executable.run(device_feed)
        entry.calls += 1  # a statistic; an occasional lost increment under threads is acceptable
        return [to_host_dtype(results[name], self._output_dtypes[name]) for name in output_names]

    def statistics(self) -> list[dict[str, object]]:
        """Each compiled executable with its shapes, compile time and the calls it served."""
        return [
            {"shapes": entry.shapes, "compile_seconds": entry.compile_seconds, "calls": entry.calls}
            for entry in self._entries.values()
        ]
