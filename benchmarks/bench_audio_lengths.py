"""Audio clips of real, varying lengths through the ipu session (issue 19): executables compiled and
agreement with CPU, for layer-norm feature encoders (which may be padded along the samples) and a
group-norm one (which must be compiled per length).

    python benchmarks/bench_audio_lengths.py [--clips 100] [--seed 0] [--shortest 1] [--longest 10]

``--clips`` clips of random length, uniform between ``--shortest`` and ``--longest`` seconds of 16 kHz
audio (seeded), each clip random samples at scale 0.1, one clip per call (batch 1), through the tiny
models of tests/audio_zoo.py (hidden 32, 2 layers, wav2vec2-base's convolution strides: 49 frames a
second): WavLM with a layer-norm feature encoder (CTC and audio classification heads) and wav2vec2 with
a group-norm one (CTC). Each model runs with ``provider="ipu"`` on the host emulator with default
provider options (or ``--provider-options``) and with CPUExecutionProvider, in one session each, with an
empty executable cache. Per model: executables compiled (``compiled_executables()``), distinct clip
lengths, the largest |ipu - cpu| over the frames CPU returns (an output of another shape is a failure),
calls refused, and the median wall time per clip (the calls that compiled included in the total).

Exits non-zero if a layer-norm model compiles more than ``--max-executables`` (8) executables, or any
output differs from CPU's by more than ``--atol`` (1e-4), has another shape, or is refused. Every ipu
figure is host emulation (onnxruntime on this machine's CPU running the IPU graph), not an IPU
measurement; on an IPU each executable is a compile of minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ["OPTIMUM_IPU_PROGRESS"] = "0"  # bars would interleave with the table

BENCHMARKS_DIR = Path(__file__).resolve().parent
TESTS_DIR = BENCHMARKS_DIR.parent / "tests"
#: (model of tests/audio_zoo.py, whether its executables count against ``--max-executables``)
MODELS: tuple[tuple[str, bool], ...] = (
    ("wavlm-layer-ctc", True),
    ("wavlm-layer-audio-classification", True),
    ("wav2vec2-group-ctc", False),
)


def _outputs(result: Any) -> list[np.ndarray]:
    return [np.asarray(result[key]) for key in result.keys()]


def run_model(
    zoo: Any, name: str, lengths: Sequence[int], provider_options: dict[str, str]
) -> dict[str, Any]:
    """Every clip through ``name`` on ipu and on CPU; the figures of one table row."""
    import optimum.onnxruntime as ort_models
    import torch
    from audio_zoo import AUDIO_CASES, audio_inputs

    cls = getattr(ort_models, AUDIO_CASES[name].ort_class)
    onnx_dir = zoo.onnx(name)
    cpu = cls.from_pretrained(onnx_dir, provider="CPUExecutionProvider")
    ipu = cls.from_pretrained(onnx_dir, provider="ipu", provider_options=provider_options)
    ipu_seconds, cpu_seconds, diffs, failures = [], [], [], []
    for index, samples in enumerate(lengths):
        inputs = {key: torch.from_numpy(value) for key, value in audio_inputs(samples, seed=index).items()}
        with torch.no_grad():
            started = time.perf_counter()
            expected = _outputs(cpu(**inputs))
            cpu_seconds.append(time.perf_counter() - started)
            started = time.perf_counter()
            try:
                got = _outputs(ipu(**inputs))
            except Exception as error:  # a refusal is a failure of this benchmark, reported with its message
                failures.append(f"{samples} samples: {type(error).__name__}: {str(error)[:300]}")
                continue
            finally:
                ipu_seconds.append(time.perf_counter() - started)
        shapes = [a.shape for a in expected], [b.shape for b in got]
        if shapes[0] != shapes[1]:
            failures.append(f"{samples} samples: ipu shapes {shapes[1]}, cpu {shapes[0]}")
            continue
        diffs.append(max(float(np.abs(a - b).max()) for a, b in zip(expected, got, strict=True)))
    compiled = ipu.model.compiled_executables()
    return {
        "model": name,
        "norm": AUDIO_CASES[name].norm,
        "executables": len(compiled),
        "compiled_samples": sorted(
            {shape[1] for entry in compiled for shape in entry["shapes"].values() if len(shape) == 2}
        ),
        "distinct_lengths": len(set(lengths)),
        "max_abs_diff": max(diffs, default=float("nan")),
        "failures": failures,
        "ipu_median_ms": 1000 * statistics.median(ipu_seconds),
        "cpu_median_ms": 1000 * statistics.median(cpu_seconds),
        "ipu_total_s": sum(ipu_seconds),
        "padding": ipu.model.padding_verdicts(),
    }


def print_table(rows: Sequence[dict[str, Any]], clips: int, shortest: float, longest: float) -> None:
    print(f"{clips} clips of {shortest:g} to {longest:g} s at 16 kHz, one per call.\n")
    print(
        "| model | feature norm | executables | distinct lengths | max abs diff (valid frames) | failures "
        "| ipu median ms/clip | cpu median ms/clip | ipu/cpu | ipu total s (compiles included) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['model']} | {row['norm']} | {row['executables']} | {row['distinct_lengths']} "
            f"| {row['max_abs_diff']:.2e} | {len(row['failures'])} | {row['ipu_median_ms']:.1f} "
            f"| {row['cpu_median_ms']:.1f} | {row['ipu_median_ms'] / row['cpu_median_ms']:.2f}x "
            f"| {row['ipu_total_s']:.1f} |"
        )
    print()
    for row in rows:
        print(
            f"- {row['model']}: compiled samples {row['compiled_samples'][:12]}"
            f"{' ...' if len(row['compiled_samples']) > 12 else ''}; padding {row['padding']}"
        )
        for failure in row["failures"][:3]:
            print(f"  - failure: {failure}")
    print()


def verdict(rows: Sequence[dict[str, Any]], max_executables: int, atol: float) -> list[str]:
    """What breaks the issue's bounds, one line each (empty: the benchmark passes)."""
    bounded = dict(MODELS)
    problems = []
    for row in rows:
        if bounded[row["model"]] and row["executables"] > max_executables:
            problems.append(f"{row['model']} compiled {row['executables']} executables (> {max_executables})")
        if row["failures"]:
            problems.append(f"{row['model']}: {len(row['failures'])} calls failed")
        if not row["max_abs_diff"] <= atol:  # NaN (nothing compared) fails too
            problems.append(f"{row['model']}: max |ipu - cpu| {row['max_abs_diff']:.2e} > {atol:g}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clips", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shortest", type=float, default=1.0, help="seconds")
    parser.add_argument("--longest", type=float, default=10.0, help="seconds")
    parser.add_argument("--max-executables", type=int, default=8, help="bound for layer-norm models")
    parser.add_argument("--atol", type=float, default=1e-4)
    parser.add_argument(
        "--models", default=",".join(name for name, _ in MODELS), help="comma-separated subset of the three"
    )
    parser.add_argument(
        "--provider-options",
        default="{}",
        help='JSON merged into {"device": "emulator"} (default: none, the defaults are what is measured)',
    )
    parser.add_argument("--workdir", type=Path, help="keep the models here (default: a temp dir)")
    args = parser.parse_args(argv)

    for path in (BENCHMARKS_DIR, TESTS_DIR):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    print(f"`python {' '.join([os.path.relpath(__file__), *sys.argv[1:]])}`\n")
    with tempfile.TemporaryDirectory(prefix="bench-audio-lengths-") as scratch:
        # An empty executable cache: every executable counted is compiled by this run.
        os.environ["OPTIMUM_IPU_CACHE"] = str(Path(scratch) / "executables")
        from audio_zoo import clip_lengths, real_size_zoo
        from bench_runtime import describe_machine

        from optimum_ipu_backend.conformance.zoo import ModelZoo

        print(f"{describe_machine()}.\n")
        zoo = real_size_zoo(ModelZoo(args.workdir or Path(scratch) / "zoo"))
        lengths = clip_lengths(args.clips, args.seed, args.shortest, args.longest)
        options = {"device": "emulator", **json.loads(args.provider_options)}
        started = time.perf_counter()
        rows = [run_model(zoo, name, lengths, options) for name in args.models.split(",")]
        print_table(rows, args.clips, args.shortest, args.longest)
        print(f"Total wall time {time.perf_counter() - started:.0f} s.\n")
    problems = verdict(rows, args.max_executables, args.atol)
    print("PASS" if not problems else "FAIL:\n" + "\n".join(f"- {p}" for p in problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
