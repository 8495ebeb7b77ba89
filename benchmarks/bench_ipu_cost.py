"""What compiles, loads, switches and padding cost on an IPU (issue 37), priced by the runtime's cost model.

    python benchmarks/bench_ipu_cost.py [--requests 120] [--ipus 1,4] [--prompts 12] [--new-tokens 8]

Sessions run on the PopART engine against the SDK test double (``tests/sdk_double``: the SDK's API, with
1 or 4 IPUs visible), whose residency is the worker's own: one loaded executable per IPU group, a
*switch* counted whenever another one runs there. Each workload runs through two policies:

* ``cost``: ``serving_plan="cost"`` with ``ipu_groups`` = the IPUs visible (``runtime.serving_plan``);
* ``graphcore``: optimum-graphcore's policy, one executable at the model's maximum length
  (``sequence_lengths`` = that length, the batch the calls bring), served the way this runtime serves.

Workloads, on bench_runtime's corpus (the Python standard library's docstring paragraphs tokenized for
all-MiniLM-L6-v2, at most 512 tokens), ``--requests`` paragraphs each:

* ``single calls, one thread``: one paragraph per call;
* ``calls of 8 padded to the longest``: 8 paragraphs per call, padded by the tokenizer;
* ``16 threads, dynamic batching and packing``: one paragraph per call from 16 client threads
  (``dynamic_batching="1"``; optimum-graphcore has no batcher, so its calls run one by one);
* ``GPT-2 generation``: a small random GPT-2 (bench_runtime's) generating ``--new-tokens`` tokens
  greedily from ``--prompts`` prompts of mixed lengths (4 to 120 tokens), through ``ORTModelForCausalLM``.

Every workload runs twice on one session: the first pass from an empty cache (cold), then, once the
background compiles are done, the second (the steady state). Counted per pass from
``compiled_executables()``: executables built (compiles a call waited for, compiles in the background,
loads), switches, computed positions (each executable's ``input_ids`` shape x its runs) and real tokens.
Priced with ``runtime.cost_model.CostModel`` (120 s per compile a call waits for, 2 s per load or switch,
0.5 us per computed position): modeled device time per call in the steady state, and modeled cold time
(compiles waited for + loads + switches + compute) of the first pass. A third process-like pass opens a
new session on the filled cache and reports its compiles (the plan kept in the cache). The second pass's
outputs are compared with CPU onnxruntime (real positions; generated tokens exactly).

Nothing here is an IPU measurement: the double runs graphs with onnxruntime; what the figures count
(executables, switches, positions) is the runtime's own behaviour, priced by the model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["OPTIMUM_IPU_PROGRESS"] = "0"

BENCHMARKS_DIR = Path(__file__).resolve().parent
REPO = BENCHMARKS_DIR.parent
if str(BENCHMARKS_DIR) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS_DIR))

import bench_runtime  # noqa: E402

DOUBLE_DIR = REPO / "tests" / "sdk_double"
OUTPUT = "last_hidden_state"
ATOL = 1e-4
WORKLOADS = ("single calls, one thread", "calls of 8 padded to the longest", "16 threads, dynamic batching")
GENERATION = "GPT-2 generation, mixed prompts"
POLICIES = ("cost", "graphcore")


def use_double(directory: Path, ipus: int) -> None:
    """This process and the SDK worker it starts see the double with ``ipus`` IPUs."""
    from optimum_ipu_backend.engines.worker import shutdown_workers

    shutdown_workers()  # a worker started for another IPU count lists its own IPUs
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "double-config.json"
    # an IPU computes beside the host; the double computes on this machine's CPU, with one thread, so
    # that the callers' own threads keep a core as they would beside an IPU
    config.write_text(json.dumps({"ipus": ipus, "compute_threads": 1}))
    os.environ.update(
        {
            "PYTHONPATH": str(DOUBLE_DIR),
            "POPLAR_SDK_ENABLED": str(DOUBLE_DIR),
            "POPART_DOUBLE_CONFIG": str(config),
            "OPTIMUM_IPU_WORKER_IDLE_SECONDS": "0",
        }
    )
    if str(DOUBLE_DIR) not in sys.path:
        sys.path.insert(0, str(DOUBLE_DIR))


def policy_options(
    policy: str, ipus: int, max_length: int, batch: int, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    if policy == "cost":
        # the double's compile times are not an IPU's: the model's estimates price this run
        return {"serving_plan": "cost", "ipu_groups": str(ipus), "cost_measured": "0", **(extra or {})}
    return {"sequence_lengths": str(max_length), "batch_size": str(batch)}


# -- counters --------------------------------------------------------------------------------------------


def snapshot(entries: Sequence[Mapping[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """Each executable built so far (released ones included, in order), by a key stable across calls."""
    seen: dict[tuple, int] = {}
    result = {}
    for entry in entries:
        shape = (bool(entry.get("packed")), json.dumps(entry["shapes"], sort_keys=True, default=list))
        seen[shape] = seen.get(shape, 0) + 1
        result[(*shape, seen[shape])] = entry
    return result


def positions(entry: Mapping[str, Any]) -> int:
    return math.prod(entry["shapes"]["input_ids"])


def counted(before: Mapping[tuple, Mapping], after: Mapping[tuple, Mapping]) -> dict[str, int]:
    """What happened between two snapshots of ``compiled_executables()``."""
    new = [entry for key, entry in after.items() if key not in before]
    result = {
        "waited_compiles": sum(e["source"] == "compiled" and not e["background"] for e in new),
        "background_compiles": sum(e["source"] == "compiled" and e["background"] for e in new),
        "cache_loads": sum(e["source"] == "cache" for e in new),
        "loads": len(new),
        "switches": 0,
        "computed": 0,
        "runs": 0,
    }
    for key, entry in after.items():
        old = before.get(key, {"switches": 0, "calls": 0})
        result["switches"] += int(entry["switches"]) - int(old["switches"])
        result["computed"] += (int(entry["calls"]) - int(old["calls"])) * positions(entry)
        result["runs"] += int(entry["calls"]) - int(old["calls"])
    return result


# -- the encoder workloads -------------------------------------------------------------------------------


def encoder_workloads(token_ids: Sequence[list[int]], requests: int, seed: int, tokenizer: Any) -> dict:
    rng = np.random.default_rng(seed)
    chosen = [token_ids[i] for i in rng.permutation(len(token_ids))[:requests]]
    single = [
        {
            "input_ids": np.asarray([ids], dtype=np.int64),
            "attention_mask": np.ones((1, len(ids)), dtype=np.int64),
            "token_type_ids": np.zeros((1, len(ids)), dtype=np.int64),
        }
        for ids in chosen
    ]
    batches = []
    for start in range(0, len(chosen) - 7, 8):
        padded = tokenizer.pad({"input_ids": chosen[start : start + 8]}, return_tensors="np")
        feed = {name: np.asarray(value, dtype=np.int64) for name, value in padded.items()}
        feed.setdefault("token_type_ids", np.zeros_like(feed["input_ids"]))
        batches.append(feed)
    return {WORKLOADS[0]: (single, 1), WORKLOADS[1]: (batches, 1), WORKLOADS[2]: (single, 16)}


def run_clients(session: Any, calls: Sequence[Mapping[str, np.ndarray]], threads: int) -> list[Any]:
    results: list[Any] = [None] * len(calls)
    cursor = iter(range(len(calls)))
    lock = threading.Lock()
    failures: list[BaseException] = []

    def client() -> None:
        while True:
            with lock:
                index = next(cursor, None)
            if index is None:
                return
            try:
                results[index] = session.run([OUTPUT], calls[index])[0]
            except Exception as exc:  # reported, never hidden
                failures.append(exc)
                return

    workers = [threading.Thread(target=client) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if failures:
        raise failures[0]
    return results


def equal_to_cpu(cpu: Any, calls: Sequence[Mapping[str, np.ndarray]], results: Sequence[np.ndarray]) -> bool:
    for feed, got in zip(calls, results, strict=True):
        (want,) = cpu.run([OUTPUT], dict(feed))
        real = feed["attention_mask"].astype(bool)
        if got.shape != want.shape or not np.allclose(got[real], want[real], atol=ATOL, rtol=0):
            return False
    return True


def encoder_run(
    onnx_dir: Path, cache: Path, options: Mapping[str, str], calls: Sequence, threads: int, cpu: Any
) -> dict[str, Any]:
    extra = {"dynamic_batching": "1"} if threads > 1 else {}
    session = bench_runtime.ipu_session(onnx_dir, cache, device="ipu", engine="popart", **options, **extra)
    real = sum(int(call["attention_mask"].sum()) for call in calls)
    try:
        passes = []
        for index in range(2):
            before = snapshot(session.compiled_executables())
            results = run_clients(session, calls, threads)
            assert session.wait_for_compiles(3600)
            after = snapshot(session.compiled_executables())
            passes.append({**counted(before, after), "real": real, "calls": len(calls)})
            if index == 1:
                passes[-1]["equal_to_cpu"] = equal_to_cpu(cpu, calls, results)
        executables = len(session.compiled_executables())
        resident = sum(not entry.get("released") for entry in session.compiled_executables())
    finally:
        session.close()
    again = bench_runtime.ipu_session(onnx_dir, cache, device="ipu", engine="popart", **options, **extra)
    try:
        run_clients(again, calls, threads)
        restarted = counted({}, snapshot(again.compiled_executables()))
    finally:
        again.close()
    return {"passes": passes, "executables": executables, "resident": resident, "restarted": restarted}


# -- generation ------------------------------------------------------------------------------------------


def generation_run(
    onnx_dir: Path, cache: Path, options: Mapping[str, str], prompts: Sequence[np.ndarray], new_tokens: int
) -> dict[str, Any]:
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM

    cpu = ORTModelForCausalLM.from_pretrained(onnx_dir, provider="CPUExecutionProvider")

    def load() -> Any:
        return ORTModelForCausalLM.from_pretrained(
            onnx_dir,
            provider="ipu",
            provider_options={
                "device": "ipu",
                "engine": "popart",
                "executable_cache_dir": str(cache),
                "progress": "0",
                **options,
            },
        )

    def generate(model: Any) -> list[Any]:
        outputs = []
        for prompt in prompts:
            ids = torch.from_numpy(prompt[None, :])
            settings = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
            outputs.append(model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **settings))
        return outputs

    model = load()
    real = sum(len(prompt) + new_tokens - 1 for prompt in prompts)  # each position computed once
    try:
        passes = []
        for index in range(2):
            before = snapshot(model.session.compiled_executables())
            outputs = generate(model)
            assert model.session.wait_for_compiles(3600)
            after = snapshot(model.session.compiled_executables())
            passes.append({**counted(before, after), "real": real, "calls": len(prompts)})
            if index == 1:
                reference = generate(cpu)
                passes[-1]["equal_to_cpu"] = all(
                    bool(torch.equal(a, b)) for a, b in zip(outputs, reference, strict=True)
                )
        executables = len(model.session.compiled_executables())
        resident = sum(not entry.get("released") for entry in model.session.compiled_executables())
    finally:
        model.session.close()
    again = load()
    try:
        generate(again)
        restarted = counted({}, snapshot(again.session.compiled_executables()))
    finally:
        again.session.close()
    return {"passes": passes, "executables": executables, "resident": resident, "restarted": restarted}


# -- the run ---------------------------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    import onnxruntime as ort
    from transformers import AutoTokenizer

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-ipu-cost-"))
    onnx_dir = bench_runtime.export_minilm(workdir)
    gpt2_dir = bench_runtime.export_small_gpt2(workdir)
    tokenizer = AutoTokenizer.from_pretrained(bench_runtime.bench_padding().minilm_dir())
    tokenizer.model_max_length = 10**9
    paragraphs = bench_runtime.load_paragraphs()
    token_ids = [ids for ids in tokenizer(paragraphs)["input_ids"] if len(ids) <= 512]
    workloads = encoder_workloads(token_ids, args.requests, args.seed, tokenizer)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(1, 1000, int(n), dtype=np.int64) for n in rng.integers(4, 121, args.prompts)]
    cpu = ort.InferenceSession(str(onnx_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    rows = []
    for ipus in args.ipus:
        use_double(workdir / f"double-{ipus}", ipus)
        for workload, (calls, threads) in workloads.items():
            if args.only and args.only not in workload:
                continue
            batch = 8 if workload == WORKLOADS[1] else 1
            for policy in POLICIES:  # interleaved: each workload through both policies in turn
                cache = bench_runtime.fresh_dir(workdir, "cache-")
                options = policy_options(policy, ipus, 512, batch, args.option)
                result = encoder_run(onnx_dir, cache, options, calls, threads if policy == "cost" else 1, cpu)
                rows.append({"ipus": ipus, "workload": workload, "policy": policy, **result})
                print(f"# {ipus} IPU(s), {workload}, {policy}: {json.dumps(result)}", file=sys.stderr)
        for policy in POLICIES if not args.only or args.only in GENERATION else ():
            cache = bench_runtime.fresh_dir(workdir, "cache-")
            options = policy_options(policy, ipus, 256, 1, args.option)
            result = generation_run(gpt2_dir, cache, options, prompts, args.new_tokens)
            rows.append({"ipus": ipus, "workload": GENERATION, "policy": policy, **result})
            print(f"# {ipus} IPU(s), {GENERATION}, {policy}: {json.dumps(result)}", file=sys.stderr)
    return rows


def priced(row: Mapping[str, Any], model: Any) -> dict[str, float]:
    cold, steady = row["passes"]
    return {
        "steady_per_call": model.price(switches=steady["switches"], computed_tokens=steady["computed"])
        / steady["calls"],
        "cold": model.price(
            waited_compiles=cold["waited_compiles"],
            loads=cold["loads"],
            switches=cold["switches"],
            computed_tokens=cold["computed"],
        ),
    }


def ratio(value: float, reference: float) -> str:
    """``value`` as a multiple of ``reference``: two decimals, or two significant digits below 0.01."""
    share = value / reference
    return f"{share:.2f}x" if share >= 0.01 else f"{share:.1e}x"


def print_report(rows: Sequence[Mapping[str, Any]], args: argparse.Namespace) -> None:
    from optimum_ipu_backend.runtime.cost_model import CostModel

    model = CostModel()
    print(
        f"Cost model: {model.compile_seconds:g} s per compile a call waits for, {model.load_seconds:g} s "
        f"per load or switch, {model.token_seconds * 1e6:g} us per computed position.\n"
    )
    print(
        "| IPUs | workload | policy | executables built (resident) | compiles waited / background | "
        "switches per call, steady | real/computed, steady | modeled device time per call, steady "
        "(x policy) | modeled cold (x policy) | second process: compiles | equal to CPU |"
    )
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    key: Callable[[Mapping], tuple] = lambda row: (row["ipus"], row["workload"])  # noqa: E731
    reference = {key(row): priced(row, model) for row in rows if row["policy"] == "graphcore"}
    for row in rows:
        cold, steady = row["passes"]
        prices, base = priced(row, model), reference[key(row)]
        cells = [
            str(row["ipus"]),
            row["workload"],
            row["policy"],
            f"{row['executables']} ({row['resident']})" if "resident" in row else str(row["executables"]),
            f"{cold['waited_compiles'] + steady['waited_compiles']} / "
            f"{cold['background_compiles'] + steady['background_compiles']}",
            f"{steady['switches'] / steady['calls']:.2f}",
            f"{steady['real'] / steady['computed']:.3f}",
            f"{prices['steady_per_call'] * 1e3:.3f} ms "
            f"({ratio(prices['steady_per_call'], base['steady_per_call'])})",
            f"{prices['cold']:.0f} s ({prices['cold'] / base['cold']:.2f}x)",
            str(row["restarted"]["waited_compiles"] + row["restarted"]["background_compiles"]),
            "yes" if steady["equal_to_cpu"] else "**no**",
        ]
        print("| " + " | ".join(cells) + " |")


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=120, help="paragraphs per encoder workload")
    parser.add_argument("--ipus", type=lambda text: [int(x) for x in text.split(",")], default=[1, 4])
    parser.add_argument("--prompts", type=int, default=12, help="GPT-2 prompts (4 to 120 tokens)")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="keep the exports here between runs")
    parser.add_argument("--only", default="", help="run only the workloads whose name holds this text")
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        type=_key_value,
        metavar="KEY=VALUE",
        help="a provider option for the cost plan's sessions (repeatable), e.g. max_queue_delay_ms=10",
    )
    args = parser.parse_args(argv)
    args.option = dict(args.option)
    print_report(measure(args), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
