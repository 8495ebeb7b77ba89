"""The records kept under the cache root beside the executable entries, and their maintenance.

Every record (a graph description, a padding proof) is written through ``write_record`` and read through
``read_record``, so one integrity scheme covers them: a reader sees the old file, no file, or the whole
new one, and a record whose hash or format does not match is never served (it reads as missing, and the
caller computes it again). An executable entry's ``manifest.json`` is not such a record: it is fsynced
inside the entry's build directory before the rename that commits the entry, its own checksums cover
every payload file, and ``optimum-ipu cache info KEY`` shows it as stored.

``ExecutableCache`` maintains the record stores with its entries: ``store_usage`` for ``list``/``info``,
``drop_unused_records`` for ``prune``, size-limit eviction and ``clear``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Set
from pathlib import Path
from typing import Any

_logger = logging.getLogger(__name__)

# The stores of records under the cache root, beside the executable entries; cache maintenance
# (``optimum-ipu cache list/info/prune/clear``) covers each of them.
DESCRIPTIONS_DIR = "graphs"  # graph descriptions, keyed by the graph's content
PROOFS_DIR = "padding-proofs"  # padding proofs, under the digest of the graph they prove
CONFORMANCE_DIR = "conformance"  # the conformance suite's built models, exports and node cases
PLANS_DIR = "serving-plans"  # serving plans and their length histograms, under the graph's digest
# which entry holds the graph legalized for a signature, under the graph's digest: the entries of other
# engines, devices and SDK versions legalize the same graph, shapes and options to the same graph
LEGALIZED_DIR = "legalized-graphs"
STORES = (DESCRIPTIONS_DIR, PROOFS_DIR, CONFORMANCE_DIR, PLANS_DIR, LEGALIZED_DIR)
# A record of a graph no entry uses is kept this long after it was written (see ``drop_unused_records``).
UNUSED_RECORD_SECONDS = 24 * 3600


@functools.cache
def code_identity() -> str:
    """This package's version and a digest of its Python sources: what every cached record and
    executable is keyed with beside its own inputs, so a changed compiler (a new release, or an edited
    development checkout) never serves what an older one computed. Read once per process (~1 MB)."""
    from optimum_ipu_backend import __version__

    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for source in sorted(package.rglob("*.py")):
        digest.update(source.relative_to(package).as_posix().encode())
        digest.update(source.read_bytes())
    return f"{__version__}+{digest.hexdigest()[:16]}"


def _body_hash(body: Any) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_record(path: Path, form: int, what: str) -> Any:
    """The body stored at ``path`` in format ``form``, or None if it is missing, of another format,
    unreadable or fails its hash. ``what`` names the record in the warning a corrupt one gets."""
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        if stored.get("format") != form:
            return None
        body = stored["body"]
        if _body_hash(body) != stored["sha256"]:
            raise ValueError("hash mismatch")
        return body
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        _logger.warning("ignoring the corrupt %s %s (%s); computing it again", what, path, exc)
        return None


def write_record(path: Path, form: int, body: Any, what: str) -> None:
    """Store ``body`` at ``path`` atomically; a cache that cannot be written costs time, never results."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"format": form, "body": body, "sha256": _body_hash(body)})
        temporary = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
    except OSError as exc:
        _logger.info("could not store the %s %s: %s", what, path, exc)


def graph_digest(content_key: str) -> str:
    """The digest a graph's executables (``CacheKey``'s ``graph_sha256``) and padding proofs
    (``<PROOFS_DIR>/<digest>/``) are keyed by, from the content key its description is stored under
    (``<DESCRIPTIONS_DIR>/<content key>.json``): maintenance maps one to the other without reading a
    record."""
    return hashlib.sha256(content_key.encode()).hexdigest()


def tree_usage(directory: Path) -> dict[str, int]:
    """The number of ``files`` under ``directory`` and their ``bytes``."""
    sizes = []
    for path in directory.rglob("*"):
        with contextlib.suppress(OSError):  # removed while counted
            if path.is_file():
                sizes.append(path.stat().st_size)
    return {"files": len(sizes), "bytes": sum(sizes)}


def store_usage(root: Path) -> dict[str, dict[str, int]]:
    """The number of files and their bytes in each of ``STORES`` under ``root``."""
    return {store: tree_usage(root / store) for store in STORES}


def drop_unused_records(
    root: Path, used: Set[str], gone: Set[str] = frozenset(), min_age: float = UNUSED_RECORD_SECONDS
) -> None:
    """Remove the graph descriptions, padding proofs, serving plans and legalized-graph records of the
    graphs whose digest is not in ``used`` (the graphs the cache's entries were built from): at once for
    the graphs in ``gone`` (their last entry was just evicted), the others once unchanged for ``min_age``
    seconds; and each store once empty.

    The wait spares a session that has described a graph and not yet stored its first executable (a
    seq2seq model's decoder while its encoder compiles): its description would be missing on the next
    warm start. Removing a record costs time, never results: it reads as missing and is computed again.
    Temporary files of a write in progress go with their record (that write is then skipped)."""
    now = time.time()
    by_graph = ((DESCRIPTIONS_DIR, graph_digest), (PROOFS_DIR, str), (PLANS_DIR, str), (LEGALIZED_DIR, str))
    for store, digest_of in by_graph:
        directory = root / store
        if not directory.is_dir():
            continue
        for path in directory.iterdir():
            digest = digest_of(path.name.split(".")[0])
            with contextlib.suppress(OSError):  # removed meanwhile
                if digest in used or (digest not in gone and now - path.stat().st_mtime < min_age):
                    continue
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink()
        with contextlib.suppress(OSError):
            directory.rmdir()  # only succeeds when no record is left
