"""`optimum-ipu check PATH`: legalize every ONNX graph of a model and say whether PopART can take it.

PATH is a model directory (its ``*.onnx`` files, sizes from its ``config.json``) or one ``.onnx`` file.
Exit status 0 means every graph is PopART-ready; 1 means at least one is not; 2 is a usage error.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from optimum_ipu_backend.compiler.errors import LegalizationError, UnsupportedNode
from optimum_ipu_backend.compiler.memory import MemoryEstimate, estimate_memory
from optimum_ipu_backend.compiler.op_table import branch_inputs
from optimum_ipu_backend.compiler.passes.base import PassReport
from optimum_ipu_backend.compiler.passes.fold_constants import bind_constant_inputs
from optimum_ipu_backend.compiler.pipeline import PRECISIONS, legalize

DEFAULT_BATCH = 1
DEFAULT_SEQUENCE = 128
_MAX_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_target_positions", "n_ctx")
_TWO_GIB = 2**31 - 1


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
    saved_to: Path | None = None

    @property
    def ready(self) -> bool:
        return self.error is None and not self.problems

    def as_json(self) -> dict[str, Any]:
        memory = None
        if self.memory is not None:
            memory = {
                "weights_bytes": self.memory.weights_bytes,
                "peak_activation_bytes": self.memory.peak_activation_bytes,
                "total_bytes": self.memory.total_bytes,
                "ipu_memory_bytes": self.memory.ipu_memory_bytes,
                "tiles_per_ipu": self.memory.tiles_per_ipu,
                "ipus_needed": self.memory.ipus_needed,
            }
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
                {"name": p.name, "op_type": p.op_type, "domain": p.domain, "reason": p.reason}
                for p in self.problems
            ],
            "error": self.error,
            "memory": memory,
            "saved_to": str(self.saved_to) if self.saved_to else None,
        }


# ------------------------------------------------------------------------------------------------------
# Shapes: the command line, then defaults from config.json
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


def default_dims(
    config: Mapping[str, Any], sequence: int | None = None, batch: int | None = None
) -> dict[str, int]:
    """Sizes for optimum's symbolic dim names, from the model config."""
    max_positions = next((int(config[k]) for k in _MAX_POSITION_KEYS if isinstance(config.get(k), int)), None)
    seq = sequence if sequence is not None else DEFAULT_SEQUENCE
    if max_positions is not None and sequence is None:
        seq = min(seq, max_positions)
    dims = {
        "batch_size": batch if batch is not None else DEFAULT_BATCH,
        "sequence_length": seq,
        "decoder_sequence_length": seq,
        "encoder_sequence_length": seq,
        "past_sequence_length": seq,
        "past_decoder_sequence_length": seq,
        "past_encoder_sequence_length": seq,
        "num_choices": 2,
    }
    image_size = config.get("image_size")
    if isinstance(image_size, int):
        dims["height"] = dims["width"] = image_size
    elif isinstance(image_size, (list, tuple)) and len(image_size) == 2:
        dims["height"], dims["width"] = int(image_size[0]), int(image_size[1])
    if isinstance(config.get("num_channels"), int):
        dims["num_channels"] = config["num_channels"]
    if config.get("model_type") == "whisper":
        # The encoder reads exactly 2 * max_source_positions mel frames (a static input in the export);
        # optimum's "encoder_sequence_length" on the decoder side is the encoder's output length.
        frames = int(config.get("max_source_positions", 1500))
        dims["feature_size"] = int(config.get("num_mel_bins", 80))
        dims["encoder_sequence_length"] = frames
        dims["past_encoder_sequence_length"] = frames
    return dims


def _evaluate_dim(label: str, dims: Mapping[str, int]) -> int | None:
    """A symbolic dim such as ``past_sequence_length + sequence_length`` from known sizes."""
    if label in dims:
        return dims[label]
    expression = label
    for name in sorted(dims, key=len, reverse=True):
        expression = re.sub(rf"\b{re.escape(name)}\b", str(dims[name]), expression)
    if not re.fullmatch(r"[\d\s+\-*/()]+", expression):
        return None
    try:
        value = eval(expression, {"__builtins__": {}}, {})  # digits and arithmetic only, checked above
    except (SyntaxError, ZeroDivisionError):
        return None
    return int(value)


def resolve_input_shapes(
    model: onnx.ModelProto, dims: Mapping[str, int], shapes: Mapping[str, Sequence[int]]
) -> dict[str, list[int]]:
    """Static shapes for the graph inputs; a dim nothing sizes is left out for legalize() to report."""
    initializers = {init.name for init in model.graph.initializer}
    resolved: dict[str, list[int]] = {}
    for graph_input in model.graph.input:
        if graph_input.name in initializers:
            continue
        if graph_input.name in shapes:
            resolved[graph_input.name] = list(shapes[graph_input.name])
            continue
        sizes: list[int] = []
        for dim in graph_input.type.tensor_type.shape.dim:
            if dim.HasField("dim_value"):
                sizes.append(dim.dim_value)
                continue
            value = _evaluate_dim(dim.dim_param, dims) if dim.dim_param else None
            if value is None:
                break
            sizes.append(value)
        else:
            resolved[graph_input.name] = sizes
    return resolved


