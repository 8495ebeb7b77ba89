"""The one way a JSON record is kept under the cache root: written atomically, checked by its own hash.

Every small store of the cache (graph descriptions, padding proofs, conformance results, executable
manifests) writes through ``write_record`` and reads through ``read_record``, so one integrity scheme
covers the whole root: a reader sees the old file, no file, or the whole new one, and a record whose
hash or format does not match is never served (it reads as missing, and the caller computes it again).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

_logger = logging.getLogger(__name__)

# The stores of records under the cache root, beside the executable entries; cache maintenance
# (``optimum-ipu cache list/info/prune/clear``) covers each of them.
DESCRIPTIONS_DIR = "graphs"  # graph descriptions, keyed by the graph's content
PROOFS_DIR = "padding-proofs"  # padding proofs, under the digest of the graph they prove
CONFORMANCE_DIR = "conformance"  # conformance results


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
