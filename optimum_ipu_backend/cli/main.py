"""The ``optimum-ipu`` command, and the one parser ``optimum-cli ipu`` shares with it.

Each subcommand is one entry of ``SUBCOMMANDS``: a module and the function that adds its parser (and
sets ``func``, the function that runs it, on that parser). ``optimum-ipu`` and ``optimum-cli ipu``
(``cli/optimum_cli.py``) both build their parser with ``configure_parser``, so a new entry appears in
both, with the same ``--help``. Subcommand modules import heavy things inside their run function only:
``optimum-cli`` may build this parser.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from optimum_ipu_backend import __version__

PROG = "optimum-ipu"
DESCRIPTION = "Tools for the optimum-ipu-backend execution provider."

# subcommand -> (module, function that adds its parser); modules are imported only to build the parser
SUBCOMMANDS = (
    ("optimum_ipu_backend.cli.providers", "add_providers_parser"),
    ("optimum_ipu_backend.cli.check", "add_check_parser"),
    ("optimum_ipu_backend.cli.cache", "add_cache_parser"),
    ("optimum_ipu_backend.cli.conformance", "add_conformance_parser"),
    ("optimum_ipu_backend.cli.compile", "add_compile_parser"),
    ("optimum_ipu_backend.cli.env", "add_env_parser"),
    ("optimum_ipu_backend.cli.export", "add_export_parser"),
    ("optimum_ipu_backend.cli.serve", "add_serve_parser"),
)

# What a shell reports for a command stopped by SIGPIPE (128 + 13): the reader of our output went away.
CLOSED_STDOUT_STATUS = 141


def configure_parser(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    """Give ``parser`` the description, ``--version`` and every subcommand; returns the subparsers."""
    parser.description = DESCRIPTION
    parser.add_argument("--version", action="version", version=f"optimum-ipu-backend {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name, function in SUBCOMMANDS:
        # A missing subcommand module is a packaging mistake: let its ImportError surface.
        getattr(importlib.import_module(module_name), function)(subparsers)
    return subparsers


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog)
    configure_parser(parser)
    return parser


def _discard_stdout() -> None:
    """The reader closed our stdout: point it at /dev/null so the interpreter's final flush is quiet."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def run_parsed(args: argparse.Namespace) -> int:
    """Run the subcommand ``args`` selected; returns its exit status."""
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:  # `optimum-ipu providers | head -1`
        _discard_stdout()
        return CLOSED_STDOUT_STATUS
    return status


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except BrokenPipeError:  # `optimum-ipu --help | head -1`
        _discard_stdout()
        return CLOSED_STDOUT_STATUS
    return run_parsed(args)


if __name__ == "__main__":
    sys.exit(main())
