"""The static-shape runtime (issue 4), measured through the real ipu session on the host emulator.

    python benchmarks/bench_runtime.py [--sections abcd] [--paragraphs 2000] [--load-runs 5] [--calls 30]

a. Padding efficiency (real tokens / computed tokens) and inputs rejected, on the Python standard
   library's docstring paragraphs tokenized for all-MiniLM-L6-v2 (the loader of bench_padding.py), run
   through an ``IPUInferenceSession`` (device "emulator") on MiniLM's ONNX export. Computed tokens are
   read back from the session: the sum over ``compiled_executables()`` of the compiled ``input_ids``
   shape times the calls it served; real tokens are the sum of the attention masks. Cases: one sequence
   per call, and calls of ``--batch`` random paragraphs padded by the tokenizer to the longest, with
   default options and with ``trim_padding="1"``. The analytic rows (no model runs) are reference points
   and a cross-check of the measured ones.
b. Load time in fresh processes, from ``from_pretrained`` to the first result of one call (batch 1, 16
   tokens), imports excluded: ipu with an empty cache (cold), ipu with a filled cache (warm), and a plain
   CPUExecutionProvider ORTModel of the same export; interleaved, medians.
c. Per-call overhead of bucket selection, padding and slicing at a BERT-base-sized model (12 layers,
   hidden 768, random weights), batch 8, 120 tokens (bucket 128): ``session.run`` against the same
   compiled executable run directly on an already padded device feed, interleaved call by call.
d. A 64-token greedy generation of a small random GPT-2 (4 layers, n_embd 256, vocabulary 1000,
   n_positions 256) from an 8-token prompt: ipu against CPUExecutionProvider, tokens, executables, calls
   and wall time.

Every ipu figure is host emulation (onnxruntime on this machine's CPU running the legalized IPU graph),
not an IPU measurement. Prints markdown; the figures go to docs/performance.md with the command line.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["OPTIMUM_IPU_PROGRESS"] = "0"  # bars would interleave with the tables

BENCHMARKS_DIR = Path(__file__).resolve().parent
LOAD_TOKENS = 16
OVERHEAD_BATCH, OVERHEAD_TOKENS = 8, 120
PROMPT_TOKENS, NEW_TOKENS = 8, 64
# Analytic reference strategies for one sequence per call (optimum-graphcore pads every text to 128).
REFERENCE_SIZES = {
    "optimum-graphcore pad to 128 (truncates longer inputs)": (128,),
    "powers of two 16..512": (16, 32, 64, 128, 256, 512),
}


def bench_padding() -> Any:
    """benchmarks/bench_padding.py, whose paragraph loader and analytic strategies are reused here."""
    if str(BENCHMARKS_DIR) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS_DIR))
    return importlib.import_module("bench_padding")


@contextlib.contextmanager
def quiet_exports() -> Iterator[None]:
    """Tracer and deprecation notes come with every export and would bury the tables."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        yield


def ipu_session(onnx_dir: Path, cache_dir: Path, **options: str) -> Any:
    from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions
    from optimum_ipu_backend.session import IPUInferenceSession

    raw = {"device": "emulator", "progress": "0", "executable_cache_dir": str(cache_dir), **options}
    return IPUInferenceSession(str(onnx_dir / "model.onnx"), options=IPUProviderOptions.parse(raw, onnx_dir))


