"""On-disk cache of legalized graphs and compiled executables, safe across processes.

Layout: ``<root>/<key[:2]>/<key>/`` holds an entry's payload files (``model.onnx``,
``executable.popef``, ...) and ``manifest.json`` (size and XXH3-128 checksum of every payload file, creation
time, engine, key inputs, free-form metadata). ``<root>/.locks/`` holds one lock file per key and
``<root>/.tmp/`` the entries being built. Beside them are the stores of ``cache_files``: graph
descriptions (``graphs/``), padding proofs (``padding-proofs/``) and the conformance suite's work
(``conformance/``).

Guarantees:

* Atomic writes: an entry is built in a temporary directory on the same filesystem, fsynced, its
  manifest written last, then renamed into place. A build that raises or a process that dies leaves no
  entry behind (at most a temporary directory, swept by ``prune``/``clear`` once stale).
* One build per key: ``get_or_create`` holds a cross-process ``filelock.FileLock`` per key, so a second
  process that needs the same key waits and then reads what the first one built.
* Integrity: every read checks each file's size and XXH3-128 checksum against the manifest; a corrupt or
  truncated entry is removed with a warning and reported as missing, so it is rebuilt, never used.
* Bounded size: after each build the least-recently-used entries beyond the size cap are evicted
  (``get`` refreshes an entry's use time).
* Nothing is ever pickled: manifests are JSON and payloads are opaque bytes.
* Shared payloads stored once: the file a build names as ``shared`` (a model's weights, the same for
  every compiled shape) goes to a group directory ``<root>/blobs/<sum[:2]>/<sum>/`` named by its
  XXH3-128 checksum, and the files named ``beside_shared`` (the graph that points into it by a relative
  name) go into the same directory as ``<key>.<name>``, so every shape's graph finds the one weight file
  beside it, with no links (ONNX refuses hard-linked external data). The entry's manifest records where
  each such file is, and every read verifies them like any other payload: a corrupt weight file fails
  every entry that uses it, is removed with the first, and is rebuilt; an existing weight file is checked
  again before a new entry joins its group, and replaced when corrupt. A group directory goes only when
  no entry's manifest names it (pruning never breaks a live entry; a build holds the group's lock until
  its entry is committed). Sizes count each weight file once.
* One maintenance for the whole root: ``list``/``info`` report every store; ``prune`` and size-limit
  eviction remove the graph descriptions and padding proofs of a graph with its last entry (an entry's
  ``key_inputs.graph_sha256`` names its graph), and those of a graph no entry was ever built from a day
  after they were written (``cache_files.drop_unused_records``); ``clear`` removes everything no other
  process is using, leaving an empty root when none is. The size cap bounds the entries; the records go
  with them.

A read-only shared layer (``runtime/shared_cache.py``, ``OPTIMUM_IPU_SHARED_CACHE``) fills a missing
entry with a verified copy of the fleet's before anything is built.

The root is, in order of precedence: the ``root`` argument (the ``executable_cache_dir`` setting), the
``OPTIMUM_IPU_CACHE`` environment variable, ``platformdirs.user_cache_dir("optimum-ipu-backend")``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from optimum_ipu_backend.errors import DeviceError
from optimum_ipu_backend.runtime.cache_files import (
    CONFORMANCE_DIR,
    UNUSED_RECORD_SECONDS,
    code_identity,
    drop_unused_records,
    store_usage,
    tree_usage,
)

if TYPE_CHECKING:
    from filelock import FileLock


_logger = logging.getLogger(__name__)

CACHE_ENV = "OPTIMUM_IPU_CACHE"
APP_NAME = "optimum-ipu-backend"
DEFAULT_SIZE_LIMIT_BYTES = 20 * 1024**3
CACHE_FORMAT_VERSION = 2  # 2: payload checksums are XXH3-128 (1 used sha256)
CHECKSUM = "xxh3_128"
MANIFEST_NAME = "manifest.json"
BLOBS_DIR = "blobs"
# Touched on every use; its mtime orders entries for LRU eviction (atime is unreliable under relatime).
LAST_USED_NAME = ".last_used"
# Temporary build directories older than this belong to a dead process and may be swept.
STALE_BUILD_SECONDS = 24 * 3600

_KEY_PATTERN = re.compile(r"^[0-9a-f]{64}$")
_BLOB_PATTERN = re.compile(r"^[0-9a-f]{32}$")
_HASH_CHUNK = 1 << 20


def _lock_timeout() -> type[Exception]:
    """filelock's Timeout, imported when an ``except`` clause is evaluated, i.e. only if something was
    raised: the import is deferred off the warm path (see ``ExecutableCache._lock``)."""
    from filelock import Timeout

    return Timeout


class CacheError(DeviceError):
    """The cache cannot be used as asked (bad key, a build that wrote nothing, metadata that is not JSON)."""


# ----------------------------------------------------------------------------------------------------------
# Sizes and locations
# ----------------------------------------------------------------------------------------------------------

_SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4, "p": 1024**5}


def parse_byte_size(value: str | int) -> int:
    """Bytes from ``2GB``, ``2GiB``, ``2G``, ``500MB``, ``1.5GB``, ``123B`` or an int.

    Units are powers of 1024 whichever way they are spelled (``GB`` = ``GiB``), as for most tools that
    size caches. ``ValueError`` for anything else, zero or negative sizes.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE_PATTERN.match(str(value))
        if match is None:
            raise ValueError(
                f"not a size: {value!r}; expected for example '2GB', '500MiB' or a number of bytes"
            )
        size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"a size must be positive, got {value!r}")
    return size


