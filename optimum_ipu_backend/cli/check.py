"""`optimum-ipu check`: legalize every ONNX graph of a model as the runtime serves it and say whether
PopART can take it; ``--verify-padding`` also runs each graph padded and at exact sizes on the emulator.

The command-line parser is built for every ``optimum-ipu`` and ``optimum-cli`` call, so this module imports
the compiler, onnx and numpy inside the functions that run the command only. The sizes are the runtime's
(``runtime.default_sizes``), the graph is the runtime's (``compiler.served_graph``), and ``--explain`` and
``--repro`` are the compiler's (``compiler.diagnostics``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optimum_ipu_backend.config import parse_assignment
from optimum_ipu_backend.errors import ConfigurationError
from optimum_ipu_backend.runtime.ipu_config import PRECISIONS

if TYPE_CHECKING:
    import numpy as np
    import onnx

    from optimum_ipu_backend.compiler.errors import LegalizationError, UnsupportedNode
    from optimum_ipu_backend.compiler.memory import MemoryEstimate
    from optimum_ipu_backend.compiler.passes.base import PassReport
    from optimum_ipu_backend.compiler.passes.shard_over_ipus import Sharding
    from optimum_ipu_backend.compiler.served_graph import ServedGraph
    from optimum_ipu_backend.runtime.default_sizes import GraphSizes

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
what each needs of a call or costs, and a decoder's past and raw audio get the masks the runtime fills.

``--verify-padding`` also runs each graph on the host emulator, padded and at exact sizes, and compares
the real outputs; it prints each dimension's padding verdict (padded because the padding proof holds, or
compiled at exact sizes and the node that breaks the proof).

Exit status 0 means every graph is PopART-ready (and, with ``--verify-padding``, padding changed no real
output); 1 means at least one is not; 2 is a usage error.
"""

# Tolerance of --verify-padding: padded and exact-size runs of the same graph on the emulator.
DEFAULT_ATOL = 1e-4


