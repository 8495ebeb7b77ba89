"""Carried state on PopTorch as the real SDK takes it (issue 36), against the PopTorch double:

* PopTorch makes every parameter and buffer that is not floating point a constant, so no buffer named in
  ``updatableNamedBuffers`` may be an integer one: the runtime keeps the int32 masks of a decoding step
  as float32 on this engine (``compiler.carried_state``, ``CarryRequest.integer_state``);
* ``copyNamedBuffersToDevice`` pairs the host tensors, in the order of their names, with the device
  buffers in registration order, so the two orders must agree (``engines.onnx_torch.BUFFER_COUNTER_WIDTH``).

Under the old naming (``state_{initializer position}``, unpadded) an upload put one tensor's values into
another of the same shape without an error once the positions crossed a digit count. Here 120 states of one
shape go through the engine with the naming of today and with the old one put back (a ``sitecustomize``
shim on the worker's path). The release check (``OPTIMUM_IPU_FULL_MATRIX=1``) also runs the edited-past check
of tests/integration/kv_cache_checks.py on a 72-layer GPT-2 (144 key/value tensors of one shape, state
positions 891 to 1,035 under the old naming), both ways: CPU's logits within 1e-4, and not with the old names.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from audio_zoo import real_size_zoo
from full_matrix import FULL
from integration import kv_cache_checks as checks
from onnx import TensorProto, helper, numpy_helper
from sdk_testing import calls, sdk_environment
from subprocess_env import python

DEEP = "gpt2-72-layers"
DEEP_STATES = 145  # 72 keys, 72 values, the attention mask

# The naming before issue 36, put back in a process by ``sitecustomize``: each state buffer named
# ``state_{position}`` (its initializer's position in the graph, unpadded), registered where it was.
_OLD_NAMING = textwrap.dedent(
    """
    import collections
    import json
    import pathlib

    from optimum_ipu_backend.engines import onnx_torch

    _init = onnx_torch.OnnxGraphModule.__init__

    def _old_names(self, model):
        _init(self, model)
        positions = {t.name: i for i, t in enumerate(model.graph.initializer)}
        renamed = {buffer: f"state_{positions[name]}" for name, buffer in self.state_buffers.items()}
        self._buffers = collections.OrderedDict((renamed.get(k, k), v) for k, v in self._buffers.items())
        self.state_buffers = {name: renamed[buffer] for name, buffer in self.state_buffers.items()}
        self._tensor_names = {n: renamed.get(b, b) for n, b in self._tensor_names.items()}
        self._updates = [(renamed[b], updater) for b, updater in self._updates]
        states = [k for k in self._buffers if k in set(renamed.values())]  # in registration order
        with open(pathlib.Path(__file__).with_name("names.jsonl"), "a") as stream:
            stream.write(json.dumps(states) + "\\n")

    onnx_torch.OnnxGraphModule.__init__ = _old_names
    onnx_torch.check_buffer_order = lambda names: None
    """
)


def _shim(directory: Path) -> Path:
    """A directory whose ``sitecustomize`` puts the old naming back in every process that has it on its
    path; it records each module's state buffer names in ``names.jsonl``."""
    directory.mkdir()
    (directory / "sitecustomize.py").write_text(_OLD_NAMING)
    return directory


def _recorded_names(shim: Path) -> list[list[str]]:
    return [json.loads(line) for line in (shim / "names.jsonl").read_text().splitlines()]


def _edited_past(tmp_path: Path, onnx_dir: Path, *, old_naming: bool, may_fail: bool = False) -> dict:
    """The edited-past check's report; with ``may_fail``, ``{"error": stderr}`` when the check failed."""
    environment = sdk_environment(tmp_path / "sdk", ipus=4)
    if old_naming:
        environment["PYTHONPATH"] = f"{_shim(tmp_path / 'shim')}:{environment['PYTHONPATH']}"
    options = {"device": "ipu-model", "engine": "poptorch", "executable_cache_dir": str(tmp_path / "cache")}
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {"case": DEEP, "onnx_dir": str(onnx_dir), "options": options, "context": 12, "new_tokens": 4}
            | {"checks": ["edited"]}
        )
    )
    script = Path(checks.__file__)
    completed = python(
        f"import runpy, sys; sys.argv = ['checks', {str(spec)!r}]; "
        f"runpy.run_path({str(script)!r}, run_name='__main__')",
        timeout=3600,  # 72 layers: the prefill and the decode graphs legalized and traced
        env={**environment, "OPTIMUM_IPU_WORKER_IDLE_SECONDS": "60"},
    )
    if may_fail and completed.returncode != 0:
        return {"error": completed.stderr[-5000:]}
    assert completed.returncode == 0, completed.stderr[-5000:]
    (report,) = json.loads(completed.stdout.strip().splitlines()[-1])  # one report per spec
    return report["edited"]


release_check = pytest.mark.skipif(not FULL, reason="release check: a 72-layer decoder, minutes on 2 cores")


@pytest.fixture(scope="module")
def deep_decoder(zoo) -> Path:
    return real_size_zoo(zoo).onnx(DEEP)


@release_check
def test_an_edited_past_of_a_72_layer_decoder_gives_cpu_logits_on_poptorch(tmp_path, deep_decoder):
    result = _edited_past(tmp_path, deep_decoder, old_naming=False)
    assert result["edit_changes_logits"] > 1e-3  # the edit matters, so a lost or misplaced one shows
    assert result["uploads"] == 1
    assert result["max_abs_diff"] <= checks.LOGITS_ATOL


