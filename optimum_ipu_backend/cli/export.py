"""``optimum-cli export ipu`` (also ``optimum-ipu export``): a model directory that starts warm on the IPU.

1. Export to ONNX exactly as ``optimum-cli export onnx`` does (``optimum.exporters.onnx.main_export``).
2. Work out the compiled sizes ("buckets") of every graph, from the options given and the runtime's
   defaults, and write them to ``ipu_config.json`` beside the graphs, so every later session of this
   directory plans the same shapes. Every graph is pre-checked by the compiler on the way.
3. Where the chosen device's engine can compile here, legalize and compile every bucket combination of
   every graph into the executable cache (``session.precompile.fill_cache``, what ``optimum-ipu
   compile`` runs), so ``from_pretrained(OUTPUT, provider="ipu")`` loads them and compiles nothing.
   Elsewhere (no SDK for device ``ipu``) the cache is left to fill where it can.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Exporting imports torch, transformers and the exporters: inside the run function only.

EXPORT_HELP = (
    "export a model to ONNX for the IPU, with its buckets in ipu_config.json and a warm executable cache"
)


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``optimum-cli export ipu`` and ``optimum-ipu export`` (one definition)."""
    parser.add_argument(
        "-m",
        "--model",
        required=True,
        help="model id on the Hugging Face Hub, or a local checkpoint directory",
    )
    parser.add_argument("output", type=Path, help="directory to write the ONNX graphs and ipu_config.json to")
    parser.add_argument(
        "--task",
        default="auto",
        help="the task to export for, as in `optimum-cli export onnx` (default: inferred from the model)",
    )
    parser.add_argument(
        "--sequence-lengths",
        default=None,
        help="compiled sizes of sequence_length, e.g. 64,128,256 (default: the runtime's, up to the model's "
        "maximum positions)",
    )
    parser.add_argument(
        "--batch-sizes", default=None, help="compiled batch sizes, e.g. 1,8 (default: the runtime's, 1,2,4,8)"
    )
    parser.add_argument(
        "--precision", default=None, help="fp32 (default) or fp16: what the executables compute in"
    )
    parser.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="NAME=SIZE",
        help="the size to compile a dimension no bucket plans at (image height/width, audio frames); "
        "repeatable",
    )
    parser.add_argument(
        "--device",
        default=None,
        help="the device to compile the executables for: ipu, ipu-model or emulator (default: "
        "$OPTIMUM_IPU_DEVICE, else ipu); the cache is filled only where its engine is usable here",
    )


def add_export_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("export", help=EXPORT_HELP, description=EXPORT_HELP)
    add_export_arguments(parser)
    parser.set_defaults(func=run_export)


def infer_export_task(config: Mapping[str, Any]) -> str:
    """The task ``optimum-cli export onnx`` picks for a model of this config: the one of its architecture
    class, with past key/values when the exporter supports them for the model type (its default). The
    exporter infers it itself only for a model on the Hub, not for a local checkpoint."""
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
    raise ValueError(
        f"cannot infer the export task from config.json (architectures {config.get('architectures')}, "
        f"model_type {model_type!r}); pass --task, e.g. --task text-classification"
    )


def export_onnx(model: str, output: Path, task: str = "auto", local_files_only: bool = False) -> list[Path]:
    """Export ``model`` to ``output`` as ``optimum-cli export onnx --model MODEL [--task TASK] OUTPUT`` does,
    for ``export`` and ``check``; returns the ONNX graphs written."""
    from optimum.exporters.onnx import main_export

    config_file = Path(model) / "config.json"
    if task == "auto" and config_file.is_file():
        task = infer_export_task(json.loads(config_file.read_text(encoding="utf-8")))
    main_export(
        model_name_or_path=model,
        output=output,
        task=task,
        use_subprocess=True,
        local_files_only=local_files_only,
    )
    graphs = sorted(Path(output).glob("*.onnx"))
    if not graphs:
        raise RuntimeError(f"the export of {model!r} to {output} wrote no .onnx file")
    return graphs


