"""onnxruntime on the CPU, except for one output of one model, which is off by a set amount."""

from pathlib import Path

import numpy as np
from faithful_npu_provider.session import FaithfulSession


class PerturbedSession(FaithfulSession):
    NAME = "PerturbedNPUExecutionProvider"

    def __init__(self, path_or_bytes, sess_options=None, providers=None, provider_options=None, **kwargs):
        super().__init__(path_or_bytes, sess_options, providers, provider_options, **kwargs)
        path = Path(self._model_path)
        chosen = self._options.get("perturb_model") in (path.parent.name, path.stem.rsplit("-", 1)[0])
        self._target = self._options.get("perturb_output", "logits") if chosen else None
        self._delta = float(self._options.get("perturb_by", "1e-3"))
        element = self._options.get("perturb_element")
        self._element = None if element is None else int(element)

    def run(self, output_names, input_feed, run_options=None):
        names = output_names or [output.name for output in self._inner.get_outputs()]
        results = self._inner.run(names, input_feed, run_options)
        return [
            self._perturbed(value) if name == self._target else value
            for name, value in zip(names, results, strict=True)
        ]

    def _perturbed(self, value):
        if self._element is None:
            return value + np.asarray(self._delta, dtype=value.dtype)
        value = value.copy()
        value.flat[self._element] += np.asarray(self._delta, dtype=value.dtype)
        return value
