"""``optimum-ipu serve`` against the same ORTModel called in-process (issue 38), on the emulator.

    python benchmarks/bench_serve.py [--requests 160] [--clients 1,4,16] [--rounds 2] [--max-tokens 128]

The corpus is bench_runtime's: the Python standard library's docstring paragraphs, as texts, those of at
most ``--max-tokens`` MiniLM tokens. all-MiniLM-L6-v2's export is served two ways, both with
``dynamic_batching`` on and the package's default compiled sizes, sharing one executable cache:

* ``server``: ``optimum-ipu serve`` as its own process on a loopback port; each client is a thread with its
  own ``httpx.Client`` posting one text per ``/embed`` request and waiting for the answer;
* ``in-process``: the server's own ``ServedModel`` (the same ORTModel, tokenizer and pooling) in this
  process; each client is a thread calling ``embed`` with one text.

Every (clients, target) configuration runs once untimed (compiling what it needs), then ``--rounds``
times, interleaved. Reported per configuration: requests/s, p50/p99 latency per request, and real tokens
(the requests' tokens) per computed token (compiled ``input_ids`` shape x device steps), read from the
server's ``/metrics`` and, in-process, from the same sessions' counters; ratios are server/in-process at
the same client count. Every figure is host emulation, not an IPU measurement. Prints markdown for
docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["OPTIMUM_IPU_PROGRESS"] = "0"

BENCHMARKS_DIR = Path(__file__).resolve().parent
REPO = BENCHMARKS_DIR.parent
for path in (BENCHMARKS_DIR, REPO / "tests" / "server"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import bench_runtime  # noqa: E402


def tokenizer_dir() -> Path:
    """The packaged checkpoint: bench_runtime's export (``save_pretrained``) holds no tokenizer."""
    return Path(bench_runtime.bench_padding().minilm_dir())


def run_clients(call: Callable[[Any, str], None], make_client: Callable[[], Any], texts: Sequence[str],
                clients: int) -> dict[str, Any]:  # fmt: skip
    """``texts`` sent by ``clients`` threads, each taking the next text when its last call returned."""
    latencies: list[float] = []
    failures: list[BaseException] = []
    lock = threading.Lock()
    cursor = iter(range(len(texts)))

    def client() -> None:
        handle = make_client()
        try:
            while True:
                with lock:
                    index = next(cursor, None)
                if index is None:
                    return
                started = time.perf_counter()
                try:
                    call(handle, texts[index])
                except Exception as exc:  # reported, never hidden
                    failures.append(exc)
                    return
                with lock:
                    latencies.append(time.perf_counter() - started)
        finally:
            if hasattr(handle, "close"):
                handle.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return {"latencies": latencies, "seconds": time.perf_counter() - started}


class ServerTarget:
    name = "server"

    def __init__(self, onnx_dir: Path) -> None:
        import httpx
        from server_process import ServerProcess

        self._httpx = httpx
        self.process = ServerProcess(
            onnx_dir, "--pooling", "mean", "--tokenizer", str(tokenizer_dir()), ready_timeout=600
        ).wait_ready()

    def make_client(self) -> Any:
        return self._httpx.Client(base_url=self.process.url, timeout=600)

    @staticmethod
    def call(client: Any, text: str) -> None:
        response = client.post("/embed", json={"inputs": text})
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {response.text}")

    def counters(self) -> tuple[float, float, float]:
        """(real tokens, computed tokens, device steps) so far."""
        from server_process import metric

        page = self._httpx.get(f"{self.process.url}/metrics").text
        return (
            metric(page, "optimum_ipu_real_tokens_total"),
            metric(page, "optimum_ipu_computed_tokens_total"),
            metric(page, "optimum_ipu_device_steps_total"),
        )

    def close(self) -> None:
        self.process.stop()


