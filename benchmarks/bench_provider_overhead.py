"""What the ipu provider adds: interpreter start-up, `import optimum.onnxruntime`, and per call.

    python benchmarks/bench_provider_overhead.py [--runs 21] [--calls 30]

* start-up: ``-X importtime`` attribution of the ``.pth`` bootstrap in ``python -c pass`` (median over
  fresh interpreters), and the wall time of ``python -c pass`` with the plugin active against
  ``OPTIMUM_PROVIDER_PLUGINS=0`` (which skips installing the hook);
* import: wall time of ``import optimum.onnxruntime`` plus loading ``ORTModelForSequenceClassification``
  (which loads and patches utils, base and modeling), plugin active against plugins off, interleaved;
* per call: a BERT-base-sized model (12 layers, hidden 768, random weights) at batch 8, sequence 128:
  ``IPUInferenceSession.run`` on the host emulator against a raw onnxruntime CPU session on the same
  legalized graph, interleaved call by call; and the session's feed checks alone (index ranges
  included), timed on their own.
Prints a markdown table; numbers go to docs/performance.md with this command.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPTIMUM_PROVIDER", "OPTIMUM_IPU"))}
    env.update(extra)
    return env


def _wall(args: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(args, env=env, check=True, capture_output=True)
    return time.perf_counter() - started


def _importtime_lines(code: str) -> list[tuple[int, int, str]]:
    """(cumulative us, indentation, module) for each line of ``-X importtime``."""
    err = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        env=_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    lines = []
    for line in err.splitlines():
        match = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if match:
            lines.append((int(match.group(2)), len(match.group(3)), match.group(4)))
    return lines


OUR_MODULES = ("optimum_ipu_backend", "_optimum_ipu_backend_bootstrap")


def plugin_importtime_us(code: str, runs: int) -> float:
    """Median over fresh interpreters of the import time of this package's modules while running
    ``code``: the cumulative time of each outermost module of ours (its children included)."""
    samples = []
    for _ in range(runs):
        total, ours_depth = 0, None
        # importtime prints children before their parent; walking backwards meets parents first
        for cumulative, depth, module in reversed(_importtime_lines(code)):
            if ours_depth is not None and depth <= ours_depth:
                ours_depth = None
            if ours_depth is None and module.split(".")[0] in OUR_MODULES:
                total += cumulative
                ours_depth = depth
        samples.append(total)
    return statistics.median(samples)


def interleaved(args: list[str], runs: int) -> tuple[float, float]:
    on, off = [], []
    for _ in range(runs):
        on.append(_wall(args, _env()))
        off.append(_wall(args, _env(OPTIMUM_PROVIDER_PLUGINS="0")))
    return statistics.median(on), statistics.median(off)


def export_bert_base(workdir: Path) -> str:
    """A BERT-base-sized model (random weights) exported for feature extraction; returns model.onnx."""
    import torch
    import transformers
    from optimum.exporters.onnx import main_export

    torch.manual_seed(0)
    config = transformers.BertConfig(
        num_hidden_layers=12,
        hidden_size=768,
        num_attention_heads=12,
        intermediate_size=3072,
        vocab_size=30522,
    )
    model_dir, onnx_dir = workdir / "bert-base", workdir / "bert-base-onnx"
    transformers.BertModel(config).eval().save_pretrained(model_dir)
    main_export(
        str(model_dir),
        output=onnx_dir,
        task="feature-extraction",
        do_validation=False,
        library_name="transformers",
        no_post_process=True,
    )
    return str(onnx_dir / "model.onnx")


def bert_base_feed(batch: int = 8, seq: int = 128) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    return {
        "input_ids": rng.integers(0, 30522, (batch, seq), dtype=np.int64),
        "attention_mask": np.ones((batch, seq), np.int64),
        "token_type_ids": np.zeros((batch, seq), np.int64),
    }


def per_call(calls: int, workdir: Path) -> dict[str, float]:
    import numpy as np
    import onnx
    import onnxruntime as ort

    from optimum_ipu_backend.compiler import legalize
    from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions
    from optimum_ipu_backend.session import IPUInferenceSession

    path = export_bert_base(workdir)
    feed = bert_base_feed()
    session = IPUInferenceSession(path, options=IPUProviderOptions.parse({"device": "emulator"}))
    session.run(None, feed)  # compile
    legalized = legalize(onnx.load(path), {k: v.shape for k, v in feed.items()})
    raw = ort.InferenceSession(legalized.model.SerializeToString(), providers=["CPUExecutionProvider"])
    raw_feed = {i.name: feed[i.name].astype(np.int32) for i in raw.get_inputs()}
    raw.run(None, raw_feed)
    ipu_times, raw_times = [], []
    for _ in range(calls):
        started = time.perf_counter()
        raw.run(None, raw_feed)
        raw_times.append(time.perf_counter() - started)
        started = time.perf_counter()
        session.run(None, feed)
        ipu_times.append(time.perf_counter() - started)
    # the feed checks alone (names, dtypes, shapes, masks, index ranges), the part of session.run that
    # validates before anything reaches the runtime
    check_times = []
    for _ in range(200):
        started = time.perf_counter()
        session._validate_feed(feed)
        check_times.append(time.perf_counter() - started)
    return {
        "raw_ms": statistics.median(raw_times) * 1e3,
        "ipu_ms": statistics.median(ipu_times) * 1e3,
        "checks_us": statistics.median(check_times) * 1e6,
        "checked_inputs": ", ".join(session._validate_feed.index_checked_inputs),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()

    boot_us = plugin_importtime_us("pass", args.runs)
    start_on, start_off = interleaved([sys.executable, "-c", "pass"], args.runs)
    import_code = "import optimum.onnxruntime as o; o.ORTModelForSequenceClassification"
    import_on, import_off = interleaved([sys.executable, "-c", import_code], max(5, args.runs // 3))
    import_us = plugin_importtime_us(import_code, max(5, args.runs // 3))
    with tempfile.TemporaryDirectory() as tmp:
        calls = per_call(args.calls, Path(tmp))
    overhead = calls["ipu_ms"] / calls["raw_ms"] - 1
    print("| measure | plugin | baseline | added | target |")
    print("|---|---|---|---|---|")
    print(
        f"| `.pth` bootstrap in `python -c pass` (-X importtime, cumulative) | {boot_us / 1e3:.2f} ms | - "
        f"| {boot_us / 1e3:.2f} ms | <= 1 ms |"
    )
    print(
        f"| `python -c pass` wall, plugins on vs `OPTIMUM_PROVIDER_PLUGINS=0` | {start_on * 1e3:.1f} ms "
        f"| {start_off * 1e3:.1f} ms | {(start_on - start_off) * 1e3:+.1f} ms "
        "(the hook only; both import it) | - |"
    )
    print(
        "| `import optimum.onnxruntime` + ORTModel class: this package's modules (-X importtime, cumulative) "
        f"| {import_us / 1e3:.2f} ms | - | {import_us / 1e3:.2f} ms | <= 5 ms |"
    )
    print(
        "| `import optimum.onnxruntime` + ORTModel class, wall, plugins on vs off "
        f"| {import_on * 1e3:.0f} ms | {import_off * 1e3:.0f} ms "
        f"| {(import_on - import_off) * 1e3:+.1f} ms (noise of the whole import) | - |"
    )
    print(
        "| BERT-base b8 s128 per call: ipu session (emulator) vs raw ORT on the same graph "
        f"| {calls['ipu_ms']:.1f} ms "
        f"| {calls['raw_ms']:.1f} ms | {overhead * 100:+.2f}% | <= 2% |"
    )
    print(
        "| BERT-base b8 s128 per call: feed checks alone (names, dtypes, shapes, masks, index ranges of "
        f"{calls['checked_inputs']}; median of 200) | {calls['checks_us']:.0f} us | {calls['raw_ms']:.1f} ms "
        f"| {calls['checks_us'] / 1e3 / calls['raw_ms'] * 100:+.4f}% | - |"
    )
    print(
        f"\nmedians; runs={args.runs}, calls={args.calls}; "
        "command: python benchmarks/bench_provider_overhead.py"
    )


if __name__ == "__main__":
    main()
