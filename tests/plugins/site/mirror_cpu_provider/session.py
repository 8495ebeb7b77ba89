"""onnxruntime on the CPU, reporting itself as the mirror provider."""

from faithful_npu_provider.session import FaithfulSession


class MirrorSession(FaithfulSession):
    NAME = "MirrorCPUExecutionProvider"
