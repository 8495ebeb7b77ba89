"""The vendor conformance suite: any execution provider against CPU onnxruntime, model by model and
operator by operator (``optimum-ipu conformance``; docs/conformance.md).

Nothing is imported here: the suite's modules load torch, transformers and onnx, and are imported only by
the command and by the tests that use them.
"""
