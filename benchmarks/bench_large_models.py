"""Large models on the ipu provider: legalization time and peak memory, cold and warm load, and what one
more compiled shape adds to the executable cache, per model size.

Models are built locally with random weights from configs of the sizes of BERT-base (~110M
parameters), BERT-large (~340M) and GPT-2 large (~774M), and exported with optimum-onnx
(``feature-extraction``, no past); the GPT-2 large export is over 2 GiB, so the exporter writes it
with external data. Every measurement runs in a fresh process, whose peak resident set size
(``ru_maxrss``) is reported beside a baseline (the same process after its imports, before touching the
model; its current RSS, not its peak, as imports may peak and free), so the difference is what the
model cost:

* legalize: ``load_graph`` + ``legalize`` for batch 1 x 128 tokens + ``save_graph`` (the graph and
  its data file written as the cache writes them);
* cold load: a session on the host emulator with an empty cache, to the first result (legalize,
  write the cache entry, create the onnxruntime session, run);
* warm load: the same in a new process with the cache the cold load left;
* one more shape: a call of 256 tokens in the warm process (a second bucket), and the bytes the cache
  grew by.

No IPU here: loads are host emulation, and say nothing of IPU compile or load times.

    python benchmarks/bench_large_models.py [--sizes 110m,340m,770m] [--work DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {
    # name: (model type, config)
    "110m": (
        "bert",
        {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072},
    ),
    "340m": (
        "bert",
        {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096},
    ),
    "770m": ("gpt2", {"n_embd": 1280, "n_layer": 36, "n_head": 20}),
}
SEQUENCE = 128
SECOND_SEQUENCE = 256


def _status_bytes(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as stream:
        for line in stream:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_rss() -> int:
    """This process's peak resident set (VmHWM). Not ``ru_maxrss``: Linux keeps that across ``exec``, so
    a child would start from its parent's peak."""
    return _status_bytes("VmHWM")


def _current_rss() -> int:
    """Resident bytes now (the baseline: imports may have peaked higher and freed it again)."""
    return _status_bytes("VmRSS")


def _emit(result: dict) -> None:
    print("RESULT " + json.dumps(result), flush=True)


# -- children ------------------------------------------------------------------------------------------


def child_build(size: str, out: Path) -> None:
    import torch
    import transformers
    from optimum.exporters.onnx import main_export

    kind, config = SIZES[size]
    model_dir = out.parent / f"{out.name}-checkpoint"
    torch.manual_seed(0)
    if kind == "bert":
        model = transformers.BertModel(transformers.BertConfig(vocab_size=30522, **config))
    else:
        model = transformers.GPT2Model(transformers.GPT2Config(vocab_size=50257, n_positions=1024, **config))
    parameters = sum(p.numel() for p in model.parameters())
    model.eval().save_pretrained(model_dir)
    del model
    started = time.perf_counter()
    main_export(
        model_name_or_path=str(model_dir),
        output=out,
        task="feature-extraction",
        do_validation=False,
        local_files_only=True,
        library_name="transformers",
        no_post_process=True,
    )
    shutil.rmtree(model_dir)
    files = sorted(p.name for p in out.iterdir())
    _emit({"parameters": parameters, "export_seconds": time.perf_counter() - started, "files": files})


def _shapes(model) -> dict[str, tuple[int, ...]]:
    return {value.name: (1, SEQUENCE) for value in model.graph.input}


def child_legalize(onnx_dir: Path, out: Path) -> None:
    from optimum_ipu_backend.compiler.external_data import load_graph, save_graph
    from optimum_ipu_backend.compiler.pipeline import legalize

    baseline = _current_rss()
    started = time.perf_counter()
    model = load_graph(onnx_dir / "model.onnx")
    legalized = legalize(model, _shapes(model), weights_dir=onnx_dir)
    save_graph(legalized.model, out / "legalized.onnx", legalized.weights_dir, legalized.weight_names)
    _emit({"seconds": time.perf_counter() - started, "peak_rss": _peak_rss(), "baseline_rss": baseline})