def format_byte_size(size: int) -> str:
    """Human-readable size with binary units (``1.5 GiB``)."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def resolve_cache_root(root: str | os.PathLike[str] | None = None) -> tuple[Path, str]:
    """The cache root and where it came from: ``"argument"``, ``"environment"`` or ``"default"``."""
    if root is not None and str(root) != "":
        return Path(root).expanduser(), "argument"
    from_env = os.environ.get(CACHE_ENV)
    if from_env:
        return Path(from_env).expanduser(), "environment"
    import platformdirs

    return Path(platformdirs.user_cache_dir(APP_NAME)), "default"


# ----------------------------------------------------------------------------------------------------------
# Keys and entries
# ----------------------------------------------------------------------------------------------------------


def checksum_file(path: Path) -> str:
    """XXH3-128 of a payload file. Integrity against corruption and truncation needs no cryptographic
    hash (keys stay sha256), and at ~15 GB/s it keeps verification off a warm load's critical path,
    where sha256 of a 90 MB graph took as long as creating its onnxruntime session."""
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as stream:
        while chunk := stream.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def canonical_json(value: Any) -> str:
    """Deterministic JSON (sorted keys, no whitespace); ``TypeError`` for values JSON cannot hold."""

    def reject(item: Any) -> Any:
        if isinstance(item, os.PathLike):
            return os.fspath(item)
        raise TypeError(
            f"cache key and metadata values must be JSON data, got {type(item).__name__}: {item!r}"
        )

    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=reject)


@dataclass(frozen=True)
class CacheKey:
    """A cache key: ``digest`` is the sha256 of the canonical JSON of ``inputs``."""

    digest: str
    inputs: dict[str, Any]

    @classmethod
    def build(
        cls,
        *,
        graph: bytes | str,
        shapes: Mapping[str, Sequence[int]],
        precision: str,
        engine: str,
        sdk_version: str | None,
        options: Mapping[str, Any] | None = None,
    ) -> CacheKey:
        """The key of one compiled artifact.

        ``graph`` is the serialized graph the artifact derives from, or its sha256 hex digest. To let a warm
        load skip legalization, pass the *exported* graph and put whatever else shapes the legalized graph
        (compiler settings) into ``options``. ``shapes`` are the static input shapes, ``options`` any other
        JSON data that changes the artifact. The package's code (``cache_files.code_identity``: its version
        and a digest of its sources) and the cache format are always included, so a new release, or an
        edited checkout, never reads an older one's artifacts.
        """
        if isinstance(graph, bytes | bytearray | memoryview):
            graph_sha256 = hashlib.sha256(graph).hexdigest()
        elif isinstance(graph, str) and _KEY_PATTERN.match(graph):
            graph_sha256 = graph
        else:
            raise TypeError("graph must be the serialized graph (bytes) or its sha256 hex digest")
        inputs = {
            "format": CACHE_FORMAT_VERSION,
            "package_code": code_identity(),
            "graph_sha256": graph_sha256,
            "shapes": {name: [int(size) for size in shape] for name, shape in sorted(shapes.items())},
            "precision": precision,
            "engine": engine,
            "sdk_version": sdk_version,
            "options": dict(options or {}),
        }
        text = canonical_json(inputs)
        # Round-trip so ``inputs`` holds exactly what was hashed (tuples as lists, paths as strings).
        return cls(hashlib.sha256(text.encode("ascii")).hexdigest(), json.loads(text))

    def __str__(self) -> str:
        return self.digest


@dataclass(frozen=True)
class CacheEntry:
    """A verified entry. ``created_now`` is True when this very call built it."""

    key: str
    path: Path
    manifest: dict[str, Any]
    created_now: bool = False

    @property
    def files(self) -> dict[str, Path]:
        return {name: self.file(name) for name in self.manifest["files"]}

    def file(self, name: str) -> Path:
        """Path of payload file ``name`` (in the entry, or in a shared group directory); ``KeyError``
        naming the files the entry has."""
        item = self.manifest["files"].get(name)
        if item is None:
            raise KeyError(
                f"cache entry {self.key} has no file {name!r}; it has {sorted(self.manifest['files'])}"
            )
        at = item.get("at")
        return self.path.parent.parent / PurePosixPath(at) if at else self.path / PurePosixPath(name)

    def read_bytes(self, name: str) -> bytes:
        return self.file(name).read_bytes()

    @property
    def size_bytes(self) -> int:
        return sum(int(item["size"]) for item in self.manifest["files"].values())

    @property
    def meta(self) -> dict[str, Any]:
        return dict(self.manifest.get("meta") or {})

    @property
    def engine(self) -> str | None:
        return self.manifest.get("engine")


@dataclass(frozen=True)
class CacheEntryInfo:
    """What ``list()`` reports per entry (without hashing the payloads)."""

    key: str
    path: Path
    size_bytes: int
    created: float | None
    last_used: float
    engine: str | None
    meta: dict[str, Any] = field(default_factory=dict)
    readable: bool = True
    #: The part of ``size_bytes`` in blobs other entries may share (counted once in the cache's total).
    shared_bytes: int = 0
    #: The checksums (blob names) of the shared files the entry links.
    blobs: tuple[str, ...] = ()
    #: The whole manifest (empty when unreadable).
    manifest: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def graph(self) -> str | None:
        """The digest of the graph the entry was built from (None when its key does not record one)."""
        return (self.manifest.get("key_inputs") or {}).get("graph_sha256")

    def to_dict(self) -> dict[str, Any]:
        """What ``optimum-ipu cache list --json`` shows of the entry (not its whole manifest)."""
        shown = ("key", "size_bytes", "shared_bytes", "created", "last_used", "engine", "meta", "readable")
        return {"path": str(self.path), **{name: getattr(self, name) for name in shown}}


# ----------------------------------------------------------------------------------------------------------
# The cache
# ----------------------------------------------------------------------------------------------------------


class ExecutableCache:
    """Content-addressed, size-capped, cross-process-safe store of compiled artifacts (see module doc)."""

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        size_limit_bytes: int | None = None,
        *,
        lock_timeout: float | None = None,
    ) -> None:
        """``root``: see ``resolve_cache_root``. ``size_limit_bytes``: the LRU cap (default 20 GiB).
        ``lock_timeout``: seconds to wait for another process building the same key (None: forever)."""
        self.root, self.root_source = resolve_cache_root(root)
        if size_limit_bytes is not None and size_limit_bytes <= 0:
            raise ValueError(f"size_limit_bytes must be positive, got {size_limit_bytes}")
        self.size_limit_bytes = (
            DEFAULT_SIZE_LIMIT_BYTES if size_limit_bytes is None else int(size_limit_bytes)
        )
        self.lock_timeout = lock_timeout
        # The fleet's read-only verified layer (runtime/shared_cache.py), when the operator configured one.
        from optimum_ipu_backend.runtime.shared_cache import shared_layer_from_environment

        self.shared_layer = shared_layer_from_environment()

    def __repr__(self) -> str:
        return f"ExecutableCache(root={str(self.root)!r}, size_limit_bytes={self.size_limit_bytes})"

    # -- paths ---------------------------------------------------------------------------------------------

    def entry_path(self, key: CacheKey | str) -> Path:
        digest = _digest(key)
        return self.root / digest[:2] / digest

    def _lock(self, digest: str) -> FileLock:
        # filelock costs ~10 ms to import; a warm cache hit never takes a lock, so it waits until needed.
        from filelock import FileLock

        locks = self.root / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        return FileLock(str(locks / f"{digest}.lock"))

    @contextlib.contextmanager
    def _if_free(self, name: str) -> Iterator[bool]:
        """Holds the lock ``name`` for the block and yields True, or yields False (and holds nothing) when
        another process or thread holds it."""
        lock = self._lock(name)
        try:
            lock.acquire(timeout=0)
        except _lock_timeout():
            yield False
            return
        try:
            yield True
        finally:
            lock.release()

    def _tmp_dir(self) -> Path:
        path = self.root / ".tmp"
        path.mkdir(parents=True, exist_ok=True)
        return path

    # -- reading -------------------------------------------------------------------------------------------

    def get(self, key: CacheKey | str) -> CacheEntry | None:
        """The verified entry for ``key``, or None when there is none or it was corrupt (then it is removed
        with a warning so the caller rebuilds it). Refreshes the entry's use time."""
        digest = _digest(key)
        entry = self._verified(digest)
        if entry is not None or not self.entry_path(digest).exists():
            return entry
        # Corrupt: remove it unless another process holds the key (it is rebuilding or removing it).
        with self._if_free(digest) as free:
            if free:
                self._verified(digest, remove_corrupt=True)
        return None

    def _verified(self, digest: str, remove_corrupt: bool = False) -> CacheEntry | None:
        path = self.root / digest[:2] / digest
        if not path.is_dir():
            return None
        manifest, problem = _check_entry(path, digest)
        if problem is None:
            _touch(path / LAST_USED_NAME)
            return CacheEntry(digest, path, manifest)  # type: ignore[arg-type]
        if remove_corrupt:
            _logger.warning("cache entry %s is corrupt (%s); removing it so it is rebuilt", path, problem)
            self._drop_corrupt_shared(_read_manifest(path)[0])
            self._remove_entry_files(path)
            self._remove_dir(path)
        return None

    # -- writing -------------------------------------------------------------------------------------------

    def get_or_create(
        self,
        key: CacheKey | str,
        build: Callable[[Path], None],
        meta: Mapping[str, Any] | None = None,
        shared: str | None = None,
        beside_shared: Sequence[str] = (),
    ) -> CacheEntry:
        """The entry for ``key``, building it with ``build(directory)`` if it is missing or corrupt.

        ``build`` writes the payload files into the (empty, temporary) directory it is given. Exactly one
        process builds a given key at a time; the others wait and then read its result. If ``build``
        raises, nothing is stored and the exception propagates. ``meta`` (JSON data) is stored in the
        manifest. ``shared`` names a payload file to store once per content, and ``beside_shared`` the
        files that must sit in the same directory as it (see the module doc). After a build,
        least-recently-used entries beyond the size cap are evicted.
        """
        digest = _digest(key)
        meta_json = json.loads(canonical_json(dict(meta or {})))  # reject non-JSON metadata before building
        entry = self._verified(digest)
        if entry is not None:
            return entry
        lock = self._lock(digest)
        try:
            lock.acquire(timeout=0)
        except _lock_timeout():
            _logger.info("waiting for another process that is building cache entry %s", digest)
            lock.acquire(timeout=-1 if self.lock_timeout is None else self.lock_timeout)
        try:
            entry = self._verified(digest, remove_corrupt=True)
            if entry is not None:
                return entry
            if self.shared_layer is not None:  # a verified shared entry is copied instead of built
                build = self.shared_layer.filling(digest, build)
            entry = self._build(digest, key, build, meta_json, shared, tuple(beside_shared))
        finally:
            lock.release()
        self._evict(self.size_limit_bytes, keep=digest)
        return entry

    def _build(
        self,
        digest: str,
        key: CacheKey | str,
        build: Callable[[Path], None],
        meta: dict[str, Any],
        shared: str | None = None,
        beside_shared: tuple[str, ...] = (),
    ) -> CacheEntry:
        # Named after the key, so a sweep can tell a build in progress (its key's lock is held).
        staging = Path(tempfile.mkdtemp(prefix=f"{digest}-", dir=self._tmp_dir()))
        group_lock = contextlib.ExitStack()  # held from placing shared files until the entry is committed
        try:
            started = time.perf_counter()
            build(staging)
            files = {}
            for path in sorted(_payload_files(staging)):
                name = path.relative_to(staging).as_posix()
                if name != shared:  # the shared file is synced only if it is kept (_place_in_group)
                    _fsync(path)
                files[name] = {"size": path.stat().st_size, CHECKSUM: checksum_file(path)}
            if shared is not None and shared in files:
                group_lock.enter_context(self._lock(f"blob-{files[shared][CHECKSUM]}"))
                self._place_in_group(staging, digest, files, shared, beside_shared)
            if not files:
                raise CacheError(f"the build of cache entry {digest} wrote no files")
            key_inputs = key.inputs if isinstance(key, CacheKey) else None
            engine = (key_inputs or {}).get("engine", meta.get("engine"))
            manifest = {
                "format": CACHE_FORMAT_VERSION,
                "key": digest,
                "created": time.time(),
                "build_seconds": round(time.perf_counter() - started, 3),
                "engine": engine,
                "key_inputs": key_inputs,
                "meta": meta,
                "files": files,
            }
            manifest_path = staging / MANIFEST_NAME
            with open(manifest_path, "w", encoding="utf-8") as stream:
                json.dump(manifest, stream, indent=1, sort_keys=True)
                stream.flush()
                os.fsync(stream.fileno())
            _fsync(staging, directory=True)
            final = self.root / digest[:2] / digest
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():
                self._remove_dir(final)  # a corrupt leftover that could not be removed earlier
            os.replace(staging, final)
            _fsync(final.parent, directory=True)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            group_lock.close()
        _touch(final / LAST_USED_NAME)
        _logger.info(
            "stored cache entry %s (%s)", final, format_byte_size(sum(f["size"] for f in files.values()))
        )
        return CacheEntry(digest, final, manifest, created_now=True)

    # -- shared payloads (group directories) ---------------------------------------------------------------

    def blob_path(self, checksum: str) -> Path:
        """The group directory of the shared file whose checksum is ``checksum``."""
        return self.root / BLOBS_DIR / checksum[:2] / checksum

    def _place_in_group(
        self, staging: Path, digest: str, files: dict[str, Any], shared: str, beside: Sequence[str]
    ) -> None:
        """Move the staged shared file into its group (unless a verified copy is there already) and the
        files that belong beside it; record where each went (``at``, relative to the root)."""
        item = files[shared]
        checksum = item[CHECKSUM]
        group = self.blob_path(checksum)
        group.mkdir(parents=True, exist_ok=True)
        target = group / PurePosixPath(shared).name
        staged = staging / PurePosixPath(shared)
        if _size_or_zero(target) == item["size"] and checksum_file(target) == checksum:
            staged.unlink()
        else:
            if target.exists():
                _logger.warning("shared cache file %s is corrupt; replacing it", target)
            _fsync(staged)
            os.replace(staged, target)
        item.update(shared=checksum, at=target.relative_to(self.root).as_posix())
        for name in beside:
            if name in files:
                companion = group / f"{digest}.{PurePosixPath(name).name}"
                os.replace(staging / PurePosixPath(name), companion)
                files[name]["at"] = companion.relative_to(self.root).as_posix()
        _fsync(group, directory=True)

    def _drop_unreferenced(
        self, gone: Set[str] = frozenset(), min_age: float = UNUSED_RECORD_SECONDS
    ) -> None:
        """Remove group directories no entry's manifest names, files in them whose entry is gone (a build
        that failed after placing them), and the records of graphs no entry was built from
        (``drop_unused_records``). Groups a build holds are skipped."""
        entries = self.list()
        drop_unused_records(self.root, {entry.graph for entry in entries if entry.graph}, gone, min_age)
        referenced = {blob for entry in entries for blob in entry.blobs}
        keys = {entry.key for entry in entries}
        unused = []
        for group in _sharded(self.root / BLOBS_DIR, _BLOB_PATTERN):
            if group.name not in referenced:
                unused.append(group)
                continue
            with self._if_free(f"blob-{group.name}") as free:
                if not free:
                    continue
                for path in group.iterdir():
                    owner = path.name.split(".", 1)[0]
                    orphan = _KEY_PATTERN.match(owner) and owner not in keys
                    if orphan and not self.entry_path(owner).exists():
                        path.unlink(missing_ok=True)
        self._drop_unused_groups(unused)

    def _drop_unused_groups(self, groups: Sequence[Path]) -> None:
        """Remove the group directories that no entry names, each while holding its lock. The entries are
        listed again once the locks are held: a build that joined a group after the first listing
        committed its entry before it released the group's lock, so it is seen and its group kept."""
        if not groups:
            return
        with contextlib.ExitStack() as held:
            free = [group for group in groups if held.enter_context(self._if_free(f"blob-{group.name}"))]
            if not free:
                return
            referenced = {blob for entry in self.list() for blob in entry.blobs}
            for group in free:
                if group.name not in referenced:
                    self._remove_dir(group)

    def _drop_corrupt_shared(self, manifest: dict[str, Any] | None) -> None:
        """An entry is being removed as corrupt: drop the shared files it uses that fail their checksum,
        so no other entry is served from them and the next build stores them again."""
        for item, path in _grouped_files(self.root, manifest):
            if item.get("shared") and path.is_file() and checksum_file(path) != item.get(CHECKSUM):
                path.unlink(missing_ok=True)

    def _remove_entry_files(self, path: Path) -> None:
        """Remove an entry's files that live in a group directory (its graph beside the shared weights)."""
        for item, located in _grouped_files(self.root, _read_manifest(path)[0]):
            if not item.get("shared") and located.name.startswith(f"{path.name}."):
                located.unlink(missing_ok=True)

    # -- maintenance ---------------------------------------------------------------------------------------

    def list(self) -> list[CacheEntryInfo]:
        """Every entry, most recently used first (payloads are not hashed; ``get`` verifies them)."""
        infos = []
        for path in self._entry_dirs():
            manifest, _ = _read_manifest(path)
            last_used = _mtime(path / LAST_USED_NAME) or _mtime(path / MANIFEST_NAME) or _mtime(path) or 0.0
            if manifest is None or not isinstance(manifest.get("files"), dict):
                infos.append(
                    CacheEntryInfo(
                        path.name, path, tree_usage(path)["bytes"], None, last_used, None, readable=False
                    )
                )
                continue
            items = [item for item in manifest["files"].values() if isinstance(item, dict)]
            shared = [item for item in items if isinstance(item.get("shared"), str)]
            infos.append(
                CacheEntryInfo(
                    key=path.name,
                    path=path,
                    size_bytes=sum(int(item.get("size", 0)) for item in items)
                    + _size_or_zero(path / MANIFEST_NAME),
                    created=manifest.get("created"),
                    last_used=last_used,
                    engine=manifest.get("engine"),
                    meta=dict(manifest.get("meta") or {}),
                    shared_bytes=sum(int(item.get("size", 0)) for item in shared),
                    blobs=tuple(item["shared"] for item in shared),
                    manifest=manifest,
                )
            )
        infos.sort(key=lambda info: info.last_used, reverse=True)
        return infos

    def info(self) -> dict[str, Any]:
        """Location, entry count, total size of the entries (shared blobs counted once), cap, and the files
        and bytes of each record store (``stores``)."""
        entries = self.list()
        total, blob_sizes = _disk_usage(entries)
        return {
            "root": str(self.root),
            "root_source": self.root_source,
            "environment_variable": CACHE_ENV,
            "entries": len(entries),
            "total_bytes": total,
            "shared_bytes": sum(blob_sizes.values()),
            "size_limit_bytes": self.size_limit_bytes,
            "stores": store_usage(self.root),
        }

    def remove(self, key: CacheKey | str) -> bool:
        """Remove one entry; False when it does not exist or another process holds its lock."""
        digest = _digest(key)
        return self.entry_path(digest).exists() and self._remove_if_unlocked(digest)

    def clear(self) -> int:
        """Remove everything under the root that no other process is using: every entry (skipping any
        another process holds), shared files, records (but those of a kept entry's graph), the
        conformance work, builds and lock files. Returns the number of entries removed."""
        removed = sum(self._remove_if_unlocked(path.name) for path in self._entry_dirs())
        self._drop_unreferenced(min_age=0)
        shutil.rmtree(self.root / CONFORMANCE_DIR, ignore_errors=True)
        self._sweep_builds(older_than=0)
        self._drop_free_locks()
        for directory in (".tmp", ".locks", BLOBS_DIR):
            with contextlib.suppress(OSError):
                (self.root / directory).rmdir()  # only succeeds when nothing in use is left there
        return removed

    def prune(self, max_bytes: int | None = None) -> list[str]:
        """Evict least-recently-used entries until the cache holds at most ``max_bytes`` (default: the size
        cap); returns the evicted keys. Also removes the records of the graphs no remaining entry uses
        (see ``cache_files.drop_unused_records``) and sweeps stale temporary directories."""
        self._sweep_builds(older_than=STALE_BUILD_SECONDS)
        return self._evict(self.size_limit_bytes if max_bytes is None else max_bytes)

    def _evict(self, max_bytes: int, keep: str | None = None) -> list[str]:
        entries = self.list()
        total, blob_sizes = _disk_usage(entries)
        users = Counter(blob for entry in entries for blob in entry.blobs)
        evicted, evicted_graphs = [], set()
        for entry in reversed(entries):  # least recently used first
            if total <= max_bytes:
                break
            if entry.key == keep:
                continue
            if self._remove_if_unlocked(entry.key):
                total -= entry.size_bytes - entry.shared_bytes
                for blob in entry.blobs:  # the last entry that used a shared file frees it
                    users[blob] -= 1
                    if users[blob] == 0 and blob in blob_sizes:
                        total -= blob_sizes.pop(blob)
                evicted.append(entry.key)
                evicted_graphs.add(entry.graph)
                _logger.info("evicted cache entry %s (%s)", entry.key, format_byte_size(entry.size_bytes))
        self._drop_unreferenced(gone=evicted_graphs)
        if total > max_bytes:
            _logger.warning(
                "the executable cache at %s holds %s, above its cap of %s, after evicting what it could",
                self.root,
                format_byte_size(total),
                format_byte_size(max_bytes),
            )
        return evicted

    def _remove_if_unlocked(self, digest: str) -> bool:
        with self._if_free(digest) as free:
            path = self.root / digest[:2] / digest
            if not free or not path.exists():
                return False
            self._remove_entry_files(path)
            self._remove_dir(path)
            return True

    def _remove_dir(self, path: Path) -> None:
        """Make ``path`` disappear at once (rename), then delete it."""
        trash = Path(tempfile.mkdtemp(prefix="removed-", dir=self._tmp_dir()))
        try:
            os.replace(path, trash / path.name)
        except FileNotFoundError:
            pass
        shutil.rmtree(trash, ignore_errors=True)
        with contextlib.suppress(OSError):
            path.parent.rmdir()  # only succeeds when the shard directory is now empty

    def _sweep_builds(self, older_than: float) -> None:
        """Remove the temporary directories older than ``older_than`` seconds, but a build whose key
        another process holds (its directory is named after the key)."""
        tmp = self.root / ".tmp"
        if not tmp.is_dir():
            return
        now = time.time()
        for child in tmp.iterdir():
            if now - (_mtime(child) or now) < older_than:
                continue
            key = child.name.split("-", 1)[0]
            if not _KEY_PATTERN.match(key):
                shutil.rmtree(child, ignore_errors=True)
                continue
            with self._if_free(key) as free:
                if free:
                    shutil.rmtree(child, ignore_errors=True)

    def _drop_free_locks(self) -> None:
        """Remove the lock files no process holds, each while this process holds it."""
        locks = self.root / ".locks"
        if not locks.is_dir():
            return
        for path in locks.glob("*.lock"):
            with self._if_free(path.stem) as free:
                if free:
                    path.unlink(missing_ok=True)

    def _entry_dirs(self) -> Iterator[Path]:
        return _sharded(self.root, _KEY_PATTERN)