@release_check
def test_the_old_buffer_names_scramble_the_edited_past_of_a_72_layer_decoder(tmp_path, deep_decoder):
    """The same check with the names of before: the double pairs them by name order, which differs from
    the order they were registered in. Same-sized buffers swap their caches, and the mask's state, paired
    with a larger cache buffer, is read past its end (undefined behaviour on the SDK, an error of the
    double): either the upload fails, or the logits are no longer CPU's."""
    result = _edited_past(tmp_path, deep_decoder, old_naming=True, may_fail=True)
    decode = [names for names in _recorded_names(tmp_path / "shim") if len(names) == DEEP_STATES]
    assert decode and all(names != sorted(names) for names in decode), decode  # they cross a digit count
    if "error" in result:
        assert "through host tensor 'module.state_" in result["error"], result["error"]
    else:
        assert result["max_abs_diff"] > checks.LOGITS_ATOL


# -- what the engine hands PopTorch -------------------------------------------------------------------------


def _many_states_graph(count: int) -> onnx.ModelProto:
    """``count`` float states of one shape (so a mix-up raises nothing), each returned as ``out_i`` and
    replaced by itself plus ``x``; an int32 constant and a float weight among them."""
    nodes, outputs, initializers = [], [], []
    initializers.append(numpy_helper.from_array(np.arange(6, dtype=np.int32).reshape(2, 3), "ints"))
    nodes.append(helper.make_node("Cast", ["ints"], ["ints_f"], to=TensorProto.FLOAT))
    for index in range(count):
        state = f"S{index}"
        initializers.append(numpy_helper.from_array(np.zeros((2, 3), np.float32), state))
        nodes += [
            helper.make_node("Add", [state, "x"], [f"next{index}"]),
            helper.make_node("Add", [state, "ints_f"], [f"out{index}"]),
            helper.make_node("CopyVarUpdate", [state, f"next{index}"], [f"{state}_u"], domain="ai.graphcore"),
        ]
        outputs.append(helper.make_tensor_value_info(f"out{index}", TensorProto.FLOAT, [2, 3]))
    graph = helper.make_graph(
        nodes, "many", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])], outputs, initializers
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 11), helper.make_opsetid("ai.graphcore", 1)]
    )


def test_state_buffers_are_floating_point_and_sort_in_registration_order():
    from optimum_ipu_backend.engines.onnx_torch import OnnxGraphModule

    module = OnnxGraphModule(_many_states_graph(120))  # counters of 1, 2 and 3 digits
    registered = list(module._buffers)
    assert registered == sorted(registered)
    assert len(module.state_buffers) == 120
    for name in module.state_buffers.values():
        assert module._buffers[name].dtype.is_floating_point, name


def test_a_name_order_that_differs_from_the_registration_order_is_refused():
    from optimum_ipu_backend.engines.base import EngineContractError
    from optimum_ipu_backend.engines.onnx_torch import check_buffer_order

    check_buffer_order(["b000009_state", "b000010_state"])
    with pytest.raises(EngineContractError, match="'state_9' is registered in position 0"):
        check_buffer_order(["state_9", "state_10"])


def _upload_and_run(path: Path, count: int) -> dict[str, np.ndarray]:
    """Upload ``count`` states of distinct values through a PopTorch engine (a fresh worker) and run once."""
    from optimum_ipu_backend.engines.base import CompileOptions
    from optimum_ipu_backend.engines.poptorch import PopTorchEngine
    from optimum_ipu_backend.engines.worker import shutdown_workers

    shutdown_workers()  # a worker started earlier would not have this test's path
    try:
        with PopTorchEngine("ipu") as engine:
            executable = engine.compile(path, CompileOptions(device="ipu"))
            executable.write_state({f"S{i}": np.full((2, 3), float(i), np.float32) for i in range(count)})
            got = executable.run({"x": np.zeros((2, 3), np.float32)})
            executable.close()
    finally:
        shutdown_workers()
    ints = np.arange(6, dtype=np.float32).reshape(2, 3)
    return {name: value - ints for name, value in got.items()}  # each out_i minus the constant: S_i


def test_uploads_reach_their_own_buffers_through_the_engine(tmp_path, double):
    """120 states of one shape, each uploaded with its own value through the worker: every output is its
    own state's value."""
    onnx.save(_many_states_graph(120), tmp_path / "many.onnx")
    states = _upload_and_run(tmp_path / "many.onnx", 120)
    for index in range(120):
        np.testing.assert_array_equal(states[f"out{index}"], float(index), err_msg=f"out{index}")
    (upload,) = calls(double, "poptorch.copyNamedBuffersToDevice")
    assert len(upload["buffers"]) == 120


def test_with_the_old_names_uploads_reach_other_buffers(tmp_path, double, monkeypatch):
    """The same upload with the names of before (``state_1`` ... ``state_120``): against the double, which
    pairs by name order as PopTorch does, some outputs hold another state's values."""
    onnx.save(_many_states_graph(120), tmp_path / "many.onnx")
    shim = _shim(tmp_path / "shim")
    monkeypatch.setenv("PYTHONPATH", f"{shim}{os.pathsep}{os.environ['PYTHONPATH']}")
    states = _upload_and_run(tmp_path / "many.onnx", 120)
    (names,) = _recorded_names(shim)
    assert names != sorted(names)  # the precondition: the old names cross digit counts
    misplaced = [i for i in range(120) if not np.array_equal(states[f"out{i}"], np.full((2, 3), float(i)))]
    assert misplaced, "every state reached its own buffer under the old names"
