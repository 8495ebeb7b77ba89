"""The static-shape runtime behind the session: buckets, batching, device steps, the executable cache
across processes, and errors for inputs over the largest bucket. Everything is compared with plain
onnxruntime CPU runs of the exported graph on the unpadded inputs."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from subprocess_env import python

from optimum_ipu_backend.conformance.zoo import preprocessed_inputs
from optimum_ipu_backend.runtime.buckets import InputTooLargeError
from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions, ProviderOptionError
from optimum_ipu_backend.runtime.serving import ExecutableLimitError
from optimum_ipu_backend.session import IPUInferenceSession

ATOL = 1e-5


@pytest.fixture(scope="module")
def bert_task() -> str:
    return "token-classification"


def _session(onnx_dir: Path, cache_dir: Path | None = None, **options) -> IPUInferenceSession:
    options = {"device": "emulator", **options}
    if cache_dir is not None:
        options["executable_cache_dir"] = str(cache_dir)
    path = onnx_dir / "model.onnx"
    return IPUInferenceSession(str(path), options=IPUProviderOptions.parse(options, onnx_dir))


def _reference(onnx_dir: Path, feed):
    return ort.InferenceSession(str(onnx_dir / "model.onnx"), providers=["CPUExecutionProvider"]).run(
        None, feed
    )


@pytest.mark.parametrize("batch, seq", [(1, 5), (3, 11), (2, 8), (13, 20)])
def test_padded_and_split_runs_equal_unpadded_cpu(bert, tmp_path, batch, seq):
    model_dir, onnx_dir = bert
    session = _session(onnx_dir, tmp_path, sequence_lengths="8,16,32", batch_size="1,2,4")
    feed = preprocessed_inputs(model_dir, batch=batch, seq=seq)
    got = session.run(None, feed)
    expected = _reference(onnx_dir, feed)
    assert got[0].shape == expected[0].shape
    np.testing.assert_allclose(got[0], expected[0], atol=ATOL)
    compiled = {(s["shapes"]["input_ids"]) for s in session.compiled_executables()}
    # only compiled sizes were used: batch in {1,2,4}, sequence in {8,16,32}
    assert all(b in (1, 2, 4) and s in (8, 16, 32) for b, s in compiled), compiled


def test_one_token_over_the_largest_bucket_is_a_clear_error(bert, tmp_path):
    model_dir, onnx_dir = bert
    session = _session(onnx_dir, tmp_path, sequence_lengths="8,16")
    feed = preprocessed_inputs(model_dir, batch=1, seq=17)
    with pytest.raises(InputTooLargeError) as info:
        session.run(None, feed)
    message = str(info.value)
    assert "input 'input_ids'" in message and "17" in message and "16" in message
    assert "sequence_lengths" in message  # the option that raises the limit


def test_device_iterations_and_replication_use_popart_layout(bert, tmp_path):
    model_dir, onnx_dir = bert
    session = _session(
        onnx_dir, tmp_path, device_iterations=2, replication_factor=2, batch_size="2", sequence_lengths="16"
    )
    seen = []
    table = session._runner._table
    original = table.run_step

    def spy(shapes, branches, feed):
        seen.append({name: array.shape for name, array in feed.items()})
        return original(shapes, branches, feed)

    table.run_step = spy
    feed = preprocessed_inputs(model_dir, batch=11, seq=12)
    got = session.run(None, feed)
    np.testing.assert_allclose(got[0], _reference(onnx_dir, feed)[0], atol=ATOL)
    # 11 samples in steps of micro-batch 2 x 2 iterations x 2 replicas = 8: two steps,
    # each buffer [device_iterations, replicas, micro_batch, sequence]
    assert [shapes["input_ids"] for shapes in seen] == [(2, 2, 2, 16), (2, 2, 2, 16)]


def test_a_call_past_max_executables_is_refused_naming_the_cap_and_earlier_shapes_still_serve(bert, tmp_path):
    model_dir, onnx_dir = bert
    session = _session(onnx_dir, tmp_path, sequence_lengths="8,16", batch_size="1", max_executables="1")
    short = preprocessed_inputs(model_dir, batch=1, seq=5)
    np.testing.assert_allclose(session.run(None, short)[0], _reference(onnx_dir, short)[0], atol=ATOL)
    longer = preprocessed_inputs(model_dir, batch=1, seq=12)  # needs the 16 bucket: a second executable
    with pytest.raises(ExecutableLimitError) as info:
        session.run(None, longer)
    message = str(info.value)
    assert "max_executables=1" in message and "Raise max_executables" in message and "16" in message
    (entry,) = session.compiled_executables()
    # each entry carries the padding verdict of every dimension: here the sequence is padded by proof
    assert entry["padding"] == session.padding_verdicts()
    assert any(
        dim.endswith("sequence_length") and v.startswith("padded") for dim, v in entry["padding"].items()
    )
    other = preprocessed_inputs(model_dir, batch=1, seq=7, seed=3)  # fits the compiled executable
    np.testing.assert_allclose(session.run(None, other)[0], _reference(onnx_dir, other)[0], atol=ATOL)


def test_ipu_config_json_beside_the_model(bert, tmp_path):
    model_dir, onnx_dir = bert
    local = tmp_path / "model"
    local.mkdir()
    for item in onnx_dir.iterdir():
        if item.is_file():
            (local / item.name).write_bytes(item.read_bytes())
    (local / "ipu_config.json").write_text(
        json.dumps({"sequence_lengths": [12, 24], "inference_device_iterations": 1, "matmul_proportion": 0.2})
    )
    with pytest.warns(UserWarning, match="matmul_proportion"):
        session = _session(local, tmp_path / "cache")
    assert session.bucket_sizes()["sequence_length"] == [12, 24]
    (local / "ipu_config.json").write_text(json.dumps({"sequence_lenghts": [12]}))
    with pytest.raises(ProviderOptionError, match="sequence_lenghts"):
        _session(local, tmp_path / "cache")


def test_concurrent_calls_of_one_new_shape_compile_once(bert, tmp_path):
    model_dir, onnx_dir = bert
    session = _session(onnx_dir, tmp_path)
    feed = preprocessed_inputs(model_dir, batch=2, seq=9)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: session.run(None, feed)[0], range(16)))
    expected = _reference(onnx_dir, feed)[0]
    for result in results:
        np.testing.assert_allclose(result, expected, atol=ATOL)
    assert len(session.compiled_executables()) == 1


RUN_ONCE = """
import json, sys, numpy as np, onnxruntime as ort
from optimum_ipu_backend.conformance.zoo import preprocessed_inputs
from optimum_ipu_backend.session import IPUInferenceSession
from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions
from pathlib import Path
onnx_dir, model_dir, cache = Path({onnx!r}), Path({model!r}), {cache!r}
session = IPUInferenceSession(str(onnx_dir / "model.onnx"),
    options=IPUProviderOptions.parse({{"device": "emulator", "executable_cache_dir": cache}}, onnx_dir))
