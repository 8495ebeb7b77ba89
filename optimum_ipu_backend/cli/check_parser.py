"""The arguments and help of `optimum-ipu check` (the work is in ``cli/check.py``, imported when the
command runs): the command-line parser is built for every ``optimum-ipu`` and ``optimum-cli`` call, so
this module imports nothing heavy."""

from __future__ import annotations

import argparse
from pathlib import Path

from optimum_ipu_backend.runtime.ipu_config import PRECISIONS

DESCRIPTION = """\
`optimum-ipu check PATH`: legalize every ONNX graph of a model and say whether PopART can take it.

PATH is a model directory (its ``*.onnx`` files, sizes from its ``config.json``), one ``.onnx`` file, or
a transformers checkpoint without ONNX files, which is exported first as ``optimum-cli export onnx``
would (the task inferred from the config, ``--task`` to choose another).

Sizes not given with ``--dim``/``--shape`` are those the runtime compiles by default: one sample, the
bucket plan's largest size of each other dimension, one new token for a decoder that takes a past, and
a past that leaves room for that token within the model's positions. A size over the model's limit is
reported as such. Graphs are checked as the runtime serves them: a classification head's end-of-sentence
selection (BART, MBart) and a top-k mixture-of-experts selection are computed densely, with a note on
what each needs of a call or costs.

``--verify-padding`` also runs each graph on the host emulator, padded and at exact sizes, and compares
the real outputs; it prints each dimension's padding verdict (padded because the padding proof holds, or
compiled at exact sizes and the node that breaks the proof).

Exit status 0 means every graph is PopART-ready (and, with ``--verify-padding``, padding changed no real
output); 1 means at least one is not; 2 is a usage error.
"""

# Tolerance of --verify-padding: padded and exact-size runs of the same graph on the emulator.
DEFAULT_ATOL = 1e-4


def _run_check(args: argparse.Namespace) -> int:
    from optimum_ipu_backend.cli.check import run_check

    return run_check(args)


def add_check_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``check`` on an ``optimum-ipu`` subcommand parser."""
    parser = subparsers.add_parser(
        "check",
        help="legalize a model's ONNX graphs for PopART and report what is left",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=_run_check)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path",
        type=Path,
        help="a model directory with .onnx files and config.json, one .onnx, or a transformers checkpoint",
    )
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME=DIMS",
        help="static shape of one graph input, e.g. input_ids=1,128 (repeatable)",
    )
    parser.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="DIM=SIZE",
        help="size of a symbolic dimension, e.g. sequence_length=128 or batch_size=4 (repeatable)",
    )
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument(
        "--ipus",
        type=int,
        default=1,
        metavar="N",
        help="shard each graph over N IPUs (as ipus_per_replica=N) and report the memory of each IPU",
    )
    parser.add_argument(
        "--layers-per-ipu",
        metavar="COUNTS",
        help="with --ipus: layers per IPU as in ipu_config.json, e.g. 2,-1 (default: balanced by memory)",
    )
    parser.add_argument("--save", type=Path, metavar="DIR", help="write the legalized graph(s) into DIR")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    parser.add_argument(
        "--task", help="export task for a checkpoint without .onnx files (default: inferred from its config)"
    )
    parser.add_argument(
        "--export-dir",
        type=Path,
        metavar="DIR",
        help="keep the export of a checkpoint in DIR (default: discarded)",
    )
    parser.add_argument(
        "--explain",
        metavar="NODE",
        help="print the node's inputs, producers, readers and shapes after fixing the sizes, in each graph",
    )
    parser.add_argument(
        "--verify-padding",
        action="store_true",
        help="also run each graph on the host emulator padded and at exact sizes, compare the real outputs "
        "and print each dimension's padding verdict",
    )
    parser.add_argument(
        "--atol",
        type=float,
        default=DEFAULT_ATOL,
        help=f"tolerance of --verify-padding (default {DEFAULT_ATOL:g})",
    )
    parser.add_argument(
        "--repro",
        type=Path,
        metavar="DIR",
        help="write the graphs with random weights of the same shapes into DIR, to attach to an issue",
    )
