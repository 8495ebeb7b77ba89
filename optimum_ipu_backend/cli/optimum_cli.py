"""``optimum-cli ipu ...`` and ``optimum-cli export ipu ...``: our commands inside Optimum's CLI.

The registration module ``optimum/commands/register/register_optimum_ipu.py`` (shipped in our wheel,
in Optimum's PEP 420 namespace) lists the two classes below. ``optimum-cli`` builds every registered
command's parser at start-up, also for ``optimum-cli --help``; importing our subcommand modules costs
more than the rest of ``optimum-cli`` together, so the ``ipu`` parser gets its subcommands only when
the command line selects ``ipu``. Its parser is then built by ``cli.main.configure_parser``, the
function ``optimum-ipu`` uses, so both have the same subcommands, arguments and ``--help``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo

from optimum_ipu_backend.cli import main as ipu_main
from optimum_ipu_backend.cli.export import EXPORT_HELP, add_export_arguments, run_export

IPU_HELP = "Graphcore IPU tools of optimum-ipu-backend (the optimum-ipu command's subcommands)"


def _selected(*words: str) -> bool:
    """Whether ``optimum-cli``'s command line starts with ``words`` (``optimum-cli`` parses sys.argv)."""
    return sys.argv[1 : 1 + len(words)] == list(words)


class _Service:
    """What ``optimum-cli`` expects ``args.func(args)`` to return: an object whose ``run()`` runs the
    command. Exits with the command's status, which ``optimum-cli`` itself would drop."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def run(self) -> None:
        self.args.func = self.args.ipu_func
        raise SystemExit(ipu_main.run_parsed(self.args))


class IPUCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name="ipu", help=IPU_HELP)

    @staticmethod
    def parse_args(parser: argparse.ArgumentParser) -> None:
        if not _selected("ipu"):
            return  # `optimum-cli --help` or another command: only the name and help line are needed
        subparsers = ipu_main.configure_parser(parser)
        # Our subcommands set `func` to a function returning an exit status; optimum-cli calls
        # `args.func(args).run()`. Keep ours under another name and hand optimum-cli a service.
        for subcommand in subparsers.choices.values():
            run = subcommand.get_default("func")
            if run is None:
                raise RuntimeError(f"optimum-ipu subcommand {subcommand.prog!r} sets no func on its parser")
            subcommand.set_defaults(func=_Service, ipu_func=run)


class IPUExportCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name="ipu", help=EXPORT_HELP)

    @staticmethod
    def parse_args(parser: argparse.ArgumentParser) -> None:
        parser.description = EXPORT_HELP
        add_export_arguments(parser)

    def run(self) -> Any:
        self.args.func = run_export
        raise SystemExit(ipu_main.run_parsed(self.args))
