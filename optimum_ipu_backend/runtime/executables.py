"""Compiled executables, one per set of static input shapes, in memory and in the on-disk cache.

An IPU executable has one fixed shape. The first call of a shape signature looks in the executable
cache (a new process reuses what an earlier one compiled); on a miss it legalizes the graph for that
shape, compiles it on the engine and stores both. Concurrent first calls of one signature compile
once: a per-key lock in this process, and the cache's file lock across processes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from optimum_ipu_backend.engines.base import CompileOptions, Engine, Executable
from optimum_ipu_backend.runtime.boundary import to_device_dtype
from optimum_ipu_backend.runtime.executable_cache import CacheKey, ExecutableCache
from optimum_ipu_backend.runtime.progress import step_progress

_logger = logging.getLogger(__name__)

LEGALIZED_GRAPH_FILE = "legalized.onnx"
ShapeKey = tuple[tuple[str, object], ...]


@dataclass
class CompiledEntry:
    shapes: dict[str, tuple[int, ...]]
    branches: dict[str, bool]
    executable: Executable
    seconds: float
    source: str  # "compiled" or "cache"
    calls: int = 0
    device_input_dtypes: dict[str, np.dtype] = field(default_factory=dict)


class ExecutableTable:
    """Legalizes and compiles ``model`` per static input-shape signature and runs micro-batches/steps."""

    def __init__(
        self,
        load_model: Callable[[], onnx.ModelProto],
        engine: Engine,
        options: CompileOptions,
        *,
        graph_digest: str,
        branch_inputs: Sequence[str] = (),
        cache: ExecutableCache | None = None,
        progress: bool = False,
    ) -> None:
        # The graph is parsed only when an executable must be built (a warm start builds none).
        self._load_model = load_model
        self._engine = engine
        self._options = options
        self._graph_digest = graph_digest
        self._cache = cache
        self._progress = progress
        self.branch_inputs = frozenset(branch_inputs)
        self._entries: dict[ShapeKey, CompiledEntry] = {}
        self._key_locks: dict[ShapeKey, threading.Lock] = {}
        self._lock = threading.Lock()

    def _legalized_bytes(self, shapes: dict[str, tuple[int, ...]], branches: dict[str, bool]) -> bytes:
        # The compiler is imported on the first cache miss, keeping it off warm loads.
        from optimum_ipu_backend.compiler import legalize
        from optimum_ipu_backend.compiler.passes.fold_constants import bind_constant_inputs

        model = self._load_model()
        if branches:
            model = bind_constant_inputs(model, branches)
        passes = 8  # an upper bound of the pipeline's length, for the bar
        with step_progress(f"legalizing for {shapes}", passes, self._progress) as advance:
            legalized = legalize(model, shapes, precision=self._options.precision, progress=advance)
        return legalized.model.SerializeToString()

    def _cache_key(self, shapes: dict[str, tuple[int, ...]], branches: dict[str, bool]) -> CacheKey:
        return CacheKey.build(
            graph=self._graph_digest,
            shapes=shapes,
            precision=self._options.precision,
            engine=self._engine.name,
            sdk_version=self._engine.sdk_version,
            options={
                "branches": branches,
                "device": self._options.device,
                "device_iterations": self._options.device_iterations,
                "replicas": self._options.replicas,
            },
        )

    def _compile(self, shapes: dict[str, tuple[int, ...]], branches: dict[str, bool]) -> CompiledEntry:
        started = time.perf_counter()
        if self._cache is None:
            executable = self._engine.compile(self._legalized_bytes(shapes, branches), self._options)
            source = "compiled"
        else:
            built: dict[str, Executable] = {}

            def build(directory: Path) -> None:
                graph = self._legalized_bytes(shapes, branches)
                built["executable"] = self._engine.compile(graph, self._options)
                (directory / LEGALIZED_GRAPH_FILE).write_bytes(graph)
                for name, payload in self._engine.export(built["executable"]).items():
                    (directory / name).write_bytes(payload)

            key = self._cache_key(shapes, branches)
            entry = self._cache.get_or_create(
                key,
                build,
                meta={"shapes": {k: list(v) for k, v in shapes.items()}, "engine": self._engine.name},
            )
            if "executable" in built:
                executable, source = built["executable"], "compiled"
            else:
                artifacts = {name: path for name, path in entry.files.items() if name != LEGALIZED_GRAPH_FILE}
                executable = self._engine.load(entry.file(LEGALIZED_GRAPH_FILE), artifacts, self._options)
                source = "cache"
        seconds = time.perf_counter() - started
        _logger.info("%s %s for %s in %.2f s", source, self._engine.describe(), shapes, seconds)
        device_dtypes = {spec.name: spec.dtype for spec in executable.inputs}
        return CompiledEntry(shapes, branches, executable, seconds, source, device_input_dtypes=device_dtypes)

    @property
    def count(self) -> int:
        """How many executables this table holds."""
        return len(self._entries)

    def has(self, shapes: Mapping[str, tuple[int, ...]], branches: Mapping[str, bool]) -> bool:
        """Whether the executable for these shapes is already loaded or compiled."""
        return _shape_key(shapes, branches) in self._entries

    def entry_for(self, shapes: Mapping[str, tuple[int, ...]], branches: Mapping[str, bool]) -> CompiledEntry:
        key = _shape_key(shapes, branches)
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        with self._lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._compile(dict(shapes), dict(branches))
                self._entries[key] = entry
        return entry

    def run_step(
        self,
        micro_shapes: Mapping[str, tuple[int, ...]],
        branches: Mapping[str, bool],
        feed: Mapping[str, np.ndarray],
    ) -> dict[str, np.ndarray]:
        """Run one device step. ``feed`` arrays are laid out ``[device_iterations, replicas, *shape]``
        where ``micro_shapes`` gives each input's compiled shape."""
        entry = self.entry_for(micro_shapes, branches)
        device_feed = {
            name: to_device_dtype(name, feed[name], dtype)
            for name, dtype in entry.device_input_dtypes.items()
        }
        options = self._options
        outputs = entry.executable.run_step(device_feed, options.device_iterations, options.replicas)
        entry.calls += 1  # a statistic; an occasional lost increment under threads is acceptable
        return outputs

    @property
    def cache_description(self) -> str:
        return "disabled" if self._cache is None else str(self._cache.root)

    def statistics(self) -> list[dict[str, object]]:
        """Each executable with its shapes, where it came from, its load time and the calls it served."""
        return [
            {
                "shapes": entry.shapes,
                "branches": entry.branches,
                "source": entry.source,
                "compile_seconds": entry.seconds,
                "calls": entry.calls,
            }
            for entry in self._entries.values()
        ]


def _shape_key(shapes: Mapping[str, tuple[int, ...]], branches: Mapping[str, bool]) -> ShapeKey:
    return tuple(sorted(shapes.items())) + tuple(sorted(branches.items()))
