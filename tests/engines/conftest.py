"""Fixtures of the engine tests against the SDK double: a doubled system of ``IPUS`` IPUs for a test
module, a fresh configuration and call log for each test, and the tiny model they serve.

A module's SDK worker stops as soon as it serves no session (tests see IPUs and processes released),
unless the module overrides ``sdk_worker_idle_seconds``: then its tests share one worker, started by the
first and stopped with the module, and a test that needs a worker of its own (one that changes what a
worker reads when it starts: environment variables, the working directory; or that injects faults the
double counts per process) asks for ``fresh_worker``."""

from __future__ import annotations

import os

import pytest
from sdk_testing import IPUS, clear_log, configure, use_sdk_double
from tiny_models import tiny_model

from optimum_ipu_backend.engines.worker import shutdown_workers

WORKER_IDLE = "OPTIMUM_IPU_WORKER_IDLE_SECONDS"


@pytest.fixture(scope="module")
def sdk_worker_idle_seconds() -> str:
    """How long the module's SDK worker waits for a new session: "0", it stops at once. A module whose
    tests can share one worker overrides this with a time longer than the module takes."""
    return "0"


@pytest.fixture(scope="module")
def sdk(tmp_path_factory, sdk_worker_idle_seconds: str):
    with use_sdk_double(tmp_path_factory.mktemp("sdk"), ipus=IPUS) as environment:
        environment[WORKER_IDLE] = os.environ[WORKER_IDLE] = sdk_worker_idle_seconds
        yield environment


@pytest.fixture()
def double(sdk):
    configure(sdk, ipus=IPUS)
    clear_log(sdk)
    yield sdk
    configure(sdk, ipus=IPUS)


@pytest.fixture()
def fresh_worker(double):
    """The double, with a worker started for this test alone (after its own set-up: a variable it sets
    with monkeypatch, a directory it changes to) and stopped after it, so no other test shares it."""
    shutdown_workers()
    yield double
    shutdown_workers()


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