# ----------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------


def _sharded(directory: Path, pattern: re.Pattern[str]) -> Iterator[Path]:
    """The directories ``<directory>/<name[:2]>/<name>`` whose name matches ``pattern``, sorted."""
    if not directory.is_dir():
        return
    for shard in sorted(directory.iterdir()):
        if len(shard.name) == 2 and shard.is_dir():
            for path in sorted(shard.iterdir()):
                if pattern.match(path.name) and path.name[:2] == shard.name and path.is_dir():
                    yield path


def _disk_usage(entries: Sequence[CacheEntryInfo]) -> tuple[int, dict[str, int]]:
    """What the entries hold on disk (each entry's own files, each shared file once), and the size of
    each shared file they use."""
    sizes: dict[str, int] = {}
    for entry in entries:
        for blob in entry.blobs:
            sizes[blob] = entry.shared_bytes // max(1, len(entry.blobs))
    return sum(entry.size_bytes - entry.shared_bytes for entry in entries) + sum(sizes.values()), sizes


def _located(root: Path, at: str) -> Path | None:
    """The file a manifest's ``at`` names, or None when it is not a path inside the group directories."""
    relative = PurePosixPath(at)
    if relative.is_absolute() or ".." in relative.parts or relative.parts[:1] != (BLOBS_DIR,):
        return None
    return root / relative


