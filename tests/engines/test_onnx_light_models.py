"""ONNX's nine ``light`` CNNs (shipped in the onnx wheel under backend/test/data/light) against ONNX's
reference outputs, as onnx's backend test runner checks them: on the emulator, and on device ipu with
the PopART and with the PopTorch engine against the SDK double (tests/sdk_double).

Each model is an IR-3, opset-9 graph whose weights are ConstantOfShape nodes; its stored output is ONNX's
reference evaluator's for the runner's deterministic dummy input. Inputs, expected outputs and tolerances
all come from onnx's own test loader and runner: rtol 1e-3 (2e-3 for DenseNet-121) and atol 1e-7, which
every model meets on every engine (measured: the emulator and PopART match exactly, PopTorch's DenseNet
is off by 1.5e-7 of 0.46).

What the reference can tell: with constant weights every class gets the same logit, so eight of the nine
outputs are a uniform softmax (0.001 everywhere) that only a wrong shape, a NaN or an overflow misses.
DenseNet-121 ends without a softmax: its one value, 0.461, depends on the input through all 121 layers.

AlexNet, VGG-19 and ZFNet-512 carry 60-140 M constant weights and take 4-19 s each per engine on two
cores (the module: 34 s without them, 101 s with), so by default the other six run on all three engines
(Inception-v1 among them: LRN and a one-sided pool pad); ``OPTIMUM_IPU_FULL_MATRIX=1`` (the release
check) adds the three, marked ``slow``. Most of their time is the compiler's opset 9 to 11 conversion and
checks over the folded weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from full_matrix import Matrix
from onnx import numpy_helper
from onnx.backend.test.loader import load_model_tests
from onnx.backend.test.runner import Runner
from sdk_testing import calls

from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions
from optimum_ipu_backend.session import IPUInferenceSession

LIGHT_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
# onnx's "real" test cases point at the light models and carry their tolerances.
CASES = {case.model_name: case for case in load_model_tests(kind="real")}
HEAVY = {"bvlc_alexnet", "vgg19", "zfnet512"}


def _operators(name: str) -> frozenset[str]:
    return frozenset(node.op_type for node in onnx.load(LIGHT_DIR / f"light_{name}.onnx").graph.node)


MATRIX = Matrix(
    "onnx-light-models",
    product=sorted(CASES),
    share=lambda name: name not in HEAVY,
    # the three heavy models are plain stacks of the operators the other six carry (LRN: Inception-v1)
    covers={"operator": _operators},
    why="AlexNet, VGG-19 and ZFNet-512 carry 60-140 M constant weights (4-19 s each per engine)",
)
MODELS = [pytest.param(name, marks=pytest.mark.slow) if name in HEAVY else name for name in MATRIX.cases]
# (device, engine, the SDK call that shows the engine ran the graph)
ENGINES = {
    "emulator": ("emulator", None, None),
    "popart": ("ipu", "popart", "InferenceSession.run"),
    "poptorch": ("ipu", "poptorch", "poptorch.run"),
}


def test_onnx_lists_the_nine_light_models():
    """The wheel's cases are what this module runs; a new or renamed one must not go unnoticed."""
    assert sorted(CASES) == [
        "bvlc_alexnet",
        "densenet121",
        "inception_v1",
        "inception_v2",
        "resnet50",
        "shufflenet",
        "squeezenet",
        "vgg19",
        "zfnet512",
    ]
    for name, case in CASES.items():
        assert case.url == f"onnx/backend/test/data/light/light_{name}.onnx"


def _dummy_feed(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The runner's input for a light model: its dummy data for every graph input but initializers."""
    initializers = {initializer.name for initializer in model.graph.initializer}
    return {
        value.name: Runner.generate_dummy_data(value, seed=0, random=False)
        for value in model.graph.input
        if value.name not in initializers
    }


@pytest.fixture(scope="module")
def sdk_worker_idle_seconds() -> str:
    """One worker per engine serves every model (tests/engines/conftest.py): none of these tests changes
    what a worker reads when it starts."""
    return "600"


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_light_model_matches_onnx_reference(double, tmp_path_factory, engine, name):
    device, engine_option, sdk_run = ENGINES[engine]
    case = CASES[name]
    path = LIGHT_DIR / f"light_{name}.onnx"
    model = onnx.load(path)
    expected = [
        numpy_helper.to_array(onnx.load_tensor(str(LIGHT_DIR / f"light_{name}_output_{index}.pb")))
        for index in range(len(model.graph.output))
    ]
    options = {"device": device, "executable_cache_dir": str(tmp_path_factory.mktemp("cache"))}
    if engine_option:
        options["engine"] = engine_option
    with IPUInferenceSession(str(path), options=IPUProviderOptions.parse(options)) as session:
        got = session.run(None, _dummy_feed(model))
        facts = session.get_provider_options()["IPUExecutionProvider"]
    assert (facts["device"], facts["engine"]) == (device, engine)
    if sdk_run:
        assert facts["emulated"] == "0" and facts["sdk_version"] == f"{engine} 3.4.0"
        assert len(calls(double, sdk_run)) == 1, f"{engine} did not run the graph once"
    else:
        assert facts["emulated"] == "1"
    assert len(got) == len(expected)
    for output, reference in zip(got, expected, strict=True):
        np.testing.assert_allclose(output, reference, rtol=case.rtol, atol=case.atol)
