"""What the SDK worker process costs per call: the shared-memory copies and the request round trip.

    python benchmarks/bench_worker_boundary.py [--calls 15]

A BERT-base-sized model (12 layers, hidden 768, random weights) at batch 8, sequence 128. The PopART
engine runs against the SDK test double (tests/sdk_double, put on the path here as the SDK's enable
script would), which executes the graph with onnxruntime inside the worker; the worker reports how long
the SDK's ``run`` took. The boundary is a call's wall time minus that, i.e. everything a call adds on
the host side of the worker (including bucketing and padding, which the emulator pays too), compared
with the same executable's call on the emulator engine, interleaved call by call. Nothing here runs on
an IPU: on hardware the boundary is the same host work, the device time differs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DOUBLE = HERE.parent / "tests" / "sdk_double"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=15)
    args = parser.parse_args()
    os.environ.update(PYTHONPATH=str(DOUBLE), POPLAR_SDK_ENABLED=str(DOUBLE))
    sys.path.insert(0, str(DOUBLE))
    sys.path.insert(0, str(HERE))
    from bench_provider_overhead import bert_base_feed, export_bert_base

    from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions
    from optimum_ipu_backend.session import IPUInferenceSession

    with tempfile.TemporaryDirectory() as tmp:
        path = export_bert_base(Path(tmp))
        feed = bert_base_feed()
        common = {
            "batch_size": "8",
            "sequence_lengths": "128",
            "executable_cache_dir": str(Path(tmp) / "cache"),
        }
        emulator = IPUInferenceSession(
            path, options=IPUProviderOptions.parse({"device": "emulator", **common})
        )
        popart = IPUInferenceSession(
            path, options=IPUProviderOptions.parse({"device": "ipu-model", "engine": "popart", **common})
        )
        emulator.run(None, feed), popart.run(None, feed)  # compile both
        emulator_ms, popart_ms, device_ms = [], [], []
        for _ in range(args.calls):
            started = time.perf_counter()
            emulator.run(None, feed)
            emulator_ms.append((time.perf_counter() - started) * 1e3)
            started = time.perf_counter()
            popart.run(None, feed)
            popart_ms.append((time.perf_counter() - started) * 1e3)
            (entry,) = popart.compiled_executables()
            device_ms.append(entry["last_run_seconds"] * 1e3)
        boundary = [call - device for call, device in zip(popart_ms, device_ms, strict=True)]
        popart.close()
        emulator.close()
    emulator_median, boundary_median = statistics.median(emulator_ms), statistics.median(boundary)
    print("| BERT-base b8 s128, per call | median ms |")
    print("|---|---|")
    print(f"| emulator engine, `session.run` | {emulator_median:.1f} |")
    print(f"| PopART engine (SDK double, ipu-model), `session.run` | {statistics.median(popart_ms):.1f} |")
    print(f"| of which the SDK's `run` inside the worker | {statistics.median(device_ms):.1f} |")
    print(
        f"| boundary: call minus the worker's run (copies, round trip, host work) | {boundary_median:.2f} "
        f"({boundary_median / emulator_median * 100:.2f}% of the emulator call; target <= 5%) |"
    )
    print(f"\nmedians of {args.calls} interleaved calls; command: python benchmarks/bench_worker_boundary.py")


if __name__ == "__main__":
    main()