def fresh_dir(workdir: Path, prefix: str) -> Path:
    """An empty directory (caches must start empty even when --workdir is reused)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=workdir))


def computed_tokens(session: Any) -> int:
    """Token positions the executables computed: compiled ``input_ids`` shape x calls, padding included."""
    return sum(
        math.prod(entry["shapes"]["input_ids"]) * entry["calls"] for entry in session.compiled_executables()
    )


def executable_sources(session: Any) -> str:
    sources = [entry["source"] for entry in session.compiled_executables()]
    return ", ".join(f"{sources.count(kind)} {kind}" for kind in ("compiled", "cache") if kind in sources)


def export_minilm(workdir: Path) -> Path:
    """all-MiniLM-L6-v2 exported once by optimum-onnx the way ``from_pretrained(export=True)`` does."""
    from optimum.onnxruntime import ORTModelForFeatureExtraction

    onnx_dir = workdir / "minilm-onnx"
    if not (onnx_dir / "model.onnx").is_file():
        with quiet_exports():
            model = ORTModelForFeatureExtraction.from_pretrained(
                bench_padding().minilm_dir(), export=True, provider="CPUExecutionProvider"
            )
            model.save_pretrained(onnx_dir)
    return onnx_dir


# ----------------------------------------------------------------------------------------------------------
# a. Padding efficiency through the runtime
# ----------------------------------------------------------------------------------------------------------


def load_paragraphs() -> list[str]:
    """bench_padding's paragraph collector, run in a child interpreter as bench_padding itself does (it
    imports most of the standard library)."""
    with tempfile.TemporaryDirectory() as scratch:
        target = Path(scratch) / "paragraphs.json"
        subprocess.run(
            [sys.executable, bench_padding().__file__, "--collect-to", str(target)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return json.loads(target.read_text(encoding="utf-8"))


def run_single_calls(session: Any, token_ids: Sequence[list[int]]) -> dict[str, int]:
    from optimum_ipu_backend.runtime.buckets import InputTooLargeError

    real = rejected = cut = 0
    for ids in token_ids:
        input_ids = np.asarray([ids], dtype=np.int64)
        feed = {
            "input_ids": input_ids,
            "attention_mask": np.ones_like(input_ids),
            "token_type_ids": np.zeros_like(input_ids),
        }
        try:
            (hidden,) = session.run(["last_hidden_state"], feed)
        except InputTooLargeError:
            rejected += 1
            continue
        cut += hidden.shape[1] != input_ids.shape[1]
        real += input_ids.shape[1]
    return {"real": real, "rejected": rejected, "cut": cut}


def run_batched_calls(session: Any, calls: Sequence[Mapping[str, np.ndarray]]) -> dict[str, int]:
    from optimum_ipu_backend.runtime.buckets import InputTooLargeError

    real = rejected = cut = 0
    for feed in calls:
        try:
            (hidden,) = session.run(["last_hidden_state"], feed)
        except InputTooLargeError:
            rejected += len(feed["input_ids"])
            continue
        cut += hidden.shape[:2] != feed["input_ids"].shape
        real += int(feed["attention_mask"].sum())
    return {"real": real, "rejected": rejected, "cut": cut}


def padding_efficiency(workdir: Path, onnx_dir: Path, limit: int, batch: int, seed: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    padding = bench_padding()
    paragraphs = load_paragraphs()
    total = len(paragraphs)
    if limit and limit < total:
        chosen = np.sort(np.random.default_rng(seed).choice(total, size=limit, replace=False))
        paragraphs = [paragraphs[index] for index in chosen]
    tokenizer = AutoTokenizer.from_pretrained(padding.minilm_dir())
    tokenizer.model_max_length = 10**9  # nothing is truncated by the tokenizer: the runtime must decide
    token_ids = tokenizer(paragraphs)["input_ids"]
    lengths = np.array([len(ids) for ids in token_ids])
    # The same grouping bench_padding.batch_efficiencies uses, so its analytic figure is a cross-check.
    order = np.random.default_rng(seed).permutation(len(paragraphs))
    groups = order[: len(order) // batch * batch].reshape(-1, batch)
    batched_calls = [
        dict(tokenizer([paragraphs[i] for i in group], padding=True, return_tensors="np")) for group in groups
    ]
    cache = fresh_dir(workdir, "padding-cache-")  # shared by the cases: one compiles, the next may load
    rows = []

    started = time.perf_counter()
    session = ipu_session(onnx_dir, cache)
    sizes = tuple(session.bucket_sizes()["sequence_length"])
    result = run_single_calls(session, token_ids)
    analytic, _ = padding.single_efficiency(lengths, sizes)
    rows.append(
        {
            "case": "one sequence per call, default options",
            "calls": len(token_ids),
            **result,
            "computed": computed_tokens(session),
            "executables": len(session.compiled_executables()),
            "sources": executable_sources(session),
            "analytic": analytic,
            "seconds": time.perf_counter() - started,
        }
    )
    analytic_batched = padding.batch_efficiencies(lengths, sizes, batch, seed)[
        "whole_call_to_bucket_of_longest"
    ]
    for label, options, expected in (
        ("default options", {}, analytic_batched),
        ('trim_padding="1"', {"trim_padding": "1"}, None),
    ):
        started = time.perf_counter()
        session = ipu_session(onnx_dir, cache, **options)
        result = run_batched_calls(session, batched_calls)
        rows.append(
            {
                "case": f"calls of {batch} random paragraphs padded to the longest, {label}",
                "calls": len(batched_calls),
                **result,
                "computed": computed_tokens(session),
                "executables": len(session.compiled_executables()),
                "sources": executable_sources(session),
                "analytic": expected,
                "seconds": time.perf_counter() - started,
            }
        )
    references = {
        name: {
            "sizes": sizes_,
            "measured_set": padding.single_efficiency(lengths, sizes_),
        }
        for name, sizes_ in REFERENCE_SIZES.items()
    }
    tokenizer_only = padding.batch_efficiencies(lengths, sizes, batch, seed)["tokenizer_padding_only"]
    return {
        "paragraphs_total": total,
        "paragraphs_used": len(paragraphs),
        "seed": seed,
        "batch": batch,
        "median": float(np.median(lengths)),
        "p90": float(np.percentile(lengths, 90)),
        "max": int(lengths.max()),
        "sizes": sizes,
        "rows": rows,
        "references": references,
        "tokenizer_only": tokenizer_only,
    }


def print_padding(report: dict[str, Any]) -> None:
    used, total = report["paragraphs_used"], report["paragraphs_total"]
    subset = (
        f"a fixed random subset of {used} of the {total} paragraphs (seed {report['seed']})"
        if used < total
        else f"all {total} paragraphs"
    )
    print(
        f"### a. Padding efficiency through the runtime\n\n{subset}; tokens per paragraph: median "
        f"{report['median']:.0f}, p90 {report['p90']:.0f}, max {report['max']}. Compiled sequence sizes "
        f"(default plan): {', '.join(map(str, report['sizes']))}.\n"
    )
    print(
        "| case (ipu session, device emulator) | calls | real / computed tokens | analytic check "
        "| inputs rejected | outputs cut short | executables | wall s |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    for row in report["rows"]:
        efficiency = row["real"] / row["computed"] if row["computed"] else float("nan")
        analytic = "-" if row["analytic"] is None else f"{row['analytic']:.3f}"
        print(
            f"| {row['case']} | {row['calls']} | **{efficiency:.3f}** | {analytic} | {row['rejected']} "
            f"| {row['cut']} | {row['executables']} ({row['sources']}) | {row['seconds']:.0f} |"
        )
    print(
        "\n| reference, one sequence per call (analytic, no model runs, same paragraphs) | executables "
        "| real / computed tokens | truncated |"
    )
    print("|---|---:|---:|---:|")
    for name, reference in report["references"].items():
        efficiency, too_long = reference["measured_set"]
        print(f"| {name} | {len(reference['sizes'])} | {efficiency:.3f} | {100 * too_long:.2f}% |")
    print(
        f"| calls of {report['batch']}: tokenizer padding to the longest row alone, no buckets | - "
        f"| {report['tokenizer_only']:.3f} | 0.00% |\n"
    )


# ----------------------------------------------------------------------------------------------------------
# b. Load time in fresh processes
# ----------------------------------------------------------------------------------------------------------


def child_load(kind: str, onnx_dir: str, cache_dir: str) -> None:
    """In a fresh interpreter: imports first (not timed), then ``from_pretrained`` up to the first result."""
    import torch
    from optimum.onnxruntime import ORTModelForFeatureExtraction

    rng = np.random.default_rng(0)
    inputs = {
        "input_ids": torch.from_numpy(rng.integers(1000, 20000, (1, LOAD_TOKENS), dtype=np.int64)),
        "attention_mask": torch.ones((1, LOAD_TOKENS), dtype=torch.int64),
        "token_type_ids": torch.zeros((1, LOAD_TOKENS), dtype=torch.int64),
    }
    if kind == "cpu":
        options: dict[str, Any] = {"provider": "CPUExecutionProvider"}
    else:
        options = {
            "provider": "ipu",
            "provider_options": {"device": "emulator", "executable_cache_dir": cache_dir, "progress": "0"},
        }
    started = time.perf_counter()
    model = ORTModelForFeatureExtraction.from_pretrained(onnx_dir, **options)
    with torch.no_grad():
        hidden = model(**inputs).last_hidden_state
    seconds = time.perf_counter() - started
    sources = [] if kind == "cpu" else [entry["source"] for entry in model.session.compiled_executables()]
    print(json.dumps({"seconds": seconds, "sources": sources, "shape": list(hidden.shape)}))


def _load_once(kind: str, onnx_dir: Path, cache_dir: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPTIMUM_IPU")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OPTIMUM_IPU_PROGRESS="0")
    completed = subprocess.run(
        [sys.executable, __file__, "--child-load", kind, str(onnx_dir), str(cache_dir)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(completed.stdout.strip().splitlines()[-1])


def ensure_bytecode() -> None:
    """Compile this package's bytecode, as ``pip install`` does. An editable install under
    ``PYTHONDONTWRITEBYTECODE=1`` (as on these machines) has none, and every fresh process would then
    spend ~30 ms compiling the package's source: a cost no installed user pays, which the load
    comparison must not charge to the ipu side (onnxruntime, optimum and torch all have theirs)."""
    import compileall

    import _optimum_ipu_backend_bootstrap

    import optimum_ipu_backend

    compileall.compile_dir(str(Path(optimum_ipu_backend.__file__).parent), quiet=1)
    compileall.compile_file(_optimum_ipu_backend_bootstrap.__file__, quiet=1)


def load_times(workdir: Path, onnx_dir: Path, runs: int) -> dict[str, Any]:
    ensure_bytecode()
    warm_cache = fresh_dir(workdir, "load-warm-cache-")
    _load_once("warm", onnx_dir, warm_cache)  # fills the cache; not timed
    samples: dict[str, list[float]] = {"cold": [], "warm": [], "cpu": []}
    sources: dict[str, set[str]] = {"cold": set(), "warm": set()}
    kinds = list(samples)
    for run in range(runs):
        # Rotate the order so that no kind always runs right after the same other one.
        for kind in kinds[run % 3 :] + kinds[: run % 3]:
            cache = fresh_dir(workdir, "load-cold-cache-") if kind == "cold" else warm_cache
            result = _load_once(kind, onnx_dir, cache)
            samples[kind].append(result["seconds"])
            if kind in sources:
                sources[kind].update(result["sources"])
    return {"runs": runs, "samples": samples, "sources": {k: sorted(v) for k, v in sources.items()}}


def print_load(report: dict[str, Any]) -> None:
    medians = {kind: statistics.median(values) for kind, values in report["samples"].items()}
    print(
        "### b. Load time, new process, `from_pretrained` to the first result "
        f"(batch 1, {LOAD_TOKENS} tokens)\n\nall-MiniLM-L6-v2 export; imports excluded, the plugin's own "
        "lazy imports included; "
        f"{report['runs']} runs of each, interleaved.\n"
    )
    print("| load | median s | runs (s) | executables from | vs plain CPU |")
    print("|---|---:|---|---|---:|")
    labels = {
        "cold": "ipu (emulator), empty cache (cold)",
        "warm": "ipu (emulator), filled cache (warm)",
        "cpu": "plain ORTModel, CPUExecutionProvider",
    }
    for kind, label in labels.items():
        runs = ", ".join(f"{value:.2f}" for value in report["samples"][kind])
        where = ", ".join(report["sources"].get(kind, [])) or "-"
        print(f"| {label} | {medians[kind]:.2f} | {runs} | {where} | {medians[kind] / medians['cpu']:.2f}x |")
    print(f"\nTarget warm <= 1.2x plain CPU: warm/cpu = {medians['warm'] / medians['cpu']:.2f}x.\n")


# ----------------------------------------------------------------------------------------------------------
# c. Per-call overhead at BERT-base size
# ----------------------------------------------------------------------------------------------------------


def export_bert_base(workdir: Path) -> Path:
    import torch
    import transformers
    from optimum.exporters.onnx import main_export

    onnx_dir = workdir / "bert-base-onnx"
    if (onnx_dir / "model.onnx").is_file():
        return onnx_dir
    torch.manual_seed(0)
    model_dir = workdir / "bert-base"
    config = transformers.BertConfig()  # the defaults are BERT-base: 12 layers, hidden 768, 12 heads
    transformers.BertModel(config).eval().save_pretrained(model_dir)
    with quiet_exports():
        main_export(
            str(model_dir),
            output=onnx_dir,
            task="feature-extraction",
            do_validation=False,
            local_files_only=True,
            library_name="transformers",
            no_post_process=True,
        )
    return onnx_dir


def _timed(function: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = function()
    return time.perf_counter() - started, result


def per_call_overhead(workdir: Path, calls: int) -> dict[str, Any]:
    onnx_dir = export_bert_base(workdir)
    session = ipu_session(onnx_dir, fresh_dir(workdir, "overhead-cache-"))
    rng = np.random.default_rng(0)
    input_ids = rng.integers(1000, 30000, (OVERHEAD_BATCH, OVERHEAD_TOKENS), dtype=np.int64)
    feed = {
        "input_ids": input_ids,
        "attention_mask": np.ones_like(input_ids),
        "token_type_ids": np.zeros_like(input_ids),
    }
    bucket = session.bucket_sizes()["sequence_length"]
    padded_length = min(size for size in bucket if size >= OVERHEAD_TOKENS)
    # What the runner hands the executable: every input padded to the bucket (pad token 0 = BERT's, mask 0),
    # laid out [device_iterations, replicas, *shape] = [1, 1, 8, 128].
    padded = {name: np.zeros((OVERHEAD_BATCH, padded_length), np.int64) for name in feed}
    for name, array in feed.items():
        padded[name][:, :OVERHEAD_TOKENS] = array
    step_feed = {name: array[None, None] for name, array in padded.items()}
    shapes = {name: array.shape for name, array in padded.items()}
    table = session._runner._table

    def direct() -> dict[str, np.ndarray]:
        return table.run_step(shapes, {}, step_feed)

    def through_session() -> list[np.ndarray]:
        return session.run(["last_hidden_state"], feed)

    (expected,) = through_session()  # compiles the one executable
    direct_hidden = direct()["last_hidden_state"][0, 0, :, :OVERHEAD_TOKENS]
    max_difference = float(np.abs(direct_hidden - expected).max())
    session_times, direct_times = [], []
    for call in range(calls):
        pair = [(session_times, through_session), (direct_times, direct)]
        for times, function in pair if call % 2 == 0 else reversed(pair):
            times.append(_timed(function)[0])
    executables = session.compiled_executables()
    host_ms = host_only_ms(session, table, direct(), max(100, calls))
    return {
        "calls": calls,
        "padded_length": padded_length,
        "session_ms": statistics.median(session_times) * 1e3,
        "direct_ms": statistics.median(direct_times) * 1e3,
        "paired_ms": statistics.median(s - d for s, d in zip(session_times, direct_times, strict=True)) * 1e3,
        "executables": len(executables),
        "executable_calls": sum(entry["calls"] for entry in executables),
        "max_difference": max_difference,
        "host_ms": host_ms,
    }


def host_only_ms(session: Any, table: Any, step_outputs: dict[str, np.ndarray], calls: int) -> float:
    """Median of ``session.run`` with the device step answered at once from ``step_outputs``: the host
    work alone (feed checks, bucket choice, padding, device layout, dtype casts of the outputs, slicing),
    free of the engine's run-to-run noise. The stub is an instance attribute, removed afterwards."""
    rng = np.random.default_rng(1)
    input_ids = rng.integers(1000, 30000, (OVERHEAD_BATCH, OVERHEAD_TOKENS), dtype=np.int64)
    feed = {
        "input_ids": input_ids,
        "attention_mask": np.ones_like(input_ids),
        "token_type_ids": np.zeros_like(input_ids),
    }
    table.run_step = lambda shapes, branches, step_feed: step_outputs
    try:
        times = [_timed(lambda: session.run(["last_hidden_state"], feed))[0] for _ in range(calls)]
    finally:
        del table.run_step
    return statistics.median(times) * 1e3