def _given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The runtime settings the command line sets, under their ``ipu_config.json`` names."""
    given = {
        "sequence_lengths": args.sequence_lengths,
        "batch_size": args.batch_sizes,
        "precision": args.precision,
    }
    return {name: value for name, value in given.items() if value is not None}


def chosen_buckets(graphs: list[Path], given: Mapping[str, Any]) -> dict[str, list[int]]:
    """Every graph's compiled sizes as ``ipu_config.json`` fields (``batch_size``, ``sequence_lengths``,
    ...), from the options given and the runtime's defaults. Graphs that plan a dimension differently
    (a decoder with a past also compiles one-token steps) get the union, so they plan alike."""
    from optimum_ipu_backend.runtime.buckets import option_name
    from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions
    from optimum_ipu_backend.session import IPUInferenceSession

    # The emulator resolves everywhere and compiles nothing until a call; the plan does not depend on it.
    buckets: dict[str, set[int]] = {}
    for graph in graphs:
        options = IPUProviderOptions.parse(
            {"device": "emulator", "cache_enabled": "0", **given}, graph.parent
        )
        with IPUInferenceSession(str(graph), options=options) as session:
            for dim, sizes in session.bucket_sizes().items():
                buckets.setdefault(option_name(dim), set()).update(sizes)
    return {name: sorted(sizes) for name, sizes in sorted(buckets.items())}


def write_ipu_config(output: Path, fields: Mapping[str, Any]) -> Path:
    """Write ``fields`` into ``output/ipu_config.json``, keeping any other field already there."""
    from optimum_ipu_backend.runtime.ipu_config import IPU_CONFIG_NAME

    path = Path(output) / IPU_CONFIG_NAME
    existing = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    path.write_text(json.dumps({**existing, **fields}, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def run_export(args: argparse.Namespace) -> int:
    """Export, write the buckets, fill the cache; exit status 0 when the directory is complete."""
    from optimum_ipu_backend.cli.compile import fixed_dims
    from optimum_ipu_backend.engines.probe import (
        DEVICE_KINDS,
        DeviceUnavailableError,
        default_device,
        resolve_device,
    )
    from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions

    output: Path = args.output
    given = _given_options(args)
    device = DEVICE_KINDS[args.device or default_device()].name
    IPUProviderOptions.parse({"device": device, **given})  # bad sizes or precision fail before the export
    dims = fixed_dims(args.dim)
    graphs = export_onnx(args.model, output, args.task)
    fields = {**given, **chosen_buckets(graphs, given)}
    config = write_ipu_config(output, fields)
    print(f"Exported {', '.join(graph.name for graph in graphs)} to {output}")
    print(
        f"Compiled sizes in {config}: " + "; ".join(f"{k}={v}" for k, v in fields.items() if k != "precision")
    )
    try:
        resolve_device(device)
    except (DeviceUnavailableError, ValueError) as exc:
        print(f"The executable cache was not filled: {exc}", file=sys.stderr)
        return 0
    from optimum_ipu_backend.session.precompile import fill_cache

    try:
        report = fill_cache(output, {"device": device}, fixed_dims=dims)
    except ValueError as exc:  # a dimension no bucket plans (image sizes, audio frames) and no --dim for it
        print(f"The executable cache was not filled: {exc} (with --dim NAME=SIZE)", file=sys.stderr)
        return 1
    records = [record for graph in report for record in graph["executables"]]
    compiled = sum(1 for record in records if record["source"] == "compiled")
    where = report[0]["executable_cache"]
    if where == "disabled":
        print("The executable cache is disabled (ipu_config.json or OPTIMUM_IPU_CACHE): nothing was kept")
        return 0
    print(
        f"Executable cache: {len(records)} executables for device {device!r} "
        f"({compiled} compiled now, {len(records) - compiled} already cached) in {where}"
    )
    return 0