def add_check_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``check`` on an ``optimum-ipu`` subcommand parser."""
    parser = subparsers.add_parser(
        "check",
        help="legalize a model's ONNX graphs for PopART and report what is left",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(func=run_check)
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
    return parser


class UsageError(Exception):
    """A bad command line: the message says what to write instead."""


@dataclass
class FileResult:
    """What `check` found for one ONNX file (or one binding of a merged decoder's branch input)."""

    path: Path
    label: str = ""
    #: The boolean inputs bound before legalizing (a merged decoder's ``use_cache_branch``), if any.
    bindings: dict[str, bool] = field(default_factory=dict)
    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    reports: list[PassReport] = field(default_factory=list)
    problems: list[UnsupportedNode] = field(default_factory=list)
    error: str | None = None
    failed_pass: str | None = None
    memory: MemoryEstimate | None = None
    #: The estimate for each IPU of a replica sharded with --ipus N (N > 1).
    memory_per_ipu: list[MemoryEstimate] = field(default_factory=list)
    saved_to: Path | None = None
    #: The legalization error, for --explain.
    legalization_error: LegalizationError | None = None
    #: What serving changes in the exported graph before legalizing (experts computed densely).
    notes: list[str] = field(default_factory=list)
    #: The graph legalized: the served graph with ``bindings`` bound (for --explain).
    model: onnx.ModelProto | None = field(default=None, repr=False)

    @property
    def ready(self) -> bool:
        return self.error is None and not self.problems

    @property
    def runtime_operators_lowered(self) -> dict[str, int]:
        """The operators of onnxruntime's own (an optimizer's fused Attention, SkipLayerNormalization, ...)
        the compiler lowered, by name and count."""
        import onnx

        lowered: dict[str, int] = {}
        for report in self.reports:
            for name, count in report.ops_removed.items():
                if "::" in name or not onnx.defs.has(name):
                    lowered[name] = lowered.get(name, 0) + count
        return dict(sorted(lowered.items()))

    def as_json(self) -> dict[str, Any]:
        return {
            "file": str(self.path),
            "label": self.label or self.path.name,
            "bindings": self.bindings,
            "ready": self.ready,
            "input_shapes": self.input_shapes,
            "passes": [{**asdict(r), "seconds": round(r.seconds, 4)} for r in self.reports],
            "failed_pass": self.failed_pass,
            "unsupported": [asdict(problem) for problem in self.problems],
            "runtime_operators_lowered": self.runtime_operators_lowered,
            "error": self.error,
            "graph_notes": self.notes,
            "memory": None if self.memory is None else asdict(self.memory),
            "memory_per_ipu": [asdict(estimate) for estimate in self.memory_per_ipu],
            "saved_to": str(self.saved_to) if self.saved_to else None,
        }


# ------------------------------------------------------------------------------------------------------
# The command line
# ------------------------------------------------------------------------------------------------------


def _assignment(text: str, what: str, example: str) -> tuple[str, str]:
    try:
        return parse_assignment(text, what, example)
    except ConfigurationError as error:
        raise UsageError(str(error)) from None


def parse_shape(text: str) -> tuple[str, list[int]]:
    """``input_ids=1,128`` (or ``1x128``) -> ("input_ids", [1, 128])."""
    name, dims = _assignment(text, "--shape", "input_ids=1,128")
    try:
        sizes = [int(d) for d in re.split(r"[,x]", dims) if d.strip() != ""]
    except ValueError:
        sizes = []
    if not sizes and dims not in ("", "scalar"):
        raise UsageError(f"--shape expects NAME=DIMS such as input_ids=1,128, not {text!r}")
    return name, sizes


def parse_dim(text: str) -> tuple[str, int]:
    """``sequence_length=128`` -> ("sequence_length", 128)."""
    name, size = _assignment(text, "--dim", "sequence_length=128")
    if not size.isdigit():
        raise UsageError(f"--dim expects DIM_NAME=SIZE such as sequence_length=128, not {text!r}")
    return name, int(size)


def load_config(path: Path) -> dict[str, Any]:
    """config.json next to the graph(s), or {} when there is none."""
    directory = path if path.is_dir() else path.parent
    config_file = directory / "config.json"
    if not config_file.is_file():
        return {}
    return json.loads(config_file.read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------------------------------
# Which graphs: ONNX files, or a checkpoint exported first
# ------------------------------------------------------------------------------------------------------


def find_onnx_files(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix != ".onnx":
            raise UsageError(f"{path} is not an .onnx file")
        return [path]
    if path.is_dir():
        files = sorted(path.glob("*.onnx"))
        if not files:
            raise UsageError(
                f"{path} holds no .onnx file and no transformers checkpoint (config.json) to export"
            )
        return files
    raise UsageError(f"{path} does not exist")


def is_checkpoint(path: Path) -> bool:
    """A directory with a transformers config and no ONNX graph: something to export first."""
    return path.is_dir() and (path / "config.json").is_file() and not any(path.glob("*.onnx"))


def export_checkpoint(checkpoint: Path, output: Path, task: str | None) -> Path:
    """Export a local checkpoint as ``optimum-cli export onnx --model CHECKPOINT [--task TASK] OUTPUT``."""
    from optimum_ipu_backend.cli.export import export_onnx

    task = task or "auto"
    try:
        export_onnx(str(checkpoint), output, task, local_files_only=True)
    except (ValueError, KeyError, OSError, RuntimeError) as error:
        raise UsageError(f"could not export {checkpoint} to ONNX for task {task!r}: {error}") from error
    return output


# ------------------------------------------------------------------------------------------------------
# Checking one graph
# ------------------------------------------------------------------------------------------------------


def check_file(
    path: Path,
    served: ServedGraph,
    sizes: GraphSizes,
    shapes: Mapping[str, Sequence[int]],
    precision: str = "fp32",
    save_dir: Path | None = None,
    progress: bool = False,
    bindings: Mapping[str, bool] | None = None,
    sharding: Sharding | None = None,
) -> FileResult:
    """Legalize one served graph (``compiler.served_graph``) and collect what each pass did, what is
    left, and the memory estimate.

    ``bindings`` fixes boolean inputs (a merged decoder's ``use_cache_branch``) of the served graph, as the
    runtime compiles each choice; ``sharding`` over several IPUs places every node and estimates each
    IPU's memory.
    """
    from optimum_ipu_backend.compiler.errors import LegalizationError
    from optimum_ipu_backend.compiler.memory import estimate_memory_per_ipu
    from optimum_ipu_backend.compiler.pipeline import legalize
    from optimum_ipu_backend.compiler.served_graph import bind_branches
    from optimum_ipu_backend.runtime.default_sizes import resolve_input_shapes

    model = bind_branches(served.model, bindings or {})
    label = path.name
    if bindings:
        label += " [" + ", ".join(f"{name}={value}" for name, value in bindings.items()) + "]"
    input_shapes = resolve_input_shapes(model, sizes.dims, shapes)
    result = FileResult(
        path, label, dict(bindings or {}), input_shapes, notes=list(served.notes), model=model
    )
    if sizes.over_limit:
        result.error = "sizes over the model's limit: " + "; ".join(sizes.over_limit)
        return result
    if served.unsupported:  # a data-dependent selection no rewrite could make static
        result.error = served.unsupported[0][3]
        return result

    def show(pass_name: str) -> None:
        print(f"[{label}] {pass_name} ...", file=sys.stderr, flush=True)

    try:
        legalized = legalize(
            model,
            input_shapes,
            precision=precision,
            progress=show if progress else None,
            source=str(path),
            weights_dir=path.parent,
            sharding=sharding,
        )
    except LegalizationError as error:
        result.reports = list(error.reports)
        result.problems = list(error.nodes)
        result.failed_pass = error.failed_pass
        result.error = error.summary
        result.legalization_error = error
        if error.model is not None and error.failed_pass not in (None, "fix_shapes"):
            result.memory = _estimate_or_none(error.model)
        return result
    result.reports = legalized.reports
    result.memory = _estimate_or_none(legalized.model)
    if sharding is not None and sharding.ipus > 1:
        try:
            result.memory_per_ipu = estimate_memory_per_ipu(legalized.model)
        except Exception:  # a courtesy, like the whole-graph estimate
            result.memory_per_ipu = []
    if save_dir is not None:
        from optimum_ipu_backend.compiler.external_data import save_graph

        suffix = "".join(f".{name}_{str(value).lower()}" for name, value in (bindings or {}).items())
        result.saved_to = save_dir / f"{path.stem}{suffix}{path.suffix}"
        result.saved_to.parent.mkdir(parents=True, exist_ok=True)
        save_graph(legalized.model, result.saved_to, legalized.weights_dir, legalized.weight_names)
    return result


def branch_bindings(model: onnx.ModelProto) -> list[dict[str, bool] | None]:
    """Both values of each boolean input that picks a top-level If branch; [None] when there is none."""
    from optimum_ipu_backend.compiler.op_table import branch_inputs

    names = branch_inputs(model)
    if not names:
        return [None]
    combos: list[dict[str, bool] | None] = [{}]
    for name in names:
        combos = [{**(combo or {}), name: value} for combo in combos for value in (False, True)]
    return combos


def _estimate_or_none(model: onnx.ModelProto) -> MemoryEstimate | None:
    from optimum_ipu_backend.compiler.memory import estimate_memory

    try:
        return estimate_memory(model)
    except Exception:  # an estimate is a courtesy; a graph broken enough to fail it is reported anyway
        return None


def _megabytes(size: int) -> str:
    return f"{size / 1e6:,.1f} MB"


def _memory_sum(memory: MemoryEstimate) -> str:
    return (
        f"weights {_megabytes(memory.weights_bytes)} + peak activations "
        f"{_megabytes(memory.peak_activation_bytes)} = {_megabytes(memory.total_bytes)} "
        f"of {_megabytes(memory.ipu_memory_bytes)}"
    )


def format_result(result: FileResult) -> str:
    shapes = ", ".join(f"{k}={'x'.join(map(str, v)) or 'scalar'}" for k, v in result.input_shapes.items())
    lines = [f"== {result.label or result.path.name}  ({shapes})"]
    for report in result.reports:
        lines.append(
            f"  {report.name:<26} {report.nodes_before:>6} -> {report.nodes_after:<6} "
            f"{report.seconds:7.2f}s  {report.summary}"
        )
    if result.failed_pass is not None:
        lines.append(f"  {result.failed_pass:<26} FAILED: {result.error}")
    elif result.error is not None:
        lines.append(f"  not checked: {result.error}")
    lines.extend(f"  note: {note}" for note in result.notes)
    if result.runtime_operators_lowered:
        lowered = ", ".join(f"{count} {name}" for name, count in result.runtime_operators_lowered.items())
        lines.append(f"  onnxruntime's own operators lowered: {lowered}")
    if result.problems:
        lines.append(f"  unsupported ({len(result.problems)}):")
        lines.extend(f"    - {line}" for line in _grouped(result.problems))
    if result.memory is not None:
        memory = result.memory
        lines.append(
            f"  memory: {_memory_sum(memory)} per IPU ({memory.tiles_per_ipu} tiles) "
            f"-> {memory.ipus_needed} IPU(s)"
        )
    lines.extend(_per_ipu_lines(result.memory_per_ipu))
    lines.append(f"  PopART-ready: {'yes' if result.ready else 'no'}")
    if result.saved_to is not None:
        lines.append(f"  saved: {result.saved_to}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------
# The subcommand
# ------------------------------------------------------------------------------------------------------


def _grouped(problems: Sequence[UnsupportedNode]) -> list[str]:
    """One line per reason: a quantized model refuses dozens of nodes for the same one."""
    groups: dict[tuple[str, str, str], list[UnsupportedNode]] = {}
    for problem in problems:
        groups.setdefault((problem.op_type, problem.reason, problem.pattern), []).append(problem)
    lines = []
    for (op_type, reason, pattern), members in groups.items():
        if len(members) == 1:
            lines.append(members[0].describe())
            continue
        names = ", ".join(member.name or "<unnamed>" for member in members[:2])
        lines.append(f"{len(members)} {op_type} nodes ({names}, ...): {reason} [pattern: {pattern}]")
    return lines


def _per_ipu_lines(estimates: Sequence[MemoryEstimate]) -> list[str]:
    """One line per IPU of a sharded replica, and for each IPU over its memory, what to change."""
    lines = []
    for ipu, memory in enumerate(estimates):
        verdict = "fits" if memory.ipus_needed == 1 else "OVERFLOWS"
        lines.append(f"  IPU {ipu}: {_memory_sum(memory)}: {verdict}")
    over = [ipu for ipu, memory in enumerate(estimates) if memory.ipus_needed > 1]
    if over:
        lines.append(
            f"  IPU(s) {', '.join(map(str, over))} overflow: move layers off them with layers_per_ipu, "
            f"shard over more IPUs (--ipus {2 * len(estimates)}, ipus_per_replica), or use "
            "--precision fp16 or smaller sizes"
        )
    return lines


def _graphs_to_check(args: argparse.Namespace, scratch: Path) -> tuple[list[Path], Path]:
    """The ONNX files and the directory their config.json is in, exporting a checkpoint first."""
    path = args.path
    if is_checkpoint(path):
        output = args.export_dir or scratch / "export"
        print(f"exporting {path} to ONNX in {output} (as optimum-cli export onnx) ...", file=sys.stderr)
        export_checkpoint(path, output, args.task)
        return find_onnx_files(output), output
    if args.task or args.export_dir:
        raise UsageError("--task and --export-dir apply to a checkpoint without .onnx files")
    files = find_onnx_files(path)
    return files, path if path.is_dir() else path.parent


def run_check(args: argparse.Namespace) -> int:
    """Run `check` for parsed arguments; return the exit status."""
    with tempfile.TemporaryDirectory(prefix="optimum-ipu-check-") as scratch:
        try:
            shapes = dict(parse_shape(text) for text in args.shape)
            explicit_dims = dict(parse_dim(text) for text in args.dim)
            files, model_dir = _graphs_to_check(args, Path(scratch))
            sharding = _sharding(args)
        except UsageError as error:
            print(f"optimum-ipu check: {error}", file=sys.stderr)
            return 2
        return _check_all(args, files, model_dir, shapes, explicit_dims, sharding)


def _sharding(args: argparse.Namespace) -> Sharding | None:
    from optimum_ipu_backend.compiler.passes.shard_over_ipus import Sharding
    from optimum_ipu_backend.runtime.ipu_config import IPUConfigError, check_ipu_count

    if args.ipus < 1:
        raise UsageError(f"--ipus expects a positive number of IPUs, not {args.ipus}")
    try:
        check_ipu_count("--ipus", args.ipus)
    except IPUConfigError as exc:
        raise UsageError(str(exc)) from None
    layers = None
    if args.layers_per_ipu is not None:
        try:
            layers = tuple(int(count) for count in args.layers_per_ipu.split(","))
        except ValueError:
            layers = ()
        if not layers or any(count < -1 for count in layers):
            raise UsageError(f"--layers-per-ipu expects counts such as 2,-1, not {args.layers_per_ipu!r}")
    if args.ipus == 1:
        if layers is not None:
            raise UsageError("--layers-per-ipu needs --ipus N with N > 1")
        return None
    return Sharding(args.ipus, layers)


def _check_all(
    args: argparse.Namespace,
    files: list[Path],
    model_dir: Path,
    shapes: dict[str, list[int]],
    explicit_dims: dict[str, int],
    sharding: Sharding | None = None,
) -> int:
    from optimum_ipu_backend.compiler.diagnostics import explain, write_repro
    from optimum_ipu_backend.compiler.external_data import load_graph
    from optimum_ipu_backend.compiler.served_graph import served_graph
    from optimum_ipu_backend.runtime.default_sizes import graph_sizes

    config = load_config(model_dir)
    progress = sys.stderr.isatty() and not args.json
    if args.repro is not None:
        written = write_repro(files, model_dir, args.repro)
        print(
            f"wrote {len(written)} file(s) with random weights to {args.repro}: attach them to an issue",
            file=sys.stderr,
        )
    results = []
    explanations = []
    padding_checks: list[PaddingCheck] = []
    for path in files:
        # external weights stay in their files: legalization streams them
        served = served_graph(load_graph(path))
        file_inputs = {i.name for i in served.model.graph.input}
        file_shapes = {name: dims_ for name, dims_ in shapes.items() if name in file_inputs}
        # A merged decoder is static only once its branch is chosen: check each choice.
        for bindings in branch_bindings(served.model):
            sizes = graph_sizes(served.model, config, explicit_dims, bindings, model_dir)
            result = check_file(
                path, served, sizes, file_shapes, args.precision, args.save, progress, bindings, sharding
            )
            results.append(result)
            if not args.json:
                print(format_result(result), flush=True)
            if args.explain:
                error = result.legalization_error
                explanations.append(
                    explain(result.model, result.label, result.input_shapes, args.explain, error)
                )
        if args.verify_padding:
            # the session serves every branch of a merged decoder itself: one check per file
            check = verify_padding(path, config, path.name, atol=args.atol)
            check.packing = packing_verdict(served.model, path.parent)
            padding_checks.append(check)
            if not args.json:
                print(check.format(), flush=True)
    unused = set(shapes) - {name for r in results for name in r.input_shapes}
    ready = all(result.ready for result in results) and all(check.ok for check in padding_checks)
    if args.json:
        document = {
            "path": str(args.path),
            "precision": args.precision,
            "ready": ready,
            "unused_shapes": sorted(unused),
            "files": [result.as_json() for result in results],
        }
        if args.explain:
            document["explain"] = explanations
        if args.verify_padding:
            document["padding_checks"] = [check.as_json() for check in padding_checks]
        print(json.dumps(document, indent=2))
    else:
        if unused:
            print(f"note: --shape for {sorted(unused)} matched no graph input", file=sys.stderr)
        for text in explanations:
            print(text)
        verdict = "every graph is PopART-ready" if ready else "some graphs are not PopART-ready"
        if padding_checks:
            failed = sum(not check.ok for check in padding_checks)
            verdict += f"; padding verified on {len(padding_checks) - failed} of {len(padding_checks)}"
        print(f"{len(results)} graph(s) checked: {verdict}")
    return 0 if ready else 1


# ------------------------------------------------------------------------------------------------------
# --verify-padding: one call padded and the same call at exact sizes, on the emulator
# ------------------------------------------------------------------------------------------------------
# The runtime pads a dimension only where the padding proof shows no real output can see padded positions.
# This lets a user test that on their own graph, as the suite tests the model matrix: one call at sizes
# between compiled sizes (padded wherever the proof allows) and the same call through a session compiled
# at exactly those sizes. Inputs are made up from their roles (``runtime.roles``).

#: Samples in the checked call: not a compiled batch size, so the batch is padded where it may be.
CALL_BATCH = 3
#: Length of the cache in a call of a decoder with past: padded to the next compiled past length.
CALL_PAST = 5


@dataclass
class PaddingCheck:
    """The result for one graph: whether padded and unpadded real outputs agree, and why padding was or
    was not used per dimension."""

    label: str
    call_dims: dict[str, int] = field(default_factory=dict)
    max_abs_diff: float | None = None
    atol: float = DEFAULT_ATOL
    verdicts: dict[str, str] = field(default_factory=dict)
    compiled_shapes: list[dict[str, list[int]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Whether the sequences of several calls can share rows (``dynamic_batching``), or the node that
    #: stops the packing proof.
    packing: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.max_abs_diff is not None and self.max_abs_diff <= self.atol

    def as_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "ok": self.ok,
            "call_dims": self.call_dims,
            "max_abs_diff": self.max_abs_diff,
            "atol": self.atol,
            "padding": self.verdicts,
            "compiled_shapes": self.compiled_shapes,
            "graph_notes": self.notes,
            "packing": self.packing,
            "error": self.error,
        }

    def format(self) -> str:
        dims = ", ".join(f"{name}={size}" for name, size in self.call_dims.items())
        lines = [f"  padding check at {dims}:"]
        for dim, verdict in self.verdicts.items():
            lines.append(f"    {dim}: {verdict}")
        for shapes in self.compiled_shapes:
            lines.append(
                "    compiled: " + ", ".join(f"{k}={'x'.join(map(str, v))}" for k, v in shapes.items())
            )
        lines.extend(f"    note: {note}" for note in self.notes)
        if self.packing is not None:
            lines.append(f"    packing: {self.packing}")
        if self.error is not None:
            lines.append(f"    FAILED: {self.error}")
        else:
            verdict = "equal" if self.ok else "DIFFERENT"
            lines.append(
                f"    padded vs unpadded real outputs: {verdict} (max abs diff {self.max_abs_diff:.3g}, "
                f"atol {self.atol:g})"
            )
        return "\n".join(lines)


def call_dims(
    inputs: Mapping[str, tuple[list[int | str], int]],
    plan_sizes: Mapping[str, list[int]],
    config: Mapping[str, Any],
) -> dict[str, int]:
    """A size per dimension between compiled sizes, so that the runtime pads it where the proof allows."""
    from optimum_ipu_backend.runtime.default_sizes import config_dims
    from optimum_ipu_backend.runtime.dim_expressions import parse_dim as parse_dim_expression
    from optimum_ipu_backend.runtime.roles import DimRole, dim_role

    fixed = config_dims(config)
    dims: dict[str, int] = {}
    for shape, _ in inputs.values():
        for dim in shape:
            parsed = parse_dim_expression(dim) if isinstance(dim, str) else None
            for name in sorted(parsed.symbols) if parsed is not None else []:
                if name in dims:
                    continue
                role = dim_role(name)
                sizes = plan_sizes.get(name)
                if role is DimRole.BATCH:
                    dims[name] = CALL_BATCH
                elif role is DimRole.PAST:
                    dims[name] = CALL_PAST
                elif name in fixed:
                    dims[name] = fixed[name]
                elif sizes and len(sizes) > 1:
                    # one past the second smallest compiled size: padded up to the next one
                    dims[name] = sizes[1] + 1 if len(sizes) > 2 else sizes[0] + 1
                elif sizes:
                    dims[name] = max(1, sizes[0] - 1)
                else:
                    dims[name] = 1 if name == "1" else 4
    # a one-token step beside a past, as generation runs it
    if any(dim_role(name) is DimRole.PAST for name in dims):
        for name in dims:
            if dim_role(name) is DimRole.SEQUENCE and f"past_{name}" in dims:
                dims[name] = 1
    return dims


def make_feed(
    inputs: Mapping[str, tuple[list[int | str], int]],
    dims: Mapping[str, int],
    config: Mapping[str, Any],
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Inputs for one call at ``dims``, each made up from its role."""
    import numpy as np
    import onnx

    from optimum_ipu_backend.runtime.padding import evaluate_shape
    from optimum_ipu_backend.runtime.roles import DimRole, InputRole, dim_role, input_role

    rng = np.random.default_rng(seed)
    vocab = int(config.get("vocab_size") or 100)
    past = next((size for name, size in dims.items() if dim_role(name) is DimRole.PAST), 0)
    feed = {}
    for name, (shape, elem_type) in inputs.items():
        concrete = evaluate_shape(tuple(shape), dims)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
        role = input_role(name)
        if role is InputRole.TOKEN_IDS:
            value = rng.integers(1, max(2, vocab), concrete)
        elif role is InputRole.ATTENTION_MASK:
            value = np.ones(concrete)
        elif role is InputRole.TOKEN_TYPES:
            value = np.zeros(concrete)
        elif role is InputRole.POSITIONS:
            value = np.broadcast_to(past + np.arange(concrete[-1]), concrete) if concrete else np.array(past)
        elif role is InputRole.CACHE_BRANCH:
            value = np.array(past > 0)
        elif np.issubdtype(dtype, np.floating):
            value = rng.standard_normal(concrete)
        else:
            value = np.zeros(concrete)
        feed[name] = np.ascontiguousarray(value, dtype=dtype)
    return feed


def verify_padding(
    path: Path, config: Mapping[str, Any], label: str, atol: float = DEFAULT_ATOL, seed: int = 0
) -> PaddingCheck:
    """Run ``path`` once padded and once at exact sizes on the emulator, and compare real outputs."""
    import onnx

    from optimum_ipu_backend.runtime.buckets import option_name
    from optimum_ipu_backend.runtime.default_sizes import graph_inputs
    from optimum_ipu_backend.session import IPUInferenceSession, IPUProviderOptions

    def session(options: dict[str, Any]) -> IPUInferenceSession:
        return IPUInferenceSession(str(path), options=IPUProviderOptions.parse(options, path.parent))

    result = PaddingCheck(label, atol=atol)
    inputs = graph_inputs(onnx.load(path, load_external_data=False))
    with tempfile.TemporaryDirectory(prefix="optimum-ipu-verify-padding-") as scratch:
        options = {"device": "emulator", "executable_cache_dir": scratch}
        try:
            padded_session = session(options)
            dims = call_dims(inputs, padded_session.bucket_sizes(), config)
            result.call_dims = dims
            feed = make_feed(inputs, dims, config, seed)
            padded = padded_session.run(None, feed)
            result.verdicts = padded_session.padding_verdicts()
            result.compiled_shapes = [entry["shapes"] for entry in padded_session.compiled_executables()]
            result.notes = padded_session.graph_notes()
            padded_session.close()
            exact_sizes = {
                option_name(name): [size]
                for name, size in dims.items()
                if name in padded_session.bucket_sizes()
            }
            exact_session = session({**options, **exact_sizes})
            exact = exact_session.run(None, feed)
            exact_session.close()
        except Exception as error:  # reported per graph; the command's status says it failed
            result.error = f"{type(error).__name__}: {error}"
            return result
    shapes = [(a.shape, b.shape) for a, b in zip(padded, exact, strict=True)]
    if any(a != b for a, b in shapes):
        result.error = f"padded and unpadded outputs differ in shape: {shapes}"
        return result
    result.max_abs_diff = max(
        (_max_abs_diff(a, b) for a, b in zip(padded, exact, strict=True)),
        default=0.0,
    )
    return result


def packing_verdict(model: onnx.ModelProto, weights_dir: Path | None = None) -> str:
    """What ``dynamic_batching`` does with ``model``: packed rows where the packing proof holds, else the
    node that stops it (``compiler.graph_rewrites.packing``)."""
    from optimum_ipu_backend.compiler.graph_rewrites.packing import describe, pack_encoder

    return describe(pack_encoder(model, weights_dir))


def _max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    import numpy as np

    if a.dtype == np.bool_ or np.issubdtype(a.dtype, np.integer):
        return float(np.count_nonzero(a != b))  # any differing integer or boolean is a failure
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m optimum_ipu_backend.cli.check ARGS`: the same as `optimum-ipu check ARGS`."""
    parser = argparse.ArgumentParser(prog="optimum-ipu")
    add_check_parser(parser.add_subparsers())
    return run_check(parser.parse_args(["check", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