def print_overhead(report: dict[str, Any]) -> None:
    overhead = report["session_ms"] / report["direct_ms"] - 1
    paired = report["paired_ms"] / report["direct_ms"]
    print(
        f"### c. Per-call overhead of bucket selection, padding and slicing\n\nBERT-base size (12 layers, "
        f"hidden 768, random weights), batch {OVERHEAD_BATCH}, {OVERHEAD_TOKENS} tokens padded to "
        f"{report['padded_length']}; {report['calls']} calls of each, interleaved call by call; "
        f"{report['executables']} executable served all {report['executable_calls']} runs; the direct "
        f"run's real part equals the session's output (max |difference| {report['max_difference']:.1e}).\n"
    )
    print("| path | median ms |")
    print("|---|---:|")
    print(
        f"| `session.run` (validate, bucket, pad, device layout, run, slice) | {report['session_ms']:.1f} |"
    )
    print(
        "| the same executable on an already padded `[1, 1, 8, 128]` feed (`run_step`) "
        f"| {report['direct_ms']:.1f} |"
    )
    host = report["host_ms"] / report["direct_ms"]
    print(
        "| host work of `session.run` alone (device step stubbed to return at once, median of "
        f"{max(100, report['calls'])}) | {report['host_ms']:.2f} |"
    )
    print(
        f"\nOverhead (target <= 2% of the engine's run time): {100 * host:.3f}% from the host work alone; "
        f"{100 * overhead:+.2f}% from the two end-to-end medians and {100 * paired:+.2f}% from the median of "
        "the paired differences, which carry the engine's run-to-run noise.\n"
    )


