"""``optimum-ipu providers``: every provider plugin and onnxruntime's own providers, whether each can run
here and why, and which one ``provider="auto"`` would take."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

# Discovery, the device probes and onnxruntime are imported when the command runs, not when the
# parser is built: `optimum-cli --help` builds it.


# The commands that print a report as text, or as JSON with --json: their help, description and --json help.
REPORT_TEXTS = {
    "providers": (
        "list execution providers (plugins and onnxruntime's), what each would use, and the auto choice",
        "List provider plugins and onnxruntime's own providers, whether each can compute on this machine "
        "and why, and which one provider='auto' takes (see OPTIMUM_PROVIDER_PREFERENCE).",
        "print machine-readable JSON",
    ),
    "env": (
        "print Optimum's environment report followed by optimum-ipu-backend's (for bug reports)",
        "Print what `optimum-cli env` prints, then optimum-ipu-backend's part: package versions, the "
        "optimum-onnx patches, the Poplar SDK, the devices, the auto choice and the cache.",
        "print both parts as one JSON object",
    ),
}


def add_report_parser(subparsers: Any, name: str, run: Callable[[argparse.Namespace], int]) -> None:
    help_text, description, json_help = REPORT_TEXTS[name]
    parser = subparsers.add_parser(name, help=help_text, description=description)
    parser.add_argument("--json", action="store_true", help=json_help)
    parser.set_defaults(func=run)


def add_providers_parser(subparsers: Any) -> None:
    add_report_parser(subparsers, "providers", run_providers)


def ipu_devices() -> list[dict[str, Any]]:
    from optimum_ipu_backend.engines.probe import DEVICE_KINDS, resolve_device

    rows = []
    for device in DEVICE_KINDS:
        try:
            resolution = resolve_device(device)
        except Exception as exc:  # the reason is the output
            usable, engine, emulated, why = False, None, None, str(exc)
        else:
            usable, engine, emulated, why = True, resolution.engine, resolution.emulated, resolution.reason
        rows.append({"device": device, "usable": usable, "engine": engine, "emulated": emulated, "why": why})
    return rows


def auto_report() -> dict[str, Any]:
    from optimum_ipu_backend.integration.auto import PREFERENCE_ENV, ProviderPreferenceError, choose

    try:
        choice = choose()
    except ProviderPreferenceError as exc:
        return {
            "chosen": None,
            "reason": None,
            "order_source": None,
            "preference_env": PREFERENCE_ENV,
            "preference": None,
            "order": [],
            "error": str(exc),
        }
    chosen = choice.chosen
    passed = {id(c) for c in choice.passed_over}
    return {
        "chosen": chosen.name if chosen else None,
        "reason": chosen.reason if chosen else None,
        "order_source": choice.order_source(),
        "preference_env": PREFERENCE_ENV,
        "preference": list(choice.preference) if choice.preference else None,
        "order": [
            {
                "name": c.name,
                "origin": c.origin,
                "priority": c.priority,
                "usable": c.usable,
                "reason": c.reason,
                "status": "chosen" if c is chosen else "passed over" if id(c) in passed else "not reached",
            }
            for c in choice.candidates
        ],
        "error": None if chosen else f"no provider in {choice.order_source()} is usable here",
    }


def collect() -> dict[str, Any]:
    from optimum_ipu_backend.engines.probe import default_device, probe_sdk
    from optimum_ipu_backend.integration.discovery import ENTRY_POINT_GROUP, get_registry, plugin_filter
    from optimum_ipu_backend.integration.ipu_provider import IPU_PROVIDER
    from optimum_ipu_backend.integration.native_providers import available_providers, native_availability

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
            "priority": registration.spec.priority,
            "available": availability.available,
            "emulated": availability.emulated,
            "detail": availability.detail,
        }
        if registration.spec == IPU_PROVIDER:
            entry["default_device"] = default_device()
            entry["devices"] = ipu_devices()
            entry["sdk_probe"] = probe_sdk().lines()
        providers.append(entry)
    allowed = plugin_filter()
    native = []
    for name in available_providers():
        availability = native_availability(name)
        native.append({"name": name, "usable": availability.usable, "reason": availability.reason})
    return {
        "entry_point_group": ENTRY_POINT_GROUP,
        "filter": None if allowed is None else sorted(allowed),
        "providers": providers,
        "native": native,
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
        "auto": auto_report(),
    }


def run_providers(args: argparse.Namespace) -> int:
    """Print the report; exit status 1 when ``provider="auto"`` could not choose (a bad preference or
    nothing usable), 0 otherwise."""
    from optimum_ipu_backend.integration.discovery import PLUGINS_ENV

    report = collect()
    status = 0 if report["auto"]["chosen"] else 1
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return status
    out = sys.stdout
    if report["filter"] is not None:
        out.write(f"{PLUGINS_ENV} limits loading to: {', '.join(report['filter']) or '(none)'}\n")
    out.write("Provider plugins:\n")
    if not report["providers"]:
        out.write("  (none loaded)\n")
    for entry in report["providers"]:
        status_text = "available" if entry["available"] else "not available"
        if entry["available"] and entry["emulated"]:
            status_text = "available (emulated)"
        aliases = f" (aliases: {', '.join(entry['aliases'])})" if entry["aliases"] else ""
        out.write(
            f"  {entry['name']}{aliases} - {entry['distribution']} {entry['version']} - {status_text}, "
            f"priority {entry['priority']}\n"
        )
        out.write(f"    entry point: {entry['entry_point']}\n")
        if "devices" in entry:
            out.write(f"    default device: {entry['default_device']}\n")
            for row in entry["devices"]:
                if row["usable"]:
                    kind = "EMULATION on the host CPU" if row["emulated"] else "hardware"
                    out.write(
                        f"    device {row['device']}: usable, engine {row['engine']} ({kind}): {row['why']}\n"
                    )
                else:
                    out.write(f"    device {row['device']}: not usable: {row['why']}\n")
        elif entry["detail"]:
            out.write(f"    {entry['detail']}\n")
    for broken in report["broken"]:
        out.write(
            f"  BROKEN plugin {broken['entry_point']} ({broken['distribution']} {broken['version']}, "
            f"{broken['value']}): {broken['error']}\n"
        )
    if report["skipped"]:
        out.write(f"  Skipped by {PLUGINS_ENV}: {', '.join(report['skipped'])}\n")
    out.write("onnxruntime providers:\n")
    for entry in report["native"]:
        usable = "computes here" if entry["usable"] else "not usable here"
        out.write(f"  {entry['name']} - {usable}: {entry['reason']}\n")
    _write_auto(out, report["auto"])
    return status


def _write_auto(out: Any, auto: dict[str, Any]) -> None:
    if auto["chosen"] is None and not auto["order"]:
        out.write(f"provider='auto': cannot choose: {auto['error']}\n")
        return
    if auto["chosen"] is None:
        out.write(f"provider='auto': {auto['error']}\n")
    else:
        out.write(f"provider='auto' takes {auto['chosen']}: {auto['reason']}\n")
    out.write(f"  order ({auto['order_source']}):\n")
    marks = {"chosen": "*", "passed over": "-", "not reached": " "}
    for row in auto["order"]:
        line = f"  {marks[row['status']]} {row['name']} ({row['origin']}, priority {row['priority']})"
        if row["status"] == "passed over":
            line += f": passed over: {row['reason']}"
        elif row["status"] == "chosen":
            line += " <- auto"
        out.write(line + "\n")
