"""A second vendor's provider plugin, for tests: it registers without importing optimum-ipu-backend.
Its probe says the NPU is there unless ACME_NPU_ABSENT=1."""

import os

PROBES = []

SPEC = {
    "name": "AcmeNPUExecutionProvider",
    "aliases": ["npu"],
    "session_factory": "acme_npu_provider.session:AcmeSession",
    "probe": "acme_npu_provider:probe",
    "description": "test double of another vendor's accelerator",
    "priority": 20,
}


def probe():
    PROBES.append(1)
    if os.environ.get("ACME_NPU_ABSENT") == "1":
        return False, "no Acme NPU: ACME_NPU_ABSENT=1 (test double)"
    return True, "the Acme NPU is simulated by onnxruntime on the CPU in tests"
