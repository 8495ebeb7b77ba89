"""Fixtures of the engine tests against the SDK double: a doubled system of ``IPUS`` IPUs for a test
module, a fresh configuration and call log for each test, and the tiny model they serve."""

from __future__ import annotations

import pytest
from sdk_testing import IPUS, clear_log, configure, use_sdk_double
from tiny_models import tiny_model


@pytest.fixture(scope="module")
def sdk(tmp_path_factory):
    with use_sdk_double(tmp_path_factory.mktemp("sdk"), ipus=IPUS) as environment:
        yield environment


@pytest.fixture()
def double(sdk):
    configure(sdk, ipus=IPUS)
    clear_log(sdk)
    yield sdk
    configure(sdk, ipus=IPUS)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny") / "model.onnx")


@pytest.fixture()
def wrap(double):
    """poptorch.inferenceModel, with every executor destroyed afterwards: the double's IPUs are booked
    per process, and an executor left attached would hold them for the next test."""
    import poptorch

    made = []

    def inference_model(module, options=None):
        made.append(poptorch.inferenceModel(module, options))
        return made[-1]

    yield inference_model
    for executor in made:
        executor.destroy()
