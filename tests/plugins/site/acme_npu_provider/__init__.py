"""A second vendor's provider plugin, for tests: it registers without importing optimum-ipu-backend."""

PROBES = []

SPEC = {
    "name": "AcmeNPUExecutionProvider",
    "aliases": ["npu"],
    "session_factory": "acme_npu_provider.session:AcmeSession",
    "probe": "acme_npu_provider:probe",
    "description": "test double of another vendor's accelerator",
}


def probe():
    PROBES.append(1)
    return True, "the Acme NPU is simulated by onnxruntime on the CPU in tests"
