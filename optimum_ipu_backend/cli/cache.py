"""``optimum-ipu cache list|info|clear|prune|sign``: inspect and trim the executable cache and the record
stores under its root; sign its entries for a fleet's shared layer (runtime/shared_cache.py)."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

from optimum_ipu_backend.runtime.executable_cache import (
    CACHE_ENV,
    ExecutableCache,
    format_byte_size,
    parse_byte_size,
)


def add_cache_parser(subparsers: Any) -> None:
    """Add the ``cache`` command (with its ``list``, ``info``, ``clear`` and ``prune`` actions)."""
    parser = subparsers.add_parser(
        "cache",
        help="inspect or trim the cache of legalized graphs and compiled executables",
        description=(
            "Inspect or trim the executable cache. Its location is --dir, else the "
            f"{CACHE_ENV} environment variable, else the platform's user cache directory."
        ),
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--dir", dest="cache_dir", default=None, help=f"cache directory (default: ${CACHE_ENV})"
    )
    common.add_argument("--json", action="store_true", help="print machine-readable JSON")
    actions = parser.add_subparsers(dest="cache_action", required=True)
    actions.add_parser(
        "list",
        parents=[common],
        help="the entries, most recently used first: model, graph file, shapes, precision, engine, device; "
        "then the record stores",
    )
    info = actions.add_parser(
        "info",
        parents=[common],
        help="location, entry count, total size, size cap and record stores; with KEY, that entry's whole "
        "manifest",
    )
    info.add_argument("key", nargs="?", default=None, help="an entry's key, or a unique prefix of it")
    actions.add_parser(
        "clear", parents=[common], help="remove every entry and record: an empty cache directory"
    )
    prune = actions.add_parser(
        "prune", parents=[common], help="evict least-recently-used entries until the cache fits a size"
    )
    prune.add_argument(
        "--max-size",
        default=None,
        help="size to fit, e.g. 2GB, 500MiB or a byte count (default: the cache's size cap)",
    )
    sign = actions.add_parser(
        "sign",
        parents=[common],
        help="sign every entry for use as a fleet's read-only shared layer (OPTIMUM_IPU_SHARED_CACHE)",
    )
    sign.add_argument(
        "--key-file", default=None, help="the operator's key (default: $OPTIMUM_IPU_SHARED_CACHE_KEY_FILE)"
    )
    parser.set_defaults(func=run_cache)


def run_cache(args: argparse.Namespace) -> int:
    """Run one ``cache`` action; returns the process exit status (2 for a bad ``--max-size``)."""
    cache = ExecutableCache(getattr(args, "cache_dir", None))
    action = args.cache_action
    if action == "sign":
        return _sign(cache, args)
    if action == "info" and getattr(args, "key", None):
        return _print_manifest(cache, args.key, bool(getattr(args, "json", False)))
    if action == "list":
        report: Any = [{**entry.to_dict(), **_facts(entry.manifest)} for entry in cache.list()]
        text = partial(_print_entries, cache, report)
    elif action == "info":
        report = cache.info()
        text = partial(_print_info, report)
    elif action == "clear":
        report, after = _removal_report(cache, "removed", cache.clear)
        report["skipped_in_use"] = after["entries"]
        kept = f"; {after['entries']} being built by another process were kept" if after["entries"] else ""
        text = partial(
            print,
            f"Removed {_entries(report['removed'])} ({format_byte_size(report['freed_bytes'])}){kept} "
            f"from {cache.root}",
        )
    elif action == "prune":
        max_size = getattr(args, "max_size", None)
        try:
            max_bytes = cache.size_limit_bytes if max_size is None else parse_byte_size(max_size)
        except ValueError as exc:
            print(f"optimum-ipu cache prune: --max-size: {exc}", file=sys.stderr)
            return 2
        report, after = _removal_report(cache, "evicted", lambda: cache.prune(max_bytes))
        report.update(max_bytes=max_bytes, total_bytes=after["total_bytes"])
        text = partial(
            print,
            f"Evicted {_entries(len(report['evicted']))} ({format_byte_size(report['freed_bytes'])}); "
            f"{cache.root} now holds {format_byte_size(after['total_bytes'])} "
            f"(limit {format_byte_size(max_bytes)})",
        )
    else:
        raise ValueError(f"unknown cache action {action!r}")
    if getattr(args, "json", False):
        _print_json(report)
    else:
        text()
    return 0


def _sign(cache: ExecutableCache, args: argparse.Namespace) -> int:
    from optimum_ipu_backend.errors import ConfigurationError
    from optimum_ipu_backend.runtime.shared_cache import read_key, sign_entries

    try:
        key = read_key(getattr(args, "key_file", None))
    except ConfigurationError as exc:
        print(f"optimum-ipu cache sign: {exc}", file=sys.stderr)
        return 2
    signed = sign_entries(cache.root, key)
    if getattr(args, "json", False):
        _print_json({"root": str(cache.root), "signed": signed})
    else:
        print(f"Signed {_entries(len(signed))} in {cache.root}")
    return 0


def _removal_report(
    cache: ExecutableCache, result_key: str, remove: Callable[[], Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``remove`` and report it (the root, its result under ``result_key`` and the bytes it freed),
    with ``cache.info()`` as it stands afterwards."""
    before = cache.info()
    result = remove()
    after = cache.info()
    return {
        "root": str(cache.root),
        result_key: result,
        "freed_bytes": _on_disk(before) - _on_disk(after),
    }, after


