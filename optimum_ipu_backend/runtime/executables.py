"""Compiled executables, one per set of static input shapes, in memory and in the on-disk cache.

An IPU executable has one fixed shape. The first call of a shape signature looks in the executable
cache (a new process reuses what an earlier one compiled); on a miss it legalizes the graph for that
shape, compiles it on the engine and stores both. Concurrent first calls of one signature compile
once: a per-key lock in this process, and the cache's file lock across processes.

Graphs go to engines as files (``legalized.onnx`` in the cache entry, its weights in the data file
``legalized.onnx.data`` beside it, written by ``compiler.external_data.save_graph`` straight from the
export's files), never as one serialized buffer: protobuf cannot serialize more than 2 GiB, and a copy
would double the memory. The data file is the same for every shape of one export and precision, so the
cache stores it once, with every shape's graph beside it (``ExecutableCache.get_or_create(shared=...)``).
An engine writes its own artifacts (PopART's ``.popef``) into the entry's ``artifacts/`` directory
while it compiles, so they fall under the cache's integrity checks. Calls into an engine that does not
declare itself thread-safe are serialized here.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

from optimum_ipu_backend.compiler.carried_state import ROWS_INPUT, carried_state_plan
from optimum_ipu_backend.engines.base import CompileOptions, Engine, EngineClosedError, Executable
from optimum_ipu_backend.runtime.boundary import to_device_dtype
from optimum_ipu_backend.runtime.cache_files import LEGALIZED_DIR, code_identity, read_record, write_record
from optimum_ipu_backend.runtime.executable_cache import CacheError, CacheKey, ExecutableCache
from optimum_ipu_backend.runtime.progress import step_progress

if TYPE_CHECKING:
    from optimum_ipu_backend.compiler.carried_state import CarriedStatePlan, CarryRequest

_logger = logging.getLogger(__name__)

LEGALIZED_GRAPH_FILE = "legalized.onnx"
LEGALIZED_DATA_FILE = f"{LEGALIZED_GRAPH_FILE}.data"
ARTIFACTS_DIR = "artifacts"
LEGALIZED_RECORD_FORMAT = 1  # of the records under cache_files.LEGALIZED_DIR
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
    #: What the executable keeps on the device between runs (a decode step's key/value cache), or None.
    carried: CarriedStatePlan | None = None
    #: Built on a background compile thread (``runtime.serving_plan``): no call waited for it.
    background: bool = False


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
        model_path: Path | None = None,
    ) -> None:
        # The graph is parsed only when an executable must be built (a warm start builds none).
        self._load_model = load_model
        self._engine = engine
        self._options = options
        self._graph_digest = graph_digest
        self._cache = cache
        self._progress = progress
        self.branch_inputs = frozenset(branch_inputs)
        self._model_path = model_path
        self._entries: dict[ShapeKey, CompiledEntry] = {}
        self._released: list[dict[str, object]] = []  # statistics of those the serving plan released
        self._key_locks: dict[ShapeKey, threading.Lock] = {}
        self._lock = threading.Lock()
        self._run_lock: contextlib.AbstractContextManager = (
            contextlib.nullcontext() if engine.thread_safe else threading.Lock()
        )
        self._scratch: Path | None = None  # legalized graphs when there is no cache
        self._closed = False
        self._finalizer = weakref.finalize(self, _remove_scratch, [])
        #: How a decode executable keeps its cache on the device (``runtime.carried_state`` sets it): a
        #: signature holding ``ROWS_INPUT`` is compiled with that rewrite.
        self.carry_request: CarryRequest | None = None

    def _save_legalized(
        self, shapes: dict[str, tuple[int, ...]], branches: dict[str, bool], directory: Path
    ) -> Path:
        key = self._legalized_key(shapes, branches)
        earlier = _legalized_files.get(key) or self._recorded_legalized(key)
        if earlier is not None and earlier.is_file():
            # Legalization does not depend on the engine or device: reuse an earlier result (this
            # process's, or one the cache holds in another engine's or device's entry).
            return _copy_graph(earlier, directory / LEGALIZED_GRAPH_FILE)
        # The compiler is imported on the first cache miss, keeping it off warm loads.
        from optimum_ipu_backend.compiler import build_passes, legalize
        from optimum_ipu_backend.compiler.carried_state import carry_state
        from optimum_ipu_backend.compiler.external_data import save_graph
        from optimum_ipu_backend.compiler.served_graph import bind_branches

        model = bind_branches(self._load_model(), branches)
        sharding = self._sharding()
        passes = len(build_passes(self._options.precision, sharding))
        carried = ROWS_INPUT in shapes
        static = {name: shape for name, shape in shapes.items() if name != ROWS_INPUT}
        with step_progress(f"legalizing for {static}", passes, self._progress) as advance:
            legalized = legalize(
                model,
                static,
                precision=self._options.precision,
                progress=advance,
                weights_dir=None if self._model_path is None else self._model_path.parent,
                sharding=sharding,
            )
        weight_names = legalized.weight_names
        if carried:
            request = self.carry_request
            if request is None:
                raise ValueError(f"a signature with {ROWS_INPUT!r} needs the table's carry_request")
            _, plan = carry_state(legalized.model, request)
            weight_names = weight_names | {spec.state for spec in plan.states}
        path = save_graph(
            legalized.model, directory / LEGALIZED_GRAPH_FILE, legalized.weights_dir, weight_names
        )
        _legalized_files[key] = path
        return path

    def _legalized_record(self, key: tuple) -> Path | None:
        """Where the cache records which entry holds the graph legalized for ``key`` (None without a
        cache); keyed with this package's code, so a changed compiler legalizes again."""
        if self._cache is None:
            return None
        name = hashlib.sha256(repr((code_identity(), key)).encode()).hexdigest()[:32]
        return self._cache.root / LEGALIZED_DIR / self._graph_digest / f"{name}.json"

    def _recorded_legalized(self, key: tuple) -> Path | None:
        """The legalized graph of a verified cache entry that another table (another process, engine or
        device) built for ``key``, or None: a missing, corrupt or evicted entry legalizes again."""
        record = self._legalized_record(key)
        stored = None if record is None else read_record(record, LEGALIZED_RECORD_FORMAT, "legalized graph")
        if not isinstance(stored, dict) or not isinstance(stored.get("entry"), str):
            return None
        try:
            entry = self._cache.get(stored["entry"])
        except CacheError:
            return None
        return None if entry is None else entry.file(LEGALIZED_GRAPH_FILE)

    def _sharding(self):
        """The compiler's sharding for the options, None on one IPU per replica."""
        if self._options.ipus_per_replica == 1:
            return None
        from optimum_ipu_backend.compiler.passes.shard_over_ipus import Sharding

        return Sharding(self._options.ipus_per_replica, self._options.layers_per_ipu)

    def _legalized_key(self, shapes: dict[str, tuple[int, ...]], branches: dict[str, bool]) -> tuple:
        return (
            self._graph_digest,
            tuple(sorted(shapes.items())),
            tuple(sorted(branches.items())),
            self._options.precision,
            self._options.ipus_per_replica,
            self._options.layers_per_ipu,
            # the carried-state rewrite depends on the engine (integer state or not)
            repr(self.carry_request) if ROWS_INPUT in shapes else None,
        )

    def _cache_key(self, shapes: dict[str, tuple[int, ...]], branches: dict[str, bool]) -> CacheKey:
        return CacheKey.build(
            graph=self._graph_digest,
            shapes=shapes,
            precision=self._options.precision,
            engine=self._engine.name,
            sdk_version=self._engine.sdk_version,
            options={
                "branches": branches,
                **self._options.binary_settings(),
                "engine_settings": self._engine.key_settings(self._options),
            },
        )

    def _manifest_meta(self, shapes: dict[str, tuple[int, ...]], branches: dict[str, bool]) -> dict:
        """What ``optimum-ipu cache list/info`` show of an entry."""
        return {
            "model": None if self._model_path is None else str(self._model_path.parent),
            "graph_file": None if self._model_path is None else self._model_path.name,
            "shapes": {name: list(shape) for name, shape in shapes.items()},
            "branches": branches,
            "precision": self._options.precision,
            "engine": self._engine.name,
            "device": self._options.device,
            "sdk_version": self._engine.sdk_version,
        }

    def _compile(
        self, shapes: dict[str, tuple[int, ...]], branches: dict[str, bool], background: bool = False
    ) -> CompiledEntry:
        """``background``: built with ``Engine.build_aside``, which keeps the compile off the device that
        serves the calls meanwhile (it needs an artifact directory, so one is made without a cache too)."""
        started = time.perf_counter()
        if self._cache is None:
            if self._scratch is None:
                self._scratch = Path(tempfile.mkdtemp(prefix="optimum-ipu-graphs-"))
                self._finalizer.detach()
                self._finalizer = weakref.finalize(self, _remove_scratch, [self._scratch])
            directory = Path(tempfile.mkdtemp(dir=self._scratch))
            graph = self._save_legalized(shapes, branches, directory)
            if background:
                (directory / ARTIFACTS_DIR).mkdir()
                executable = self._engine.build_aside(graph, self._options, directory / ARTIFACTS_DIR)
            else:
                executable = self._engine.compile(graph, self._options)
            source = "compiled"
        else:
            built: dict[str, Executable] = {}
            make = self._engine.build_aside if background else self._engine.compile

            def build(directory: Path) -> None:
                graph = self._save_legalized(shapes, branches, directory)
                artifacts = directory / ARTIFACTS_DIR
                artifacts.mkdir()
                built["executable"] = make(graph, self._options, artifacts)

            key = self._cache_key(shapes, branches)
            entry = self._cache.get_or_create(
                key,
                build,
                meta=self._manifest_meta(shapes, branches),
                shared=LEGALIZED_DATA_FILE,
                beside_shared=(LEGALIZED_GRAPH_FILE,),
            )
            graph, artifacts = entry.file(LEGALIZED_GRAPH_FILE), entry.path / ARTIFACTS_DIR
            legalized_key = self._legalized_key(shapes, branches)
            _legalized_files[legalized_key] = graph
            if entry.created_now:
                record = self._legalized_record(legalized_key)
                write_record(record, LEGALIZED_RECORD_FORMAT, {"entry": entry.key}, "legalized graph")
            if "executable" in built:
                executable, source = built["executable"], "compiled"
                executable.relocated(graph, artifacts)
            elif background:
                executable, source = self._engine.build_aside(graph, self._options, artifacts), "cache"
            else:
                executable = self._engine.load(graph, artifacts, self._options)
                source = "cache"
        seconds = time.perf_counter() - started
        _logger.info("%s %s for %s in %.2f s", source, self._engine.describe(), shapes, seconds)
        device_dtypes = {spec.name: spec.dtype for spec in executable.inputs}
        carried = None
        if ROWS_INPUT in shapes:  # what the rewrite kept on the device, as it wrote it into the graph
            carried = carried_state_plan(onnx.load(str(graph), load_external_data=False))
        return CompiledEntry(
            shapes, branches, executable, seconds, source, device_input_dtypes=device_dtypes, carried=carried
        )

    @property
    def count(self) -> int:
        """How many executables this table holds."""
        return len(self._entries)

    def has(self, shapes: Mapping[str, tuple[int, ...]], branches: Mapping[str, bool]) -> bool:
        """Whether the executable for these shapes is already loaded or compiled."""
        return _shape_key(shapes, branches) in self._entries

    def entry_for(
        self, shapes: Mapping[str, tuple[int, ...]], branches: Mapping[str, bool], *, background: bool = False
    ) -> CompiledEntry:
        """The executable of these static shapes: in memory, from the cache, or compiled now (``background``:
        on a compile thread, while calls are served by others)."""
        if self._closed:
            raise EngineClosedError("this executable table was closed; create a new session to run again")
        key = _shape_key(shapes, branches)
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        with self._lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._compile(dict(shapes), dict(branches), background)
                entry.background = background
                if background:
                    _logger.info("built in the background: %s (%s)", entry.shapes, entry.source)
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
        with self._run_lock:
            try:
                outputs = entry.executable.run_step(device_feed, options.device_iterations, options.replicas)
            except EngineClosedError:
                if self._closed:
                    raise
                # the serving plan released it meanwhile (``release``): load it again for this call
                entry = self.entry_for(micro_shapes, branches)
                outputs = entry.executable.run_step(device_feed, options.device_iterations, options.replicas)
        entry.calls += 1  # a statistic; an occasional lost increment under threads is acceptable
        return outputs

    def release(self, shapes: Mapping[str, tuple[int, ...]], branches: Mapping[str, bool]) -> bool:
        """Close the executable of these shapes and forget it (it stays in the cache), so that the IPUs it
        shared go to the executables the serving plan keeps; its statistics stay. A call that took it
        just before loads it again."""
        with self._lock:
            entry = self._entries.pop(_shape_key(shapes, branches), None)
            if entry is None:
                return False
        if not self._engine.thread_safe:  # runs are serialized: none is using it now
            with self._run_lock:
                entry.executable.close()
        # a thread-safe engine's run may still hold it: it closes once unreferenced (``Executable``'s
        # finalizer); what it did stays in the statistics
        self._released.append({**self._entry_statistics(entry), "released": True})
        _logger.info("released %s: the serving plan no longer uses it", entry.shapes)
        return True

    def load(self, shapes: Mapping[str, tuple[int, ...]], branches: Mapping[str, bool]) -> None:
        """Load the executable of these shapes onto its IPUs now, if it is in memory (``Executable.load``):
        the serving plan swaps a newly built one in before calls need it."""
        with self._lock:
            entry = self._entries.get(_shape_key(shapes, branches))
        if entry is not None:
            with (
                self._run_lock,
                contextlib.suppress(EngineClosedError),
            ):  # released meanwhile: nothing to load
                entry.executable.load()

    def write_state(self, entry: CompiledEntry, values: Mapping[str, np.ndarray]) -> None:
        """Upload new values of an executable's device state (``Executable.write_state``)."""
        with self._run_lock:
            entry.executable.write_state(values)

    @property
    def engine_thread_safe(self) -> bool:
        return self._engine.thread_safe

    @property
    def engine_integer_state(self) -> bool:
        return self._engine.integer_state

    @property
    def cache_description(self) -> str:
        return "disabled" if self._cache is None else str(self._cache.root)

    def statistics(self) -> list[dict[str, object]]:
        """Each executable with its shapes, where it came from, its load time and the calls it served; the
        ones the serving plan released first, marked ``released``."""
        return [*self._released, *(self._entry_statistics(entry) for entry in list(self._entries.values()))]

    @staticmethod
    def _entry_statistics(entry: CompiledEntry) -> dict[str, object]:
        return {
            "shapes": entry.shapes,
            "branches": entry.branches,
            "source": entry.source,
            "compile_seconds": entry.seconds,
            "background": entry.background,
            "calls": entry.calls,
            **({"kv_cache": "device"} if entry.carried is not None else {}),
            **entry.executable.residency(),
        }

    def close(self) -> None:
        """Close every executable (releasing the devices they hold) and forget them."""
        self._closed = True
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            entry.executable.close()
        self._finalizer()

    def __enter__(self) -> ExecutableTable:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# (graph digest, shapes, branches, precision) -> a legalized graph this process wrote (in a cache entry or
# a table's scratch directory); checked for existence before use.
_legalized_files: dict[tuple, Path] = {}


def _copy_graph(source: Path, target: Path) -> Path:
    """A copy of a legalized graph this process wrote, with its data file (copied, never hard-linked:
    ONNX refuses external data with several links; the cache keeps one copy of it anyway)."""
    shutil.copyfile(source, target)
    data = source.parent / LEGALIZED_DATA_FILE
    if data.is_file():
        shutil.copyfile(data, target.parent / LEGALIZED_DATA_FILE)
    return target


def _remove_scratch(directories: list[Path]) -> None:
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


def _shape_key(shapes: Mapping[str, tuple[int, ...]], branches: Mapping[str, bool]) -> ShapeKey:
    return tuple(sorted(shapes.items())) + tuple(sorted(branches.items()))