def find_onnx_files(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix != ".onnx":
            raise UsageError(f"{path} is not an .onnx file")
        return [path]
    if path.is_dir():
        files = sorted(path.glob("*.onnx"))
        if not files:
            raise UsageError(f"{path} holds no .onnx file")
        return files
    raise UsageError(f"{path} does not exist")


# ------------------------------------------------------------------------------------------------------
# Checking
# ------------------------------------------------------------------------------------------------------


def _save(model: onnx.ModelProto, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if model.ByteSize() > _TWO_GIB:
        onnx.save(model, target, save_as_external_data=True, location=f"{target.name}.data")
    else:
        onnx.save(model, target)


def check_file(
    path: Path,
    dims: Mapping[str, int],
    shapes: Mapping[str, Sequence[int]],
    precision: str = "fp32",
    save_dir: Path | None = None,
    progress: bool = False,
    bindings: Mapping[str, bool] | None = None,
) -> FileResult:
    """Legalize one graph and collect what each pass did, what is left, and the memory estimate.

    ``bindings`` fixes boolean inputs (a merged decoder's ``use_cache_branch``) before legalizing.
    """
    model = onnx.load(path)
    label = path.name
    if bindings:
        model = bind_constant_inputs(model, {name: [value] for name, value in bindings.items()})
        label += " [" + ", ".join(f"{name}={value}" for name, value in bindings.items()) + "]"
    input_shapes = resolve_input_shapes(model, dims, shapes)
    result = FileResult(path=path, label=label, bindings=dict(bindings or {}), input_shapes=input_shapes)

    def show(pass_name: str) -> None:
        print(f"[{label}] {pass_name} ...", file=sys.stderr, flush=True)

    try:
        legalized = legalize(model, input_shapes, precision=precision, progress=show if progress else None)
    except LegalizationError as error:
        result.reports = list(error.reports)
        result.problems = list(error.nodes)
        result.failed_pass = error.failed_pass
        result.error = error.summary
        if error.model is not None and error.failed_pass not in (None, "fix_shapes"):
            result.memory = _estimate_or_none(error.model)
        return result
    result.reports = legalized.reports
    result.memory = _estimate_or_none(legalized.model)
    if save_dir is not None:
        suffix = "".join(f".{name}_{str(value).lower()}" for name, value in (bindings or {}).items())
        result.saved_to = save_dir / f"{path.stem}{suffix}{path.suffix}"
        _save(legalized.model, result.saved_to)
    return result


def _branch_bindings(model: onnx.ModelProto) -> list[dict[str, bool] | None]:
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
    lines.append(f"  PopART-ready: {'yes' if result.ready else 'no'}")
    if result.saved_to is not None:
        lines.append(f"  saved: {result.saved_to}")
    return "\n".join(lines)


def add_check_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``check`` on an ``optimum-ipu`` subcommand parser."""
    parser = subparsers.add_parser(
        "check",
        help="legalize a model's ONNX graphs for PopART and report what is left",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    parser.set_defaults(func=run_check)
    return parser


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path", type=Path, help="a model directory with .onnx files and config.json, or one .onnx"
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
    parser.add_argument("--save", type=Path, metavar="DIR", help="write the legalized graph(s) into DIR")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")


def run_check(args: argparse.Namespace) -> int:
    """Run `check` for parsed arguments; return the exit status."""
    try:
        files = find_onnx_files(args.path)
        shapes = dict(parse_shape(text) for text in args.shape)
        explicit_dims = dict(parse_dim(text) for text in args.dim)
    except UsageError as error:
        print(f"optimum-ipu check: {error}", file=sys.stderr)
        return 2
    config = load_config(args.path)
    dims = default_dims(
        config, sequence=explicit_dims.get("sequence_length"), batch=explicit_dims.get("batch_size")
    )
    dims.update(explicit_dims)
    progress = sys.stderr.isatty() and not args.json
    results = []
    for path in files:
        skeleton = onnx.load(path, load_external_data=False)
        file_inputs = {i.name for i in skeleton.graph.input}
        file_shapes = {name: dims_ for name, dims_ in shapes.items() if name in file_inputs}
        # A merged decoder is static only once its branch is chosen: check each choice.
        for bindings in _branch_bindings(skeleton):
            result = check_file(path, dims, file_shapes, args.precision, args.save, progress, bindings)
            results.append(result)
            if not args.json:
                print(format_result(result), flush=True)
    unused = set(shapes) - {name for r in results for name in r.input_shapes}
    ready = all(result.ready for result in results)
    if args.json:
        document = {
            "path": str(args.path),
            "precision": args.precision,
            "ready": ready,
            "unused_shapes": sorted(unused),
            "files": [result.as_json() for result in results],
        }
        print(json.dumps(document, indent=2))
    else:
        if unused:
            print(f"note: --shape for {sorted(unused)} matched no graph input", file=sys.stderr)
        verdict = "every graph is PopART-ready" if ready else "some graphs are not PopART-ready"
        print(f"{len(results)} graph(s) checked: {verdict}")
    return 0 if ready else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="optimum-ipu check", description=__doc__)
    _add_arguments(parser)
    return run_check(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