class InProcessTarget:
    name = "in-process"

    def __init__(self, onnx_dir: Path) -> None:
        from optimum_ipu_backend.server.models import ServedModel, ServeOptions

        self.served = ServedModel(
            ServeOptions(
                model=str(onnx_dir),
                pooling="mean",
                tokenizer=str(tokenizer_dir()),
                provider_options={"device": "emulator"},
            )
        )
        self.real = 0
        self._lock = threading.Lock()

    def make_client(self) -> Any:
        return None  # the threads share the model

    def call(self, _: Any, text: str) -> None:
        rows = self.served.token_ids([text], "inputs")
        with self._lock:
            self.real += len(rows[0])
        self.served.embed(rows, normalize=True)

    def counters(self) -> tuple[float, float, float]:
        from optimum_ipu_backend.server.metrics import device_counters

        device = device_counters(self.served.sessions())
        return float(self.real), float(device["computed_tokens"]), float(device["device_steps"])

    def close(self) -> None:
        self.served.close()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-serve-"))
    os.environ["OPTIMUM_IPU_CACHE"] = str(bench_runtime.fresh_dir(workdir, "serve-cache-"))
    os.environ["OPTIMUM_IPU_DEVICE"] = "emulator"
    onnx_dir = bench_runtime.export_minilm(workdir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    paragraphs = bench_runtime.load_paragraphs()
    lengths = [len(ids) for ids in tokenizer(paragraphs)["input_ids"]]
    texts = [text for text, n in zip(paragraphs, lengths, strict=True) if n <= args.max_tokens]
    rng = np.random.default_rng(args.seed)
    texts = [texts[i] for i in rng.permutation(len(texts))[: args.requests]]
    targets = [InProcessTarget(onnx_dir), ServerTarget(onnx_dir)]
    configs = [(clients, target) for clients in args.clients for target in targets]
    results = {
        (clients, target.name): {"latencies": [], "seconds": 0.0, "real": 0.0, "computed": 0.0, "steps": 0.0}
        for clients, target in configs
    }
    try:
        for clients, target in configs:  # untimed: compiles what each configuration needs
            run_clients(target.call, target.make_client, texts, clients)
        for _ in range(args.rounds):
            for clients, target in configs:
                before = target.counters()
                run = run_clients(target.call, target.make_client, texts, clients)
                after = target.counters()
                result = results[(clients, target.name)]
                result["latencies"] += run["latencies"]
                result["seconds"] += run["seconds"]
                for index, name in enumerate(("real", "computed", "steps")):
                    result[name] += after[index] - before[index]
    finally:
        for target in targets:
            target.close()
    rows = []
    for (clients, name), result in results.items():
        latencies = np.asarray(result["latencies"]) * 1000
        count = len(result["latencies"])
        rows.append(
            {
                "clients": clients,
                "target": name,
                "requests_per_s": count / result["seconds"],
                "p50_ms": float(np.percentile(latencies, 50)),
                "p99_ms": float(np.percentile(latencies, 99)),
                "ratio": result["real"] / result["computed"],
                "steps_per_request": result["steps"] / count,
            }
        )
    return {"rows": rows, "requests": len(texts), "median_tokens": float(np.median(
        [n for n in lengths if n <= args.max_tokens]))}  # fmt: skip


def print_report(report: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"Machine: {bench_runtime.describe_machine()}.\n")
    print(
        f"{report['requests']} requests per configuration and round (median {report['median_tokens']:.0f} "
        f"tokens), {args.rounds} timed rounds, interleaved.\n"
    )
    print(
        "| clients | target | requests/s (x) | p50 ms (x) | p99 ms (x) | real/computed | "
        "device steps / request |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    base = {row["clients"]: row for row in report["rows"] if row["target"] == "in-process"}
    for row in report["rows"]:
        ref = base[row["clients"]]
        cells = [
            str(row["clients"]),
            row["target"],
            f"{row['requests_per_s']:.1f} ({row['requests_per_s'] / ref['requests_per_s']:.2f}x)",
            f"{row['p50_ms']:.1f} ({row['p50_ms'] / ref['p50_ms']:.2f}x)",
            f"{row['p99_ms']:.1f} ({row['p99_ms'] / ref['p99_ms']:.2f}x)",
            f"{row['ratio']:.3f}",
            f"{row['steps_per_request']:.3f}",
        ]
        print("| " + " | ".join(cells) + " |")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=160, help="requests per configuration and round")
    parser.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128, help="longest paragraph sent, in tokens")
    parser.add_argument("--seed", type=int, default=38)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    print_report(measure(args), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