def child_load(onnx_dir: Path, cache: Path, second_shape: bool) -> None:
    import numpy as np

    from optimum_ipu_backend.runtime.executable_cache import ExecutableCache
    from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions
    from optimum_ipu_backend.session import IPUInferenceSession

    baseline = _current_rss()
    options = {
        "device": "emulator",
        "executable_cache_dir": str(cache),
        "sequence_lengths": f"{SEQUENCE},{SECOND_SEQUENCE}",
        "batch_size": "1",
    }
    started = time.perf_counter()
    session = IPUInferenceSession(
        str(onnx_dir / "model.onnx"), options=IPUProviderOptions.parse(options, onnx_dir)
    )
    names = [spec.name for spec in session.get_inputs()]

    def feed(length: int) -> dict:
        return {name: np.ones((1, length), np.int64) for name in names}

    session.run(None, feed(SEQUENCE - 28))
    result = {"seconds": time.perf_counter() - started, "peak_rss": _peak_rss(), "baseline_rss": baseline}
    if second_shape:
        before = ExecutableCache(cache).info()["total_bytes"]
        started = time.perf_counter()
        session.run(None, feed(SECOND_SEQUENCE - 56))
        result["second_shape_seconds"] = time.perf_counter() - started
        result["second_shape_cache_bytes"] = ExecutableCache(cache).info()["total_bytes"] - before
    result["cache_bytes"] = ExecutableCache(cache).info()["total_bytes"]
    _emit(result)


# -- the controller ------------------------------------------------------------------------------------


def _run_child(*args: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OPTIMUM_IPU_PROGRESS": "0"}
    done = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"child {args} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def _weights_bytes(onnx_dir: Path) -> int:
    from optimum_ipu_backend.compiler.external_data import load_graph
    from optimum_ipu_backend.compiler.graphs import tensor_bytes

    model = load_graph(onnx_dir / "model.onnx")  # weights left in their files
    return sum(tensor_bytes(tensor) for tensor in model.graph.initializer)


def measure(size: str, work: Path) -> dict:
    onnx_dir = work / size
    if not (onnx_dir / "model.onnx").is_file():
        shutil.rmtree(onnx_dir, ignore_errors=True)
        built = _run_child("build", size, str(onnx_dir))
    else:
        built = {"parameters": None, "export_seconds": None}
    weights = _weights_bytes(onnx_dir)
    external = any(name != "model.onnx" and "onnx" in name for name in os.listdir(onnx_dir))
    scratch = Path(tempfile.mkdtemp(prefix=f"legalized-{size}-", dir=work))
    try:
        legalized = _run_child("legalize", str(onnx_dir), str(scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    cache = work / f"cache-{size}"
    shutil.rmtree(cache, ignore_errors=True)
    cold = _run_child("load", str(onnx_dir), str(cache), "0")
    warm = _run_child("load", str(onnx_dir), str(cache), "1")
    shutil.rmtree(cache, ignore_errors=True)
    return {
        "size": size,
        "parameters": built.get("parameters"),
        "weights_bytes": weights,
        "external_data": external,
        "legalize_seconds": legalized["seconds"],
        "legalize_peak_rss": legalized["peak_rss"],
        "legalize_rss_over_baseline": legalized["peak_rss"] - legalized["baseline_rss"],
        "cold_load_seconds": cold["seconds"],
        "cold_load_rss_over_baseline": cold["peak_rss"] - cold["baseline_rss"],
        "warm_load_seconds": warm["seconds"],
        "warm_load_rss_over_baseline": warm["peak_rss"] - warm["baseline_rss"],
        "cache_bytes_one_shape": cold["cache_bytes"],
        "cache_bytes_per_added_shape": warm["second_shape_cache_bytes"],
    }


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--work", type=Path, help="keep the exports here between runs (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "build":
            child_build(rest[0], Path(rest[1]))
        elif kind == "legalize":
            child_legalize(Path(rest[0]), Path(rest[1]))
        else:
            child_load(Path(rest[0]), Path(rest[1]), rest[2] == "1")
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-large-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"{os.cpu_count()} CPU cores ({platform.machine()}), Python {platform.python_version()}")
    print("no IPU: loads are host emulation (device 'emulator'); RSS is over each process's baseline")
    rows = []
    for size in args.sizes.split(","):
        row = measure(size, work)
        rows.append(row)
        weights = row["weights_bytes"]
        print(
            f"{size}: {row['parameters'] or '?'} parameters, weights {_gib(weights)}"
            f"{' (external data)' if row['external_data'] else ''}\n"
            f"  legalize {row['legalize_seconds']:.1f} s, "
            f"peak RSS +{_gib(row['legalize_rss_over_baseline'])} "
            f"({row['legalize_rss_over_baseline'] / weights:.2f}x weights)\n"
            f"  cold load {row['cold_load_seconds']:.1f} s (+{_gib(row['cold_load_rss_over_baseline'])}), "
            f"warm load {row['warm_load_seconds']:.1f} s (+{_gib(row['warm_load_rss_over_baseline'])})\n"
            f"  cache: {_gib(row['cache_bytes_one_shape'])} for one shape, "
            f"+{row['cache_bytes_per_added_shape'] / 2**20:.2f} MiB per added shape "
            f"({100 * row['cache_bytes_per_added_shape'] / weights:.3f}% of the weights)",
            flush=True,
        )
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