# ----------------------------------------------------------------------------------------------------------
# d. GPT-2 generation
# ----------------------------------------------------------------------------------------------------------


def export_small_gpt2(workdir: Path) -> Path:
    import torch
    import transformers
    from optimum.exporters.onnx import main_export

    onnx_dir = workdir / "gpt2-onnx"
    if (onnx_dir / "model.onnx").is_file():
        return onnx_dir
    torch.manual_seed(0)
    model_dir = workdir / "gpt2-small"
    config = transformers.GPT2Config(
        vocab_size=1000,
        n_positions=256,
        n_embd=256,
        n_layer=4,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        # At the default 0.02 greedy decoding of a random GPT-2 repeats one or two tokens.
        initializer_range=0.3,
    )
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(model_dir)
    with quiet_exports():
        main_export(
            str(model_dir),
            output=onnx_dir,
            task="text-generation-with-past",
            do_validation=False,
            local_files_only=True,
            library_name="transformers",
        )
    return onnx_dir


def _shape_summary(shapes: Mapping[str, Sequence[int]]) -> str:
    past = next((shape for name, shape in shapes.items() if name.startswith("past_key_values")), None)
    parts = [f"input_ids {list(shapes['input_ids'])}"]
    if past is not None:
        parts.append(f"past {list(past)}")
    if "attention_mask" in shapes:
        parts.append(f"attention_mask {list(shapes['attention_mask'])}")
    return ", ".join(parts)


