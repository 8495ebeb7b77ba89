"""Wall time of ``optimum-ipu conformance``: --quick and the full run, for the ipu provider on the host
emulator and for CPUExecutionProvider, each as a vendor would start it from a shell.

* quick, cold: an empty work directory (every zoo model built and exported, the ONNX node cases
  generated) and an empty executable cache;
* quick, warm: the same again, with the work directory and the executable cache the cold run left;
* full: every matrix entry and every node case, on the warm work directory;
* full, CPU: the same for CPUExecutionProvider (the sanity run).

Each run's verdict and case counts come from its JSON report. Beside the wall time: the CPU time the
run's processes used (user + system, pytest-xdist workers included), and the machine's load average.
On a shared machine the load explains most of the spread in wall time; the CPU time barely moves.

    python benchmarks/bench_conformance.py [--runs quick-cold,quick-warm,full,full-cpu] [--jobs auto]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNS = {
    "quick-cold": ("ipu", ["--provider-option", "device=emulator", "--quick"], True),
    "quick-warm": ("ipu", ["--provider-option", "device=emulator", "--quick"], False),
    "full": ("ipu", ["--provider-option", "device=emulator"], False),
    "full-cpu": ("CPUExecutionProvider", [], False),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated, from: " + ", ".join(RUNS))
    parser.add_argument("--jobs", default="auto")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-conformance-"))
    work, cache = root / "work", root / "executable-cache"
    env = {**os.environ, "OPTIMUM_IPU_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "OPTIMUM_IPU_PROGRESS": "0"}
    print(f"{os.cpu_count()} CPU cores ({platform.machine()}), Python {platform.python_version()}")
    print("no IPU: the ipu figures are host emulation (device 'emulator')")
    rows = []
    for name in args.runs.split(","):
        provider, extra, cold = RUNS[name]
        if cold:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(cache, ignore_errors=True)
        report = root / f"report-{name}"
        command = [
            "optimum-ipu", "conformance", "--provider", provider, *extra,
            "--report", str(report), "--work-dir", str(work), "--jobs", args.jobs,
        ]  # fmt: skip
        load_before = os.getloadavg()[0]
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime - usage.ru_utime + after.ru_stime - usage.ru_stime
        data = json.loads((report / "conformance.json").read_text())
        row = {
            "run": name,
            "command": " ".join(command[:-6]),
            "wall_s": round(wall, 1),
            "cpu_s": round(cpu, 1),
            "exit": result.returncode,
            "verdict": "PASS" if data["passed"] else "FAIL",
            "counts": data["summary"]["by_status"],
            "load_before": round(load_before, 1),
            "load_after": round(os.getloadavg()[0], 1),
        }
        rows.append(row)
        print(
            f"{name:11} {row['wall_s']:7.1f} s wall {row['cpu_s']:7.1f} s CPU  exit {row['exit']}  "
            f"{row['verdict']}  load {row['load_before']}->{row['load_after']}  {row['counts']}",
            flush=True,
        )
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
    shutil.rmtree(root, ignore_errors=True)
    return 0 if all(row["exit"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
