"""``optimum-ipu providers``: every discovered provider plugin, whether it can run here, and why."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from optimum_ipu_backend.engines.probe import DEVICES, default_device, probe_sdk, resolve_device
from optimum_ipu_backend.integration.discovery import PLUGINS_ENV, get_registry, plugin_filter
from optimum_ipu_backend.integration.ipu_provider import IPU_PROVIDER


def add_providers_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "providers", help="list execution-provider plugins and what they would use"
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.set_defaults(func=run_providers)


def _ipu_devices() -> list[dict[str, Any]]:
    rows = []
    for device in DEVICES:
        try:
            resolution = resolve_device(device)
        except Exception as exc:  # the reason is the output
            rows.append(
                {"device": device, "usable": False, "engine": None, "emulated": None, "why": str(exc)}
            )
        else:
            rows.append(
                {
                    "device": device,
                    "usable": True,
                    "engine": resolution.engine,
                    "emulated": resolution.emulated,
                    "why": resolution.reason,
                }
            )
    return rows


def collect() -> dict[str, Any]:
    registry = get_registry()
    providers = []
    for registration in registry.registrations():
        availability = registration.probe()
        entry: dict[str, Any] = {
            "name": registration.name,
            "aliases": list(registration.spec.aliases),
            "entry_point": registration.entry_point,
            "distribution": registration.distribution,
            "version": registration.version,
            "available": availability.available,
            "detail": availability.detail,
        }
        if registration.spec == IPU_PROVIDER:
            entry["default_device"] = default_device()
            entry["devices"] = _ipu_devices()
            entry["sdk_probe"] = probe_sdk().lines()
        providers.append(entry)
    allowed = plugin_filter()
    return {
        "entry_point_group": "optimum.onnxruntime.providers",
        "filter": None if allowed is None else sorted(allowed),
        "providers": providers,
        "broken": [
            {
                "entry_point": b.entry_point,
                "value": b.value,
                "distribution": b.distribution,
                "version": b.version,
                "error": f"{type(b.error).__name__}: {b.error}",
            }
            for b in registry.broken()
        ],
        "skipped": registry.skipped(),
    }


def run_providers(args: argparse.Namespace) -> int:
    report = collect()
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    out = sys.stdout
    if report["filter"] is not None:
        out.write(f"{PLUGINS_ENV} limits loading to: {', '.join(report['filter']) or '(none)'}\n")
    if not report["providers"]:
        out.write("No execution-provider plugins are loaded.\n")
    for entry in report["providers"]:
        status = "available" if entry["available"] else "not available"
        aliases = f" (aliases: {', '.join(entry['aliases'])})" if entry["aliases"] else ""
        out.write(f"{entry['name']}{aliases} - {entry['distribution']} {entry['version']} - {status}\n")
        out.write(f"  entry point: {entry['entry_point']}\n")
        if "devices" in entry:
            out.write(f"  default device: {entry['default_device']}\n")
            for row in entry["devices"]:
                if row["usable"]:
                    kind = "EMULATION on the host CPU" if row["emulated"] else "hardware"
                    out.write(
                        f"  device {row['device']}: usable, engine {row['engine']} ({kind}): {row['why']}\n"
                    )
                else:
                    out.write(f"  device {row['device']}: not usable: {row['why']}\n")
        elif entry["detail"]:
            out.write(f"  {entry['detail']}\n")
    for broken in report["broken"]:
        out.write(
            f"BROKEN plugin {broken['entry_point']} ({broken['distribution']} {broken['version']}, "
            f"{broken['value']}): {broken['error']}\n"
        )
    if report["skipped"]:
        out.write(f"Skipped by {PLUGINS_ENV}: {', '.join(report['skipped'])}\n")
    return 0
