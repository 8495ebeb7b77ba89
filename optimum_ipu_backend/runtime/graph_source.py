"""The exported graph a session serves, described cheaply and parsed only when needed.

Creating a session needs only a description of the graph: its inputs and outputs, the operators the
compiler cannot take, the inputs that pick a merged decoder's branch, the masks the runtime generates
for the rewrites it gets, what the rewrites need of each call's feed, and a content hash for the
executable cache. Parsing a large export is the slowest part of a warm load, so the description is kept
beside the executable cache, keyed by the content of the model file and its external data files (XXH3,
so every re-export of one model shares it), and checked with a hash of its own: a warm load hashes the
files, reads it and parses nothing. The graph itself is parsed on the first cache miss.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx
import xxhash

from optimum_ipu_backend.compiler.served_graph import GeneratedMask, ServedGraph, served_graph
from optimum_ipu_backend.runtime.cache_files import (
    DESCRIPTIONS_DIR,
    code_identity,
    graph_digest,
    read_record,
    write_record,
)
from optimum_ipu_backend.runtime.executable_cache import checksum_file

if TYPE_CHECKING:
    from optimum_ipu_backend.compiler.graph_rewrites.eos_selection import SameTokenCount

_logger = logging.getLogger(__name__)

# The stored description's format: one written by code that knew fewer fields is never read back with
# those fields left at their defaults. (5: keyed by content, with the data files it was keyed by; 6: index
# bounds count negative indices from the end, and bound GatherND's index tuples per column.)
DESCRIPTION_FORMAT = 7

# (name, symbolic shape, ONNX elem type)
IOSpec = tuple[str, list[Any], int]


@dataclass
class GraphDescription:
    digest: str  # graph_digest of the files' content key: the identity of its cache entries and proofs
    inputs: list[IOSpec]  # what callers see (the exported graph's inputs, initializers excluded)
    outputs: list[IOSpec]
    unsupported: list[list[str]]  # [name, op_type, domain, reason, pattern] from the pre-check
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
    #: Graph inputs that name an initializer: defaults ONNX lets a caller override, compiled as constants.
    initializer_defaults: list[str] = field(default_factory=list)

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
        [n.name, n.op_type, n.domain, n.reason, n.pattern]
        for n in precheck_operators(model)
        if n.name not in selections
    ]
    return GraphDescription(
        digest=digest,
        inputs=_io(model.graph.input, initializers),
        initializer_defaults=[value.name for value in model.graph.input if value.name in initializers],
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


def _graph_key(checksum: str) -> str:
    """The first half of a description's content key: the model's checksum, with this package's code
    (``cache_files.code_identity``: a release, or an edited checkout, describes every graph again)."""
    return xxhash.xxh3_128_hexdigest(f"{code_identity()}:{checksum}".encode())


def _data_key(directory: Path, names: list[str]) -> str:
    """The second half: the external data files' names and checksums, so changing only the weights never
    serves what was built from the old ones."""
    return xxhash.xxh3_128_hexdigest(
        "\n".join(f"{name}:{checksum_file(directory / name)}" for name in names).encode()
    )


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

    def _load_description(self) -> GraphDescription:
        """Read back by content when stored, as ``<graph key>-<data key>.json`` (one record per set of
        weights the model file has been seen with); else described from the parsed graph, and stored."""
        if self.path is None:
            return self._described(
                f"{_graph_key(xxhash.xxh3_128_hexdigest(self._bytes))}-{_data_key(Path(), [])}"
            )
        graph = _graph_key(checksum_file(self.path))
        store = None if self._cache_root is None else self._cache_root / DESCRIPTIONS_DIR
        for stored in sorted(store.glob(f"{graph}-*.json")) if store is not None else ():
            body = read_record(stored, DESCRIPTION_FORMAT, "graph description")
            with contextlib.suppress(OSError):  # OSError: a data file it names is gone
                if (
                    body is not None
                    and f"{graph}-{_data_key(self.path.parent, body['data_files'])}" == stored.stem
                ):
                    description = body["description"]
                    description["inputs"] = [tuple(item) for item in description["inputs"]]
                    description["outputs"] = [tuple(item) for item in description["outputs"]]
                    return GraphDescription(**description)
        self.model()  # finds the data files
        key = f"{graph}-{_data_key(self.path.parent, self._data_files)}"
        description = self._described(key)
        if store is not None:
            body = {"data_files": self._data_files, "description": asdict(description)}
            write_record(store / f"{key}.json", DESCRIPTION_FORMAT, body, "graph description")
        return description

    def _described(self, content_key: str) -> GraphDescription:
        model = self.model()
        served = served_graph(model)
        self._served = served.model  # described once, served from the same graph
        return _describe(model, served, graph_digest(content_key))
