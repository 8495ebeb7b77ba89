"""Run in a fresh interpreter by ortmodels_on_engines.py (for test_ortmodels_on_popart.py and
test_ortmodels_on_poptorch.py): the cases of
tests/integration/ortmodel_checks.py (the main matrix) and tests/integration/ortmodel_class_checks.py
(CLASS_CASES of tests/class_zoo.py: the other ORTModel classes and the diffusion pipelines) with
provider="ipu" on the Poplar SDK engines (the SDK double on the path) instead of the emulator.
Argument: a JSON file of {"runs": [[device, engine, case name], ...], "cases": {...}}, each case naming
its "matrix" ("main" or "classes") and its "kind"; prints one JSON object keyed "device/engine/name",
each result with the seconds its case took."""

from __future__ import annotations

import json
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))

import ortmodel_checks as checks  # noqa: E402
import ortmodel_class_checks as class_checks  # noqa: E402

KINDS = {"main": checks.KINDS, "classes": class_checks.KINDS}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    results = {}
    for device, engine, name in spec["runs"]:
        checks.IPU = {"provider": "ipu", "provider_options": {"device": device, "engine": engine}}
        case = spec["cases"][name]
        key = f"{device}/{engine}/{name}"
        start = time.perf_counter()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                results[key] = KINDS[case["matrix"]][case["kind"]](case)
            results[key]["fallback_warnings"] = [
                str(w.message) for w in caught if "Falling back" in str(w.message)
            ]
        except Exception:
            results[key] = {"error": traceback.format_exc()}
        results[key]["seconds"] = round(time.perf_counter() - start, 2)  # where the matrix's time goes
    print(json.dumps(results))


if __name__ == "__main__":
    main()
