"""Entry point of the ``optimum-ipu`` command."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from optimum_ipu_backend import __version__

# subcommand -> (module, function that adds its parser); modules are imported only to build the parser
SUBCOMMANDS = (
    ("optimum_ipu_backend.cli.providers", "add_providers_parser"),
    ("optimum_ipu_backend.compiler.check", "add_check_parser"),
    ("optimum_ipu_backend.cli.cache", "add_cache_parser"),
    ("optimum_ipu_backend.cli.conformance", "add_conformance_parser"),
    ("optimum_ipu_backend.cli.compile", "add_compile_parser"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="optimum-ipu", description="Tools for the optimum-ipu-backend execution provider."
    )
    parser.add_argument("--version", action="version", version=f"optimum-ipu-backend {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name, function in SUBCOMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        getattr(module, function)(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
