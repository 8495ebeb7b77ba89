"""A read-only, verified layer of compiled executables shared by a fleet (docs/deployment.md).

A fleet's replicas read one cache root that an operator filled ahead of time (``optimum-ipu compile``
into it, then ``optimum-ipu cache sign``), baked into an image or on a shared mount, beside each
replica's own writable cache. The shared directory may be writable by others, so nothing in it is
trusted by its checksums alone (the cache's XXH3 detects accidents, not an adversary):

* ``optimum-ipu cache sign`` writes ``shared-signature.json`` into each entry: the SHA-256 and size of
  the manifest and of every payload file, and an HMAC-SHA256 over that record under the operator's key.
* A replica that misses an entry locally looks in the shared layer. It copies the entry's files into
  its local build directory, hashing the bytes it copied, and keeps them only if the signature is present,
  its HMAC verifies under the replica's key, and every copied file has the signed size and SHA-256. The
  copy then becomes a local entry by the local cache's own atomic commit. An entry that fails any check
  is refused, named in the log with the reason, and compiled locally instead: the same call gets the
  same result whether or not the shared layer helped.

Configured by the environment: ``OPTIMUM_IPU_SHARED_CACHE`` (the shared root) and the key, from
``OPTIMUM_IPU_SHARED_CACHE_KEY_FILE`` (a file, e.g. a mounted Kubernetes secret) or
``OPTIMUM_IPU_SHARED_CACHE_KEY`` (the key itself). A shared root without a key is a configuration error:
an unverified layer is never read.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from optimum_ipu_backend.errors import ConfigurationError

_logger = logging.getLogger(__name__)

SHARED_CACHE_ENV = "OPTIMUM_IPU_SHARED_CACHE"
SHARED_KEY_FILE_ENV = "OPTIMUM_IPU_SHARED_CACHE_KEY_FILE"
SHARED_KEY_ENV = "OPTIMUM_IPU_SHARED_CACHE_KEY"
SIGNATURE_NAME = "shared-signature.json"
SIGNATURE_FORMAT = 1
_MANIFEST = "manifest.json"
_BLOBS = "blobs"
_CHUNK = 1 << 20


def read_key(key_file: str | os.PathLike[str] | None = None) -> bytes:
    """The operator's key: ``key_file``'s bytes (surrounding whitespace stripped), else the environment's."""
    path = key_file or os.environ.get(SHARED_KEY_FILE_ENV)
    if path:
        try:
            key = Path(path).read_bytes().strip()
        except OSError as exc:
            raise ConfigurationError(f"cannot read the shared cache key file {path}: {exc}") from None
    else:
        key = os.environ.get(SHARED_KEY_ENV, "").strip().encode()
    if len(key) < 16:
        raise ConfigurationError(
            f"the shared cache key must hold at least 16 bytes; set {SHARED_KEY_FILE_ENV} to a file "
            f"holding it (or {SHARED_KEY_ENV} to the key itself)"
        )
    return key


def _signed_record(digest: str, files: Mapping[str, Mapping[str, Any]]) -> bytes:
    return json.dumps({"format": SIGNATURE_FORMAT, "key": digest, "files": files}, sort_keys=True).encode()


def _mac(key: bytes, digest: str, files: Mapping[str, Mapping[str, Any]]) -> str:
    return hmac.new(key, _signed_record(digest, files), hashlib.sha256).hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _entry_files(root: Path, entry: Path, manifest: Mapping[str, Any]) -> dict[str, Path]:
    """Where each payload file of an entry is (in the entry, or in a group directory under ``root``)."""
    located: dict[str, Path] = {}
    for name, item in manifest["files"].items():
        relative = PurePosixPath(name)
        if relative.is_absolute() or ".." in relative.parts:
            raise ValueError(f"the manifest lists an invalid file {name!r}")
        at = item.get("at") if isinstance(item, dict) else None
        if at is not None:
            at_path = PurePosixPath(str(at))
            if at_path.is_absolute() or ".." in at_path.parts or at_path.parts[:1] != (_BLOBS,):
                raise ValueError(f"the manifest places {name!r} outside the group directories")
            located[name] = root / at_path
        else:
            located[name] = entry / relative
    return located


