"""Packed rows and the dynamic batcher (issue 26), measured through the real ipu session on the emulator.

    python benchmarks/bench_packing.py [--requests 480] [--threads 1,4,16] [--batch 8] [--rounds 3]

The corpus is bench_runtime's: the Python standard library's docstring paragraphs tokenized for
all-MiniLM-L6-v2, run through an ``IPUInferenceSession`` (device "emulator") on MiniLM's ONNX export.
Two workloads: single requests (one paragraph per call, no padding) and calls of ``--batch`` random
paragraphs padded by the tokenizer to the longest. Each is sent by 1, 4 and 16 client threads, each
thread calling ``session.run`` and waiting for its result, through three sessions:

* ``unbatched``: default options, every call its own device steps;
* ``batched``: ``dynamic_batching="1", packing="0"``: calls of one shape share device steps;
* ``packed``: ``dynamic_batching="1"``: sequences of all gathered calls share packed rows.

Every configuration runs once untimed (compiling what it needs), then ``--rounds`` times interleaved
with the others. Reported per configuration: real tokens (attention masks) per computed token (compiled
``input_ids`` shape x device steps, read back from ``compiled_executables()``), device steps per request,
requests per second, and p50/p99 latency per call, with ratios to the unbatched session at the same
thread count. The analytic limit beside each real/computed figure is what the session's compiled sizes
allow with ideal grouping, computed without a model: unbatched, each call padded to its buckets; packed,
every group of ``threads`` calls laid out by ``runtime.packing.choose_layout`` (the runtime's own rule).

Every figure is host emulation, not an IPU measurement. Prints markdown for docs/performance.md.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["OPTIMUM_IPU_PROGRESS"] = "0"

BENCHMARKS_DIR = Path(__file__).resolve().parent
if str(BENCHMARKS_DIR) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS_DIR))

import bench_runtime  # noqa: E402

MODES = {
    "unbatched": {},
    "batched": {"dynamic_batching": "1", "packing": "0"},
    "packed": {"dynamic_batching": "1"},
}
OUTPUT = "last_hidden_state"


def counters(session: Any) -> tuple[int, int]:
    """(computed tokens, device steps) so far: compiled ``input_ids`` shape x calls, summed."""
    entries = session.compiled_executables()
    computed = sum(math.prod(entry["shapes"]["input_ids"]) * entry["calls"] for entry in entries)
    return computed, sum(entry["calls"] for entry in entries)


def run_clients(session: Any, requests: Sequence[Mapping[str, np.ndarray]], threads: int) -> dict[str, Any]:
    """``requests`` sent by ``threads`` clients (each takes the next request when its last one returns);
    latencies per call and the wall time."""
    latencies: list[float] = []
    lock = threading.Lock()
    cursor = iter(range(len(requests)))
    failures: list[BaseException] = []

    def client() -> None:
        while True:
            with lock:
                index = next(cursor, None)
            if index is None:
                return
            started = time.perf_counter()
            try:
                session.run([OUTPUT], requests[index])
            except Exception as exc:  # reported, never hidden
                failures.append(exc)
                return
            with lock:
                latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    workers = [threading.Thread(target=client) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if failures:
        raise failures[0]
    return {"latencies": latencies, "seconds": time.perf_counter() - started}


def make_workloads(
    lengths_ids: Sequence[list[int]], batch: int, requests: int, seed: int, tokenizer: Any
) -> dict:
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(lengths_ids))
    single = [
        {
            "input_ids": np.asarray([lengths_ids[i]], dtype=np.int64),
            "attention_mask": np.ones((1, len(lengths_ids[i])), dtype=np.int64),
            "token_type_ids": np.zeros((1, len(lengths_ids[i])), dtype=np.int64),
        }
        for i in order[:requests]
    ]
    groups = rng.permutation(len(lengths_ids))[: requests // batch * batch].reshape(-1, batch)
    calls = [
        {
            name: np.asarray(value, dtype=np.int64)
            for name, value in tokenizer.pad(
                {"input_ids": [lengths_ids[i] for i in group]}, return_tensors="np"
            ).items()
        }
        for group in groups
    ]
    for call in calls:
        call.setdefault("token_type_ids", np.zeros_like(call["input_ids"]))
    return {"single requests": single, f"calls of {batch}": calls}


def analytic(
    mode: str, calls: Sequence[Mapping[str, np.ndarray]], threads: int, sizes: Mapping[str, Sequence[int]]
) -> float:
    """Real/computed with ideal grouping at the session's compiled sizes (no model run)."""
    from optimum_ipu_backend.runtime.buckets import packed_row_lengths
    from optimum_ipu_backend.runtime.packing import choose_layout

    batch_sizes, sequence_sizes = sizes["batch_size"], sizes["sequence_length"]
    real = sum(int(call["attention_mask"].sum()) for call in calls)
    if mode != "packed":  # each call padded to its buckets (calls of different shapes rarely share steps)
        computed = 0
        for call in calls:
            rows, width = call["input_ids"].shape
            micro = next(size for size in batch_sizes if size >= min(rows, batch_sizes[-1]))
            computed += -(-rows // micro) * micro * next(size for size in sequence_sizes if size >= width)
        return real / computed
    computed = 0
    row_lengths = packed_row_lengths(sequence_sizes)
    for start in range(0, len(calls), threads):
        lengths = [
            int(n) for call in calls[start : start + threads] for n in call["attention_mask"].sum(axis=1)
        ]
        # feature extraction pools nothing, so a row holds any number of sequences
        layout = choose_layout(lengths, batch_sizes, row_lengths, lambda tokens: None)
        assert layout is not None
        computed += layout.computed_rows * layout.tokens
    return real / computed


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-packing-"))
    onnx_dir = bench_runtime.export_minilm(workdir)
    paragraphs = bench_runtime.load_paragraphs()
    tokenizer = AutoTokenizer.from_pretrained(bench_runtime.bench_padding().minilm_dir())
    tokenizer.model_max_length = 10**9
    token_ids = [ids for ids in tokenizer(paragraphs)["input_ids"] if len(ids) <= 512]
    workloads = make_workloads(token_ids, args.batch, args.requests, args.seed, tokenizer)
    cache = bench_runtime.fresh_dir(workdir, "packing-cache-")
    sessions = {
        mode: bench_runtime.ipu_session(onnx_dir, cache, **options) for mode, options in MODES.items()
    }
    sizes = sessions["unbatched"].bucket_sizes()
    configs = [
        (workload, threads, mode) for workload in workloads for threads in args.threads for mode in MODES
    ]
    results: dict[tuple, dict[str, Any]] = {
        config: {"latencies": [], "seconds": 0.0, "computed": 0, "steps": 0, "real": 0, "requests": 0}
        for config in configs
    }
    for workload, threads, mode in configs:  # untimed: every configuration compiles what it needs
        run_clients(sessions[mode], workloads[workload], threads)
    for _ in range(args.rounds):
        for config in configs:
            workload, threads, mode = config
            session, calls = sessions[mode], workloads[workload]
            before = counters(session)
            run = run_clients(session, calls, threads)
            after = counters(session)
            result = results[config]
            result["latencies"] += run["latencies"]
            result["seconds"] += run["seconds"]
            result["computed"] += after[0] - before[0]
            result["steps"] += after[1] - before[1]
            result["real"] += sum(int(call["attention_mask"].sum()) for call in calls)
            result["requests"] += len(calls)
    rows = []
    for config in configs:
        workload, threads, mode = config
        result = results[config]
        latencies = np.asarray(result["latencies"]) * 1000
        rows.append(
            {
                "workload": workload,
                "threads": threads,
                "mode": mode,
                "ratio": result["real"] / result["computed"],
                "analytic": analytic(mode, workloads[workload], threads, sizes),
                "steps_per_request": result["steps"] / result["requests"],
                "requests_per_s": result["requests"] / result["seconds"],
                "p50_ms": float(np.percentile(latencies, 50)),
                "p99_ms": float(np.percentile(latencies, 99)),
            }
        )
    verdict = sessions["packed"].packing_verdict()
    executables = {mode: len(session.compiled_executables()) for mode, session in sessions.items()}
    for session in sessions.values():
        session.close()
    return {
        "rows": rows,
        "verdict": verdict,
        "executables": executables,
        "sizes": sizes,
        "requests": {name: len(calls) for name, calls in workloads.items()},
        "paragraphs": len(token_ids),
    }


def print_report(report: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"Machine: {describe_machine()}; every ipu figure is host emulation.\n")
    print(f"Packing verdict: {report['verdict']}")
    print(f"Executables per session: {report['executables']}; compiled sizes {report['sizes']}")
    print(f"Requests per round: {report['requests']}, {args.rounds} timed rounds, interleaved.\n")
    print(
        "| workload | threads | mode | real/computed (analytic) | device steps / request | requests/s (x) | "
        "p50 ms (x) | p99 ms (x) |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    base = {(row["workload"], row["threads"]): row for row in report["rows"] if row["mode"] == "unbatched"}
    for row in report["rows"]:
        ref = base[(row["workload"], row["threads"])]
        cells = [
            row["workload"],
            str(row["threads"]),
            row["mode"],
            f"{row['ratio']:.3f} ({row['analytic']:.3f})",
            f"{row['steps_per_request']:.3f}",
            f"{row['requests_per_s']:.1f} ({row['requests_per_s'] / ref['requests_per_s']:.2f}x)",
            f"{row['p50_ms']:.1f} ({row['p50_ms'] / ref['p50_ms']:.2f}x)",
            f"{row['p99_ms']:.1f} ({row['p99_ms'] / ref['p99_ms']:.2f}x)",
        ]
        print("| " + " | ".join(cells) + " |")


def describe_machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=480, help="paragraphs per workload (default 480)")
    parser.add_argument("--threads", type=lambda text: [int(x) for x in text.split(",")], default=[1, 4, 16])
    parser.add_argument("--batch", type=int, default=8, help="paragraphs per call of the second workload")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="keep the export here between runs")
    args = parser.parse_args(argv)
    print_report(measure(args), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
