"""The engines on a real Poplar SDK (IPU Model, and IPU hardware when the SDK lists IPUs). Marked
``ipu``: skipped, with the reason, wherever the SDK is not enabled, which is every CI machine today."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
from tiny_models import feed, reference, tiny_model

from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions
from optimum_ipu_backend.session import IPUInferenceSession

pytestmark = pytest.mark.ipu

_DOUBLE = os.path.join("tests", "sdk_double")
_MISSING = [
    name
    for name in ("popart", "poptorch")
    if importlib.util.find_spec(name) is None or _DOUBLE in (importlib.util.find_spec(name).origin or "")
]


@pytest.mark.parametrize("engine", ["popart", "poptorch"])
@pytest.mark.parametrize("device", ["ipu-model", "ipu"])
def test_tiny_model_matches_onnxruntime_on_the_real_sdk(tmp_path, engine, device):
    if engine in _MISSING:
        pytest.skip(
            f"the Poplar SDK's {engine} module is not importable here (enable the SDK: source <sdk>/enable)"
        )
    model = tiny_model(tmp_path / "model.onnx")
    options = IPUProviderOptions.parse(
        {"device": device, "engine": engine, "executable_cache_dir": str(tmp_path)}
    )
    try:
        session = IPUInferenceSession(str(model), options=options)
    except Exception as exc:
        if device == "ipu" and "found no IPUs" in str(exc):
            pytest.skip(f"the Poplar SDK lists no IPU hardware: {exc}")
        raise
    with session:
        inputs = feed(batch=3)
        got, expected = session.run(None, inputs), reference(model, inputs)
        np.testing.assert_allclose(got[0], expected[0], atol=1e-5)
        np.testing.assert_array_equal(got[1], expected[1])