def sign_entries(root: str | os.PathLike[str], key: bytes) -> list[str]:
    """Sign every entry under the cache root ``root`` (``shared-signature.json`` in each); their keys."""
    root = Path(root)
    signed = []
    for manifest_path in sorted(root.glob(f"[0-9a-f][0-9a-f]/*/{_MANIFEST}")):
        entry = manifest_path.parent
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = {_MANIFEST: {"size": manifest_path.stat().st_size, "sha256": _sha256(manifest_path)}}
        for name, path in _entry_files(root, entry, manifest).items():
            files[name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
        record = {"format": SIGNATURE_FORMAT, "files": files, "hmac": _mac(key, entry.name, files)}
        (entry / SIGNATURE_NAME).write_text(json.dumps(record, indent=1, sort_keys=True), encoding="utf-8")
        signed.append(entry.name)
    return signed


class SharedLayer:
    """The read-only layer: copies verified entries into a local build directory (see the module doc)."""

    def __init__(self, root: str | os.PathLike[str], key: bytes) -> None:
        self.root = Path(root)
        self._key = key

    def __repr__(self) -> str:
        return f"SharedLayer(root={str(self.root)!r})"

    def copy_verified(self, digest: str, staging: Path) -> str | None:
        """Copy entry ``digest``'s payload files into ``staging``; None when they are verified, else why not
        (``"absent"`` when the layer has no such entry). ``staging`` is left empty on failure."""
        entry = self.root / digest[:2] / digest
        if not (entry / _MANIFEST).is_file():
            return "absent"
        try:
            problem = self._copy(digest, entry, staging)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problem = f"unreadable ({type(exc).__name__}: {exc})"
        if problem is not None:
            for child in list(staging.iterdir()):
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        return problem

    def _copy(self, digest: str, entry: Path, staging: Path) -> str | None:
        signature_path = entry / SIGNATURE_NAME
        if not signature_path.is_file():
            return f"{SIGNATURE_NAME} is missing (the entry was never signed)"
        signature = json.loads(signature_path.read_text(encoding="utf-8"))
        signed = signature.get("files")
        if signature.get("format") != SIGNATURE_FORMAT or not isinstance(signed, dict):
            return f"{SIGNATURE_NAME} is not a signature of format {SIGNATURE_FORMAT}"
        if not hmac.compare_digest(str(signature.get("hmac")), _mac(self._key, digest, signed)):
            return "the signature does not verify under this replica's key"
        manifest_bytes = (entry / _MANIFEST).read_bytes()
        if hashlib.sha256(manifest_bytes).hexdigest() != signed.get(_MANIFEST, {}).get("sha256"):
            return "manifest.json differs from the signed one"
        manifest = json.loads(manifest_bytes)
        located = _entry_files(self.root, entry, manifest)
        if set(located) | {_MANIFEST} != set(signed):
            return "the entry's files differ from the signed ones"
        for name, source in located.items():
            target = staging / PurePosixPath(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            digest_of_copy, size = _copy_hashing(source, target)
            if size != signed[name].get("size") or digest_of_copy != signed[name].get("sha256"):
                return f"{name} differs from the signed file (size {size}, sha256 {digest_of_copy[:16]}...)"
        return None

    def filling(self, digest: str, build: Callable[[Path], None]) -> Callable[[Path], None]:
        """``build`` that first tries the shared layer: a verified entry is copied, anything else is
        logged (a refusal as a warning naming the entry) and built by ``build``."""

        def build_from_shared_or_locally(staging: Path) -> None:
            problem = self.copy_verified(digest, staging)
            if problem is None:
                _logger.info("cache entry %s copied from the shared layer %s (verified)", digest, self.root)
                return
            if problem != "absent":
                _logger.warning(
                    "shared cache entry %s refused: %s; compiling it locally",
                    self.root / digest[:2] / digest,
                    problem,
                )
            build(staging)

        return build_from_shared_or_locally


def _copy_hashing(source: Path, target: Path) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with open(source, "rb") as reader, open(target, "wb") as writer:
        while chunk := reader.read(_CHUNK):
            digest.update(chunk)
            writer.write(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def shared_layer_from_environment() -> SharedLayer | None:
    """The layer ``OPTIMUM_IPU_SHARED_CACHE`` names, with the operator's key; None when it is unset."""
    root = os.environ.get(SHARED_CACHE_ENV)
    if not root:
        return None
    if not Path(root).is_dir():
        raise ConfigurationError(f"{SHARED_CACHE_ENV}={root} is not a directory")
    return SharedLayer(root, read_key())
