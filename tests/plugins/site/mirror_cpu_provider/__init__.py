"""A test-only provider that is CPUExecutionProvider under another name, and ships no expectation file:
the conformance suite must pass it as it is (CPU's outputs are the oracle)."""

SPEC = {
    "name": "MirrorCPUExecutionProvider",
    "aliases": ["mirror"],
    "session_factory": "mirror_cpu_provider.session:MirrorSession",
    "description": "test double: onnxruntime's CPU provider under a plugin name, with no expectations",
}
