"""The work of `optimum-ipu check`: legalize every ONNX graph of a model and say whether PopART can take
it. Its arguments, help and exit statuses are in ``cli/check_parser.py``, which the command-line parser
imports without this module's heavy dependencies."""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from optimum_ipu_backend.cli.check_diagnostics import explain, write_repro
from optimum_ipu_backend.cli.check_padding import PaddingCheck, verify_padding
from optimum_ipu_backend.cli.check_parser import DESCRIPTION, add_arguments
from optimum_ipu_backend.cli.check_sizes import GraphSizes, graph_sizes, resolve_input_shapes
from optimum_ipu_backend.compiler.errors import LegalizationError, UnsupportedNode
from optimum_ipu_backend.compiler.graph_rewrites.dense_experts import densify_experts
from optimum_ipu_backend.compiler.graph_rewrites.eos_selection import select_last_eos
from optimum_ipu_backend.compiler.memory import MemoryEstimate, estimate_memory, estimate_memory_per_ipu
from optimum_ipu_backend.compiler.op_table import branch_inputs
from optimum_ipu_backend.compiler.passes.base import PassReport
from optimum_ipu_backend.compiler.passes.fold_constants import bind_constant_inputs
from optimum_ipu_backend.compiler.passes.shard_over_ipus import Sharding
from optimum_ipu_backend.compiler.pipeline import legalize
from optimum_ipu_backend.runtime.ipu_config import IPUConfigError, check_ipu_count


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

    @property
    def ready(self) -> bool:
        return self.error is None and not self.problems

    def as_json(self) -> dict[str, Any]:
        memory = None if self.memory is None else _memory_json(self.memory)
        return {
            "file": str(self.path),
            "label": self.label or self.path.name,
            "bindings": self.bindings,
            "ready": self.ready,
            "input_shapes": self.input_shapes,
            "passes": [
                {
                    "name": r.name,
                    "changed": r.changed,
                    "summary": r.summary,
                    "nodes_before": r.nodes_before,
                    "nodes_after": r.nodes_after,
                    "ops_removed": r.ops_removed,
                    "ops_added": r.ops_added,
                    "seconds": round(r.seconds, 4),
                }
                for r in self.reports
            ],
            "failed_pass": self.failed_pass,
            "unsupported": [
                {
                    "name": p.name,
                    "op_type": p.op_type,
                    "domain": p.domain,
                    "reason": p.reason,
                    "pattern": p.pattern,
                    "origin": p.origin,
                }
                for p in self.problems
            ],
            "error": self.error,
            "graph_notes": self.notes,
            "memory": memory,
            "memory_per_ipu": [_memory_json(estimate) for estimate in self.memory_per_ipu],
            "saved_to": str(self.saved_to) if self.saved_to else None,
        }


def _memory_json(memory: MemoryEstimate) -> dict[str, int]:
    return {
        "weights_bytes": memory.weights_bytes,
        "peak_activation_bytes": memory.peak_activation_bytes,
        "total_bytes": memory.total_bytes,
        "ipu_memory_bytes": memory.ipu_memory_bytes,
        "tiles_per_ipu": memory.tiles_per_ipu,
        "ipus_needed": memory.ipus_needed,
    }


# ------------------------------------------------------------------------------------------------------
# The command line
# ------------------------------------------------------------------------------------------------------


def parse_shape(text: str) -> tuple[str, list[int]]:
    """``input_ids=1,128`` (or ``1x128``) -> ("input_ids", [1, 128])."""
    name, sep, dims = text.partition("=")
    try:
        sizes = [int(d) for d in re.split(r"[,x]", dims.strip()) if d.strip() != ""]
    except ValueError:
        sizes = []
    if not sep or not name.strip() or (not sizes and dims.strip() not in ("", "scalar")):
        raise UsageError(f"--shape expects NAME=DIMS such as input_ids=1,128, not {text!r}")
    return name.strip(), sizes


def parse_dim(text: str) -> tuple[str, int]:
    """``sequence_length=128`` -> ("sequence_length", 128)."""
    name, sep, size = text.partition("=")
    if not sep or not name.strip() or not size.strip().isdigit():
        raise UsageError(f"--dim expects DIM_NAME=SIZE such as sequence_length=128, not {text!r}")
    return name.strip(), int(size)


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


def infer_export_task(config: Mapping[str, Any]) -> str:
    """The task ``optimum-cli export onnx`` picks for a model of this config: the one of its architecture
    class, with past key/values when the exporter supports them for the model type (its default)."""
    import transformers
    from optimum.exporters.tasks import TasksManager

    model_type = str(config.get("model_type", "")).replace("_", "-")
    for architecture in config.get("architectures") or ():
        model_class = getattr(transformers, architecture, None)
        if model_class is None:
            continue
        try:
            task = TasksManager.infer_task_from_model(model_class)
            supported = TasksManager.get_supported_tasks_for_model_type(
                model_type, "onnx", library_name="transformers"
            )
        except (ValueError, KeyError):
            continue
        return f"{task}-with-past" if f"{task}-with-past" in supported else task
    raise UsageError(
        f"cannot infer the export task from config.json (architectures {config.get('architectures')}, "
        f"model_type {model_type!r}); pass --task, e.g. --task text-classification"
    )


def export_checkpoint(checkpoint: Path, output: Path, task: str | None) -> Path:
    """Export a local checkpoint as ``optimum-cli export onnx --model CHECKPOINT [--task TASK] OUTPUT``."""
    from optimum.exporters.onnx import main_export  # heavy (torch, transformers): only when exporting

    task = task or infer_export_task(load_config(checkpoint))
    try:
        main_export(model_name_or_path=str(checkpoint), output=output, task=task, local_files_only=True)
    except (ValueError, KeyError, OSError, RuntimeError) as error:
        raise UsageError(f"could not export {checkpoint} to ONNX for task {task!r}: {error}") from error
    return output


