"""A test-only provider that is right everywhere: onnxruntime on the CPU under a plugin name.

It ships its own conformance expectations (``conformance.toml`` beside this module), as a vendor's
distribution may, so the suite's discovery of that file is tested too.
"""

SPEC = {
    "name": "FaithfulNPUExecutionProvider",
    "aliases": ["faithful"],
    "session_factory": "faithful_npu_provider.session:FaithfulSession",
    "description": "test double of an accelerator whose results equal the CPU's",
}
