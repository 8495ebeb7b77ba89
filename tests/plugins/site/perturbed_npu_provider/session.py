"""onnxruntime on the CPU, except for one output of one model, which is off by a set amount."""

from pathlib import Path

import numpy as np
from faithful_npu_provider.session import FaithfulSession


class PerturbedSession(FaithfulSession):
    NAME = "PerturbedNPUExecutionProvider"

    def __init__(self, path_or_bytes, sess_options=None, providers=None, provider_options=None, **kwargs):
        super().__init__(path_or_bytes, sess_options, providers, provider_options, **kwargs)
        chosen = Path(self._model_path).parent.name == self._options.get("perturb_model")
        self._target = self._options.get("perturb_output", "logits") if chosen else None
        self._delta = float(self._options.get("perturb_by", "1e-3"))

    def run(self, output_names, input_feed, run_options=None):
        names = output_names or [output.name for output in self._inner.get_outputs()]
        results = self._inner.run(names, input_feed, run_options)
        return [
            value + np.asarray(self._delta, dtype=value.dtype) if name == self._target else value
            for name, value in zip(names, results, strict=True)
        ]
