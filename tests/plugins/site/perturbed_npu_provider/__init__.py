"""A test-only provider that is wrong in one place: it adds ``perturb_by`` (default 1e-3) to one output
(``perturb_output``, default ``logits``) of one model (the ONNX file's directory, or for an operator
case the file's name before its data-set number, is ``perturb_model``), to every element or, with
``perturb_element=N``, to the N-th element only; every other result is onnxruntime's on the CPU. All
are provider options. It builds on the faithful provider's session (a test double may lean on another)."""

SPEC = {
    "name": "PerturbedNPUExecutionProvider",
    "aliases": ["perturbed"],
    "session_factory": "perturbed_npu_provider.session:PerturbedSession",
    "description": "test double of an accelerator with one wrong output",
}