# ------------------------------------------------------------------------------------------------------
# Checking one graph
# ------------------------------------------------------------------------------------------------------


def _bound(path: Path, bindings: Mapping[str, bool] | None) -> tuple[onnx.ModelProto, str]:
    from optimum_ipu_backend.compiler.external_data import load_graph

    model = load_graph(path)  # external weights stay in their files: legalization streams them
    label = path.name
    if bindings:
        model = bind_constant_inputs(model, {name: [value] for name, value in bindings.items()})
        label += " [" + ", ".join(f"{name}={value}" for name, value in bindings.items()) + "]"
    return model, label


def check_file(
    path: Path,
    sizes: GraphSizes,
    shapes: Mapping[str, Sequence[int]],
    precision: str = "fp32",
    save_dir: Path | None = None,
    progress: bool = False,
    bindings: Mapping[str, bool] | None = None,
    sharding: Sharding | None = None,
) -> FileResult:
    """Legalize one graph and collect what each pass did, what is left, and the memory estimate.

    ``bindings`` fixes boolean inputs (a merged decoder's ``use_cache_branch``) before legalizing;
    ``sharding`` over several IPUs places every node and estimates each IPU's memory.
    """
    model, label = _bound(path, bindings)
    input_shapes = resolve_input_shapes(model, sizes.dims, shapes)
    result = FileResult(path=path, label=label, bindings=dict(bindings or {}), input_shapes=input_shapes)
    if sizes.over_limit:
        result.error = "sizes over the model's limit: " + "; ".join(sizes.over_limit)
        return result
    try:  # as the runtime serves it (runtime.graph_source): selections computed densely
        eos = select_last_eos(model)
        if eos is not None:
            model = eos.model
            result.notes.append(eos.note)
        dense = densify_experts(model)
    except ValueError as error:
        result.error = str(error)
        return result
    if dense is not None:
        model = dense.model
        result.notes.append(dense.cost)

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
        suffix = "".join(f".{name}_{str(value).lower()}" for name, value in (bindings or {}).items())
        result.saved_to = save_dir / f"{path.stem}{suffix}{path.suffix}"
        from optimum_ipu_backend.compiler.external_data import save_graph

        result.saved_to.parent.mkdir(parents=True, exist_ok=True)
        save_graph(legalized.model, result.saved_to, legalized.weights_dir, legalized.weight_names)
    return result


def branch_bindings(model: onnx.ModelProto) -> list[dict[str, bool] | None]:
    """Both values of each boolean input that picks a top-level If branch; [None] when there is none."""
    names = branch_inputs(model)
    if not names:
        return [None]
    combos: list[dict[str, bool] | None] = [{}]
    for name in names:
        combos = [{**(combo or {}), name: value} for combo in combos for value in (False, True)]
    return combos


def _estimate_or_none(model: onnx.ModelProto) -> MemoryEstimate | None:
    try:
        return estimate_memory(model)
    except Exception:  # an estimate is a courtesy; a graph broken enough to fail it is reported anyway
        return None


def _megabytes(size: int) -> str:
    return f"{size / 1e6:,.1f} MB"


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
    if result.problems:
        lines.append(f"  unsupported ({len(result.problems)}):")
        lines.extend(f"    - {problem.describe()}" for problem in result.problems)
    if result.memory is not None:
        memory = result.memory
        lines.append(
            f"  memory: weights {_megabytes(memory.weights_bytes)} + peak activations "
            f"{_megabytes(memory.peak_activation_bytes)} = {_megabytes(memory.total_bytes)} "
            f"of {_megabytes(memory.ipu_memory_bytes)} per IPU ({memory.tiles_per_ipu} tiles) "
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


def _per_ipu_lines(estimates: Sequence[MemoryEstimate]) -> list[str]:
    """One line per IPU of a sharded replica, and for each IPU over its memory, what to change."""
    lines = []
    for ipu, memory in enumerate(estimates):
        verdict = "fits" if memory.ipus_needed == 1 else "OVERFLOWS"
        lines.append(
            f"  IPU {ipu}: weights {_megabytes(memory.weights_bytes)} + peak activations "
            f"{_megabytes(memory.peak_activation_bytes)} = {_megabytes(memory.total_bytes)} "
            f"of {_megabytes(memory.ipu_memory_bytes)}: {verdict}"
        )
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
        skeleton = onnx.load(path, load_external_data=False)
        file_inputs = {i.name for i in skeleton.graph.input}
        file_shapes = {name: dims_ for name, dims_ in shapes.items() if name in file_inputs}
        # A merged decoder is static only once its branch is chosen: check each choice.
        for bindings in branch_bindings(skeleton):
            sizes = graph_sizes(skeleton, config, explicit_dims, bindings)
            result = check_file(
                path, sizes, file_shapes, args.precision, args.save, progress, bindings, sharding
            )
            results.append(result)
            if not args.json:
                print(format_result(result), flush=True)
            if args.explain:
                model, label = _bound(path, bindings)
                error = result.legalization_error
                explanations.append(explain(model, label, result.input_shapes, args.explain, error))
        if args.verify_padding:
            # the session serves every branch of a merged decoder itself: one check per file
            check = verify_padding(path, config, path.name, atol=args.atol)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="optimum-ipu check",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run_check(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
