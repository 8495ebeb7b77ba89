"""onnxruntime on the CPU, reporting itself as the faithful NPU."""

import onnxruntime as ort


class FaithfulSession:
    NAME = "FaithfulNPUExecutionProvider"
    is_provider_plugin_session = True

    def __init__(self, path_or_bytes, sess_options=None, providers=None, provider_options=None, **kwargs):
        self._inner = ort.InferenceSession(
            path_or_bytes, sess_options=sess_options, providers=["CPUExecutionProvider"]
        )
        self._model_path = str(path_or_bytes)
        self._options = {str(k): str(v) for k, v in dict((provider_options or [{}])[0]).items()}

    def get_providers(self):
        return [self.NAME]

    def get_provider_options(self):
        return {self.NAME: dict(self._options)}

    def io_binding(self):
        return self._inner.io_binding()

    def __getattr__(self, name):
        return getattr(self._inner, name)
