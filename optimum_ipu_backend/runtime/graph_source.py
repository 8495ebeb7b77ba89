"""The exported graph a session serves, described cheaply and parsed only when needed.

Creating a session needs only a description of the graph: its inputs and outputs, the operators the
compiler cannot take, the inputs that pick a merged decoder's branch, the masks the runtime generates
for the rewrites it gets, what the rewrites need of each call's feed, and a content hash for the
executable cache. Parsing a large export is the
slowest part of a warm load, so the description is kept beside the executable cache, keyed by the
files' sizes and modification times, and checked with a hash of its own: a warm load reads it and
parses nothing. The graph itself is parsed on the first cache miss.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx

from optimum_ipu_backend import __version__
from optimum_ipu_backend.compiler.served_graph import GeneratedMask, ServedGraph, served_graph

if TYPE_CHECKING:
    from optimum_ipu_backend.compiler.graph_rewrites.eos_selection import SameTokenCount

_logger = logging.getLogger(__name__)

DESCRIPTIONS_DIR = "graphs"
# Part of every stored description's key: a description written by code that knew fewer fields is
# never read back with those fields left at their defaults.
DESCRIPTION_FORMAT = 4
_HASH_CHUNK = 1 << 20

# (name, symbolic shape, ONNX elem type)
IOSpec = tuple[str, list[Any], int]


@dataclass
class GraphDescription:
    digest: str  # sha256 of the export's files: the identity of its cache entries
    inputs: list[IOSpec]  # what callers see (the exported graph's inputs, initializers excluded)
    outputs: list[IOSpec]
    unsupported: list[list[str]]  # [name, op_type, domain, reason] from the operator pre-check
    served_inputs: dict[str, list[Any]]  # symbolic shapes of the graph the runtime compiles
    served_outputs: dict[str, list[Any]]
    branch_inputs: list[str] = field(default_factory=list)
    #: Inputs the served graph adds and the runtime fills itself: [input, dimension, padding side].
    generated_masks: list[list[str]] = field(default_factory=list)
    #: Rewrites of the served graph worth telling the user about (what they cost).
    notes: list[str] = field(default_factory=list)
    # inputs that index a table on the device, and their allowed values (compiler.analysis.index_ranges)
    index_ranges: dict[str, Any] = field(default_factory=dict)
    #: What each call's feed must hold for the served graph to equal the export
    #: (``SameTokenCount.to_json``: an end-of-sentence selection computed densely).
    token_counts: list[list[Any]] = field(default_factory=list)

    def masks(self) -> list[GeneratedMask]:
        """The generated masks, one record each."""
        return [GeneratedMask(*entry) for entry in self.generated_masks]

    def token_count_checks(self) -> list[SameTokenCount]:
        """The token counts every call must satisfy, one record each."""
        from optimum_ipu_backend.compiler.graph_rewrites.eos_selection import SameTokenCount

        return [SameTokenCount.from_json(entry) for entry in self.token_counts]


def _io(values, initializers: set[str]) -> list[IOSpec]:
    specs = []
    for value in values:
        if value.name in initializers:
            continue
        tensor_type = value.type.tensor_type
        dims: list[Any] = []
        for dim in tensor_type.shape.dim:
            if dim.HasField("dim_value"):
                dims.append(dim.dim_value)
            elif dim.HasField("dim_param"):
                dims.append(dim.dim_param)
            else:
                dims.append(None)
        specs.append((value.name, dims, tensor_type.elem_type))
    return specs


def _describe(model: onnx.ModelProto, served: ServedGraph, digest: str) -> GraphDescription:
    from optimum_ipu_backend.compiler.analysis.index_ranges import analyze_index_ranges
    from optimum_ipu_backend.compiler.op_table import branch_inputs
    from optimum_ipu_backend.compiler.precheck import precheck_operators

    initializers = {init.name for init in model.graph.initializer}
    served_initializers = {init.name for init in served.model.graph.initializer}
    selections = {entry[0] for entry in served.unsupported}
    unsupported = [
        [n.name, n.op_type, n.domain, n.reason] for n in precheck_operators(model) if n.name not in selections
    ]
    return GraphDescription(
        digest=digest,
        inputs=_io(model.graph.input, initializers),
        outputs=_io(model.graph.output, set()),
        unsupported=served.unsupported + unsupported,
        served_inputs={name: dims for name, dims, _ in _io(served.model.graph.input, served_initializers)},
        served_outputs={name: dims for name, dims, _ in _io(served.model.graph.output, set())},
        branch_inputs=branch_inputs(model),
        generated_masks=[[mask.input, mask.dim, mask.side] for mask in served.generated_masks],
        notes=served.notes,
        index_ranges=analyze_index_ranges(model).to_json(),
        token_counts=[check.to_json() for check in served.token_counts],
    )


def _file_digest(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode())
        with open(path, "rb") as handle:
            while chunk := handle.read(_HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def _external_files(path: Path, data_files: list[str]) -> list[Path]:
    """The model file and every external data file it points to: all of them key the cache, so changing
    only the weights never serves an entry built from the old ones."""
    return [path, *(path.parent / location for location in data_files)]


class GraphSource:
    """One exported graph: its description (cached when ``cache_root`` is given) and, lazily, the
    parsed graph the runtime compiles."""

    def __init__(self, path_or_bytes: str | os.PathLike | bytes, cache_root: Path | None = None) -> None:
        self._bytes = bytes(path_or_bytes) if isinstance(path_or_bytes, (bytes, bytearray)) else None
        self.path = None if self._bytes is not None else Path(path_or_bytes)
        if self.path is not None and not self.path.is_file():
            raise FileNotFoundError(f"ONNX model {str(self.path)!r} does not exist")
        self._cache_root = cache_root
        self._model: onnx.ModelProto | None = None
        self._served: onnx.ModelProto | None = None
        self._data_files: list[str] = []  # the external data files the model file points to
        self._lock = threading.Lock()
        self.description = self._load_description()

    # -- the parsed graph ------------------------------------------------------------------------

    def model(self) -> onnx.ModelProto:
        with self._lock:
            if self._model is None:
                if self._bytes is not None:
                    self._model = onnx.load_from_string(self._bytes)
                else:
                    # Large external weights stay in their files: the graph stays small enough to
                    # serialize, and legalization streams the weights from there (compiler.external_data).
                    from optimum_ipu_backend.compiler.external_data import read_graph

                    self._model, self._data_files = read_graph(self.path)
            return self._model

    def served_model(self) -> onnx.ModelProto:
        """The graph the runtime legalizes and proves padding on: the export after ``served_graph``."""
        model = self.model()
        with self._lock:
            if self._served is None:
                self._served = served_graph(model).model
            return self._served

    # -- the description -------------------------------------------------------------------------

    def _stat_key(self) -> str:
        """Identity of the files as the file system sees them: every file beside the model (external
        weights included) with its size and modification time, and this package's version."""
        assert self.path is not None
        parts = [__version__, str(DESCRIPTION_FORMAT), str(self.path.resolve())]
        for entry in sorted(os.scandir(self.path.parent), key=lambda e: e.name):
            if entry.is_file():
                stat = entry.stat()
                parts.append(f"{entry.name}:{stat.st_size}:{stat.st_mtime_ns}")
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    def _description_file(self) -> Path | None:
        if self.path is None or self._cache_root is None:
            return None
        return self._cache_root / DESCRIPTIONS_DIR / f"{self._stat_key()}.json"

    def _load_description(self) -> GraphDescription:
        stored = self._description_file()
        if stored is not None:
            description = _read_description(stored)
            if description is not None:
                return description
        model = self.model()
        if self._bytes is not None:
            digest = hashlib.sha256(self._bytes).hexdigest()
        else:
            digest = _file_digest(_external_files(self.path, self._data_files))
        served = served_graph(model)
        self._served = served.model  # described once, served from the same graph
        description = _describe(model, served, digest)
        if stored is not None:
            _write_description(stored, description)
        return description


def _checked_body(description: GraphDescription) -> dict[str, Any]:
    body = asdict(description)
    text = json.dumps(body, sort_keys=True)
    return {"body": body, "sha256": hashlib.sha256(text.encode()).hexdigest()}


def _read_description(path: Path) -> GraphDescription | None:
    """A stored description, or None if it is missing, unreadable or fails its own hash."""
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        body = stored["body"]
        if hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest() != stored["sha256"]:
            raise ValueError("hash mismatch")
        body["inputs"] = [tuple(item) for item in body["inputs"]]
        body["outputs"] = [tuple(item) for item in body["outputs"]]
        return GraphDescription(**body)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        _logger.warning(
            "ignoring the corrupt graph description %s (%s); describing the graph again", path, exc
        )
        return None


def _write_description(path: Path, description: GraphDescription) -> None:
    """Atomic: a reader sees the old file, no file, or the whole new one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        temporary.write_text(json.dumps(_checked_body(description)), encoding="utf-8")
        os.replace(temporary, path)
    except OSError as exc:  # a read-only cache costs speed, never correctness
        _logger.info("could not store the graph description %s: %s", path, exc)