def _grouped_files(root: Path, manifest: dict[str, Any] | None) -> Iterator[tuple[dict[str, Any], Path]]:
    """Each of a manifest's files that lives in a group directory, with where it is."""
    for item in ((manifest or {}).get("files") or {}).values():
        if isinstance(item, dict) and isinstance(item.get("at"), str):
            located = _located(root, item["at"])
            if located is not None:
                yield item, located


def _digest(key: CacheKey | str) -> str:
    digest = key.digest if isinstance(key, CacheKey) else key
    if not isinstance(digest, str) or not _KEY_PATTERN.match(digest):
        raise CacheError(f"a cache key must be a 64-character lowercase sha256 hex digest, got {digest!r}")
    return digest


def _payload_files(directory: Path) -> Iterator[Path]:
    for path in directory.rglob("*"):
        if path.is_file() and path.relative_to(directory).as_posix() not in (MANIFEST_NAME, LAST_USED_NAME):
            yield path


def _read_manifest(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    try:
        manifest = json.loads((path / MANIFEST_NAME).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, "manifest.json is missing"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"manifest.json is unreadable ({exc})"
    if not isinstance(manifest, dict):
        return None, "manifest.json is not an object"
    return manifest, None


def _check_entry(path: Path, digest: str) -> tuple[dict[str, Any] | None, str | None]:
    """The manifest and None when every file matches it, else None and what is wrong."""
    manifest, problem = _read_manifest(path)
    if manifest is None:
        return None, problem
    if manifest.get("format") != CACHE_FORMAT_VERSION or manifest.get("key") != digest:
        return None, "manifest.json belongs to another key or cache format"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return None, "manifest.json lists no files"
    for name, expected in files.items():
        relative = PurePosixPath(name)
        if relative.is_absolute() or ".." in relative.parts or not isinstance(expected, dict):
            return None, f"manifest.json lists an invalid file {name!r}"
        file_path = path / relative
        if "at" in expected:  # a file in a shared group directory
            located = _located(path.parent.parent, str(expected["at"]))
            if located is None:
                return None, f"manifest.json places {name!r} outside the shared directories"
            file_path = located
        try:
            size = file_path.stat().st_size
            if size != expected.get("size"):
                return None, f"{name} has {size} bytes, the manifest says {expected.get('size')}"
            if checksum_file(file_path) != expected.get(CHECKSUM):
                return None, f"{name} does not match its {CHECKSUM} checksum"
        except FileNotFoundError:
            return None, f"{name} is missing"
        except OSError as exc:
            return None, f"{name} is unreadable ({exc})"
    return manifest, None


def _touch(path: Path) -> None:
    try:
        path.touch()
        os.utime(path, None)
    except OSError as exc:  # a read-only cache still serves entries; LRU order just stops updating
        _logger.debug("cannot update %s: %s", path, exc)


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _size_or_zero(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _fsync(path: Path, directory: bool = False) -> None:
    if directory and os.name == "nt":
        return  # directories cannot be opened for fsync on Windows; NTFS journals the rename
    fd = os.open(path, os.O_RDWR if os.name == "nt" else os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