def _on_disk(info: dict[str, Any]) -> int:
    """The entries' bytes and the record stores'."""
    return info["total_bytes"] + sum(store["bytes"] for store in info["stores"].values())


def _print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


def _entries(count: int) -> str:
    return f"{count} entr{'y' if count == 1 else 'ies'}"


def _timestamp(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return datetime.datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S")


def _facts(manifest: dict[str, Any]) -> dict[str, Any]:
    """What an entry was built from: its manifest's description, else what its key records."""
    meta = manifest.get("meta") or {}
    key = manifest.get("key_inputs") or {}
    return {
        "model": meta.get("model"),
        "graph_file": meta.get("graph_file"),
        "shapes": meta.get("shapes") or key.get("shapes"),
        "precision": meta.get("precision") or key.get("precision"),
        "device": meta.get("device") or (key.get("options") or {}).get("device"),
    }


def _shapes(shapes: Any) -> str:
    if not isinstance(shapes, dict) or not shapes:
        return "-"
    return ", ".join(f"{name}={'x'.join(map(str, dims))}" for name, dims in sorted(shapes.items()))


def _print_entries(cache: ExecutableCache, entries: list[dict[str, Any]]) -> None:
    info = cache.info()  # a model's shared weight file counted once, not per entry
    if not entries and not any(store["files"] for store in info["stores"].values()):
        print(f"The cache at {cache.root} is empty.")
        return
    if entries:
        print(f"{'KEY':<16}  {'SIZE':>10}  {'LAST USED':<19}  MODEL / GRAPH FILE")
    for entry in entries:
        source = "/".join(str(part) for part in (entry["model"], entry["graph_file"]) if part) or "-"
        if not entry["readable"]:
            source = "(unreadable manifest)"
        print(
            f"{entry['key'][:16]:<16}  {format_byte_size(entry['size_bytes']):>10}  "
            f"{_timestamp(entry['last_used']):<19}  {source}"
        )
        print(
            f"{'':<16}  shapes {_shapes(entry['shapes'])}; precision {entry['precision'] or '-'}; "
            f"engine {entry['engine'] or '-'}; device {entry['device'] or '-'}"
        )
    print(f"{_entries(len(entries))}, {format_byte_size(info['total_bytes'])} in {cache.root}")
    _print_stores(info)


def _print_manifest(cache: ExecutableCache, key: str, as_json: bool) -> int:
    """``cache info KEY``: the whole manifest of the one entry whose key starts with ``key``."""
    matches = [entry for entry in cache.list() if entry.key.startswith(key)]
    if len(matches) != 1:
        found = "no entry" if not matches else f"{len(matches)} entries ({', '.join(e.key for e in matches)})"
        print(
            f"optimum-ipu cache info: {found} in {cache.root} has a key starting with {key!r}; "
            "`optimum-ipu cache list` shows the keys",
            file=sys.stderr,
        )
        return 1
    if not as_json:
        print(f"entry: {matches[0].path}")
    _print_json(matches[0].manifest)
    return 0


def _print_info(info: dict[str, Any]) -> None:
    source = {
        "argument": "--dir",
        "environment": f"${info['environment_variable']}",
        "default": "platform default",
    }[info["root_source"]]
    print(f"location:   {info['root']} (from {source})")
    print(f"entries:    {info['entries']}")
    print(f"total size: {format_byte_size(info['total_bytes'])}")
    print(f"of which:   {format_byte_size(info['shared_bytes'])} in weight files shared by a model's shapes")
    print(f"size cap:   {format_byte_size(info['size_limit_bytes'])}")
    _print_stores(info)


def _print_stores(info: dict[str, Any]) -> None:
    for name, store in info["stores"].items():
        print(f"store:      {name}/ {format_byte_size(store['bytes'])} in {store['files']} file(s)")
