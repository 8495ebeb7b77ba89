"""One emulator session and one CPU run of an export, for tests that compare the two call by call."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions
from optimum_ipu_backend.session import IPUInferenceSession


def emulator_session(onnx_dir: Path, cache_dir: Path, **options: Any) -> IPUInferenceSession:
    """An ``IPUInferenceSession`` on ``onnx_dir/model.onnx``, device emulator, caching in ``cache_dir``,
    with the package's default sizes unless ``options`` say otherwise."""
    options = {"device": "emulator", "executable_cache_dir": str(cache_dir), **options}
    return IPUInferenceSession(
        str(onnx_dir / "model.onnx"), options=IPUProviderOptions.parse(options, onnx_dir)
    )


def cpu_outputs(onnx_dir: Path, feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """``onnx_dir/model.onnx`` run on onnxruntime's CPU provider."""
    session = ort.InferenceSession(str(onnx_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    return session.run(None, dict(feed))
