"""Legalization time of a BERT-base-sized graph (12 layers, hidden 768) at batch 8, sequence 128.

The model is built from a default ``BertConfig`` with random weights (no hub access) and exported once
with optimum-onnx into a temporary directory (or ``--workdir``, reused when it already holds the export).
Prints a markdown table: the median of ``--runs`` legalizations and the median time of each pass.

    python benchmarks/bench_legalize.py [--runs 3] [--precision fp32] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BATCH, SEQUENCE = 8, 128


def export_bert_base(workdir: Path) -> Path:
    """A BERT-base sequence classifier with random weights, exported with optimum-onnx's defaults."""
    onnx_file = workdir / "onnx" / "model.onnx"
    if onnx_file.is_file():
        return onnx_file
    import torch
    import transformers
    from optimum.exporters.onnx import main_export

    torch.manual_seed(0)
    model_dir = workdir / "bert-base-random"
    config = transformers.BertConfig(num_labels=2)  # the defaults are bert-base: 12 x 768, 12 heads
    transformers.BertForSequenceClassification(config).eval().save_pretrained(model_dir)
    main_export(
        str(model_dir),
        output=workdir / "onnx",
        task="text-classification",
        do_validation=False,
        local_files_only=True,
        library_name="transformers",
    )
    return onnx_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--precision", choices=("fp32", "fp16"), default="fp32")
    parser.add_argument("--workdir", type=Path, help="where to keep the export (default: a temporary dir)")
    args = parser.parse_args(argv)

    import onnx

    from optimum_ipu_backend.compiler import legalize

    with tempfile.TemporaryDirectory(prefix="bench-legalize-") as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        onnx_file = export_bert_base(workdir)
        export_seconds = time.perf_counter() - started
        model = onnx.load(onnx_file)
        shapes = {name: (BATCH, SEQUENCE) for name in ("input_ids", "attention_mask", "token_type_ids")}
        totals: list[float] = []
        per_pass: dict[str, list[float]] = {}
        for _ in range(args.runs):
            started = time.perf_counter()
            legalized = legalize(model, shapes, precision=args.precision)
            totals.append(time.perf_counter() - started)
            for report in legalized.reports:
                per_pass.setdefault(report.name, []).append(report.seconds)

    print(f"`{' '.join([Path(sys.executable).name, *sys.argv])}`\n")
    print(
        f"BERT-base (12 layers, hidden 768, random weights), batch {BATCH}, sequence {SEQUENCE}, "
        f"precision {args.precision}; {os.cpu_count()} CPU(s), Python {platform.python_version()}; "
        f"export (once, not timed below): {export_seconds:.1f} s\n"
    )
    print("| step | median s | runs (s) |")
    print("|---|---:|---|")
    for name, seconds in per_pass.items():
        print(f"| {name} | {statistics.median(seconds):.2f} | {', '.join(f'{s:.2f}' for s in seconds)} |")
    runs = ", ".join(f"{s:.2f}" for s in totals)
    print(f"| **legalize() total** | **{statistics.median(totals):.2f}** | {runs} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