feed = preprocessed_inputs(model_dir, batch=2, seq=10)
got = session.run(None, feed)[0]
cpu = ort.InferenceSession(str(onnx_dir / "model.onnx"), providers=["CPUExecutionProvider"])
ref = cpu.run(None, feed)[0]
print(json.dumps({{"sources": [s["source"] for s in session.compiled_executables()],
                  "diff": float(np.abs(got - ref).max())}}))
"""


def _run_once(onnx_dir, model_dir, cache, background=False):
    code = RUN_ONCE.format(onnx=str(onnx_dir), model=str(model_dir), cache=str(cache))
    return python(code)


def _result(completed) -> dict:
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_new_process_reuses_the_cache_and_skips_compilation(bert, tmp_path):
    model_dir, onnx_dir = bert
    first = _result(_run_once(onnx_dir, model_dir, tmp_path))
    second = _result(_run_once(onnx_dir, model_dir, tmp_path))
    assert first["sources"] == ["compiled"] and second["sources"] == ["cache"]
    assert first["diff"] <= ATOL and second["diff"] <= ATOL


def test_two_processes_racing_for_one_key_compile_once(bert, tmp_path):
    model_dir, onnx_dir = bert
    with ThreadPoolExecutor(2) as pool:
        results = [_result(r) for r in pool.map(lambda _: _run_once(onnx_dir, model_dir, tmp_path), range(2))]
    assert sorted(r["sources"][0] for r in results) == ["cache", "compiled"]
    assert all(r["diff"] <= ATOL for r in results)


def test_corrupted_cache_entry_is_rebuilt_with_a_warning(bert, tmp_path, caplog):
    model_dir, onnx_dir = bert
    assert _result(_run_once(onnx_dir, model_dir, tmp_path))["sources"] == ["compiled"]
    graphs = list(tmp_path.rglob("legalized.onnx"))
    assert len(graphs) == 1
    data = bytearray(graphs[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    graphs[0].write_bytes(bytes(data))
    completed = _run_once(onnx_dir, model_dir, tmp_path)
    result = _result(completed)
    assert result["sources"] == ["compiled"] and result["diff"] <= ATOL
    assert "corrupt" in completed.stderr.lower()


def test_cache_can_be_disabled(bert, tmp_path):
    model_dir, onnx_dir = bert
    session = _session(onnx_dir, None, executable_cache_dir="disabled")
    assert session.get_provider_options()["IPUExecutionProvider"]["executable_cache"] == "disabled"
    feed = preprocessed_inputs(model_dir, batch=1, seq=6)
    np.testing.assert_allclose(session.run(None, feed)[0], _reference(onnx_dir, feed)[0], atol=ATOL)
    assert not os.listdir(tmp_path)


def test_trim_padding_regroups_rows_and_keeps_every_real_position(bert, tmp_path):
    model_dir, onnx_dir = bert
    session = _session(onnx_dir, tmp_path, trim_padding="1", sequence_lengths="4,8,16,32")
    feed = preprocessed_inputs(model_dir, batch=6, seq=24, seed=3)
    mask = feed["attention_mask"].astype(bool)
    got = session.run(None, feed)[0]
    expected = _reference(onnx_dir, feed)[0]
    np.testing.assert_allclose(got[mask], expected[mask], atol=ATOL)  # every real token exact
    assert not got[~mask].any()  # masked positions are zeros, as documented
    computed = sum(np.prod(s["shapes"]["input_ids"]) * s["calls"] for s in session.compiled_executables())
    assert computed < 6 * 32  # less than padding the whole call to its bucket


def test_layers_per_ipu_that_does_not_match_ipus_per_replica_is_refused(bert, tmp_path):
    model_dir, onnx_dir = bert
    with pytest.raises(ProviderOptionError, match=r"layers_per_ipu=\[2, 2, 2\].*ipus_per_replica=4"):
        _session(onnx_dir, tmp_path, ipus_per_replica=4, layers_per_ipu="2,2,2")


def test_a_batch_found_exact_is_never_filled_up_on_later_calls(tmp_path):
    """A graph that mixes the samples of a batch (each row minus the batch mean) has its batch compiled
    exactly after the first call; every later call of 3 samples must still return 3 rows, CPU's values."""
    from onnx import TensorProto, helper

    from optimum_ipu_backend.session import create_session

    model = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("ReduceMean", ["x"], ["mean"], axes=[0], keepdims=1),
                helper.make_node("Sub", ["x", "mean"], ["y"]),
            ],
            "mixes_samples",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch_size", 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch_size", 4])],
        ),
        opset_imports=[helper.make_opsetid("", 13)],
    )
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    cpu = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    session = create_session(str(path), providers=["ipu"], provider_options={"device": "emulator"})
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = rng.standard_normal((3, 4)).astype(np.float32)
        (got,) = session.run(None, {"x": x})
        np.testing.assert_allclose(got, cpu.run(None, {"x": x})[0], atol=1e-6)
    assert session.padding_verdicts()["batch_size"].startswith("exact sizes:")