def gpt2_generation(workdir: Path, repeats: int) -> dict[str, Any]:
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM

    onnx_dir = export_small_gpt2(workdir)
    cpu = ORTModelForCausalLM.from_pretrained(onnx_dir, provider="CPUExecutionProvider")
    ipu = ORTModelForCausalLM.from_pretrained(
        onnx_dir,
        provider="ipu",
        provider_options={
            "device": "emulator",
            "executable_cache_dir": str(fresh_dir(workdir, "gpt2-cache-")),
        },
    )
    prompt = torch.from_numpy(np.random.default_rng(0).integers(1, 1000, (1, PROMPT_TOKENS), dtype=np.int64))
    settings = {
        "input_ids": prompt,
        "attention_mask": torch.ones_like(prompt),
        "max_new_tokens": NEW_TOKENS,
        "min_new_tokens": NEW_TOKENS,
        "do_sample": False,
        "num_beams": 1,
    }
    first_seconds, on_ipu = _timed(lambda: ipu.generate(**settings))
    executables = [
        {**entry, "summary": _shape_summary(entry["shapes"])} for entry in ipu.session.compiled_executables()
    ]
    cpu_seconds, on_cpu = _timed(lambda: cpu.generate(**settings))
    warm_ipu, warm_cpu = [], []
    for repeat in range(repeats):
        pair = [(warm_ipu, ipu), (warm_cpu, cpu)]
        for times, model in pair if repeat % 2 == 0 else reversed(pair):
            times.append(_timed(lambda model=model: model.generate(**settings))[0])
    return {
        "identical": bool(torch.equal(on_ipu, on_cpu)),
        "ipu_tokens": on_ipu[0, PROMPT_TOKENS:].tolist(),
        "cpu_tokens": on_cpu[0, PROMPT_TOKENS:].tolist(),
        "bucket_sizes": ipu.session.bucket_sizes(),
        "executables": executables,
        "first_ipu_seconds": first_seconds,
        "first_cpu_seconds": cpu_seconds,
        "warm_ipu_seconds": statistics.median(warm_ipu),
        "warm_cpu_seconds": statistics.median(warm_cpu),
        "repeats": repeats,
    }


