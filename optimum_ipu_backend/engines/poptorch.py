"""The PopTorch engine (placeholder while the backend is written)."""

from __future__ import annotations

from optimum_ipu_backend.engines.base import Availability
from optimum_ipu_backend.engines.probe import module_origin
from optimum_ipu_backend.engines.worker import WorkerEngine


class PopTorchEngine(WorkerEngine):
    name = "poptorch"
    devices = ("ipu", "ipu-model")
    priority = 10
    thread_safe = False
    pip_extra = "poptorch"
    sdk_module = "poptorch"
    backend = "optimum_ipu_backend.engines.poptorch:PopTorchBackend"

    @classmethod
    def probe(cls) -> Availability:
        origin = module_origin("poptorch")
        if origin is None:
            return Availability(
                False,
                "the Python module poptorch of Graphcore's Poplar SDK was not found; enable the SDK and install "
                "its PopTorch wheel (pip install optimum-ipu-backend[poptorch] for the host side)",
            )
        return Availability(True, f"PopTorch found ({origin}); the SDK lists the IPUs when a session starts")
