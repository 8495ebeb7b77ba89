"""``optimum-ipu compile MODEL``: fill the executable cache for every bucket, so serving starts warm."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from optimum_ipu_backend.config import parse_assignments
from optimum_ipu_backend.errors import ConfigurationError


def fixed_dims(values: list[str]) -> dict[str, int]:
    """``--dim NAME=SIZE`` arguments: the sizes to compile dimensions no bucket plans at."""
    dims = parse_assignments(values, "--dim", "height=224")
    for name, size in dims.items():
        if not size.isdigit():
            raise ConfigurationError(f"--dim {name}={size!r} must look like NAME=SIZE, e.g. height=224")
    return {name: int(size) for name, size in dims.items()}


def add_compile_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "compile",
        help="compile every bucket of a model into the executable cache",
        description=(
            "Compile every bucket (every compiled shape) of every ONNX graph of MODEL into the executable "
            "cache, with the same provider options a session would get, so a later process serves without "
            "compiling. On IPU hardware, on the IPU Model, or --offline for IPU hardware that is not here."
        ),
    )
    parser.add_argument("model", help="an exported model directory or one .onnx file")
    parser.add_argument(
        "--provider-option",
        "-o",
        action="append",
        default=[],
        metavar="K=V",
        help="a provider option, as for provider_options (device, engine, sequence_lengths, batch_size, ...)",
    )
    parser.add_argument(
        "--offline", action="store_true", help="compile for an offline IPU target (needs the SDK, not an IPU)"
    )
    parser.add_argument(
        "--ipu-version", default=None, help="offline target architecture: ipu2 (default) or ipu21"
    )
    parser.add_argument(
        "--dim", action="append", default=[], metavar="NAME=SIZE", help="size of a dimension no bucket plans"
    )
    parser.add_argument("--parallel", type=int, default=None, help="compiles at once where the engine allows")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=run_compile)


def run_compile(args: argparse.Namespace) -> int:
    from optimum_ipu_backend.session.precompile import fill_cache

    try:
        options = parse_assignments(args.provider_option, "--provider-option", "device=emulator")
        dims = fixed_dims(args.dim)
    except ConfigurationError as exc:
        raise SystemExit(f"optimum-ipu compile: {exc}") from None
    report = fill_cache(
        args.model,
        options,
        offline=args.offline,
        ipu_version=args.ipu_version,
        fixed_dims=dims,
        progress=sys.stderr.isatty() and not args.json,
        parallel=args.parallel,
    )
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    for graph in report:
        compiled = sum(record["source"] == "compiled" for record in graph["executables"])
        where = "offline IPU target" if graph["offline"] else f"device {graph['device']}"
        print(
            f"{graph['graph']}: {len(graph['executables'])} executable(s) on {where}, "
            f"engine {graph['engine']} "
            f"({compiled} compiled, {len(graph['executables']) - compiled} already cached) in "
            f"{graph['executable_cache']}"
        )
    return 0