def print_generation(report: dict[str, Any]) -> None:
    print(
        f"### d. {NEW_TOKENS}-token greedy generation, small random GPT-2\n\n"
        "GPT-2 with 4 layers, n_embd 256, "
        f"vocabulary 1000, n_positions 256 and random weights; batch 1, {PROMPT_TOKENS}-token prompt; "
        "`ORTModelForCausalLM` on optimum-onnx's text-generation-with-past export; a fresh executable cache. "
        f"Compiled sizes: {report['bucket_sizes']}.\n"
    )
    print(f"Tokens identical to CPUExecutionProvider: **{report['identical']}**\n")
    print(f"- ipu: {report['ipu_tokens']}")
    print(f"- cpu: {report['cpu_tokens']}\n")
    with_branches = any(entry["branches"] for entry in report["executables"])
    print(
        f"| executable (compiled shapes) |{' branch |' if with_branches else ''} source | compile s | calls |"
    )
    print(f"|---|{'---|' if with_branches else ''}---|---:|---:|")
    for entry in report["executables"]:
        branches = ", ".join(f"{name}={value}" for name, value in entry["branches"].items()) or "-"
        print(
            f"| {entry['summary']} |{f' {branches} |' if with_branches else ''} {entry['source']} "
            f"| {entry['compile_seconds']:.1f} | {entry['calls']} |"
        )
    print(
        f"\n{len(report['executables'])} executables for {NEW_TOKENS} new tokens "
        "(calls counted over the first generate()).\n\n"
        "| generate() wall time | ipu (emulator) s | CPUExecutionProvider s |\n|---|---:|---:|\n"
        f"| first call (ipu: compiles into an empty cache) | {report['first_ipu_seconds']:.2f} "
        f"| {report['first_cpu_seconds']:.2f} |\n"
        f"| later calls, median of {report['repeats']}, interleaved | {report['warm_ipu_seconds']:.2f} "
        f"| {report['warm_cpu_seconds']:.2f} |\n"
    )


# ----------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------


def describe_machine() -> str:
    import onnxruntime

    return (
        f"{os.cpu_count()} CPU cores ({platform.machine()}), Python {platform.python_version()}, onnxruntime "
        f"{onnxruntime.__version__}; no IPU: every ipu figure is host emulation (device 'emulator'), not an "
        "IPU measurement"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sections", default="abcd", help="which sections to run (letters a-d)")
    parser.add_argument(
        "--paragraphs",
        type=int,
        default=2000,
        help="fixed random subset of paragraphs for section a (0: all of them)",
    )
    parser.add_argument("--batch", type=int, default=8, help="paragraphs per call in section a")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--load-runs", type=int, default=5, help="fresh processes per kind in section b")
    parser.add_argument("--calls", type=int, default=30, help="calls of each path in section c")
    parser.add_argument("--repeats", type=int, default=3, help="warm generate() calls in section d")
    parser.add_argument("--workdir", type=Path, help="keep exports and caches here (default: a temp dir)")
    parser.add_argument("--child-load", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_load:
        child_load(*args.child_load)
        return 0

    print(f"`python {' '.join([os.path.relpath(__file__), *sys.argv[1:]])}`\n")
    print(f"{describe_machine()}.\n")
    with tempfile.TemporaryDirectory(prefix="bench-runtime-") as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        if "a" in args.sections or "b" in args.sections:
            onnx_dir = export_minilm(workdir)
        if "a" in args.sections:
            print_padding(padding_efficiency(workdir, onnx_dir, args.paragraphs, args.batch, args.seed))
        if "b" in args.sections:
            print_load(load_times(workdir, onnx_dir, args.load_runs))
        if "c" in args.sections:
            print_overhead(per_call_overhead(workdir, args.calls))
        if "d" in args.sections:
            print_generation(gpt2_generation(workdir, args.repeats))
        print(f"Total wall time {time.perf_counter() - started:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
