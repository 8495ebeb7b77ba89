"""``optimum-ipu compile``: every bucket goes into the executable cache, and a later process serves
without compiling (offline on the SDK double with no IPU visible; then on a doubled IPU system)."""

from __future__ import annotations

import json
from pathlib import Path

from sdk_testing import call_log, clear_log, compile_offline, configure, sdk_environment
from subprocess_env import python, python_json
from tiny_models import tiny_model

SERVE = """
import json, sys
sys.path.insert(0, {tests!r})
from tiny_models import feed, reference
from optimum_ipu_backend.session import IPUInferenceSession
from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions
options = IPUProviderOptions.parse({options!r})
with IPUInferenceSession({model!r}, options=options) as session:
    for batch in (1, 2):
        inputs = feed(batch=batch)
        got, expected = session.run(None, inputs), reference({model!r}, inputs)
        assert abs(got[0] - expected[0]).max() < 1e-6
    print(json.dumps([entry["source"] for entry in session.compiled_executables()]))
"""


def test_offline_compile_fills_the_cache_and_a_later_process_serves_without_compiling(tmp_path):
    model = tiny_model(tmp_path / "model" / "model.onnx")
    environment = sdk_environment(tmp_path / "sdk", ipus=0)  # no IPU here: compile offline
    options = {
        "device": "ipu",
        "engine": "popart",
        "batch_size": "1,2",
        "executable_cache_dir": str(tmp_path / "c"),
    }
    completed = compile_offline(model.parent, environment, **options)
    assert completed.returncode == 0, completed.stderr
    (graph,) = json.loads(completed.stdout)
    assert graph["offline"] and [record["source"] for record in graph["executables"]] == ["compiled"] * 2
    offline = [e for e in call_log(environment) if e["call"] == "DeviceManager.createOfflineIPUDevice"]
    assert len(offline) == 2 and all(e["options"]["ipuVersion"] == "ipu2" for e in offline)
    assert [
        e["loadEngine"] for e in call_log(environment) if e["call"] == "InferenceSession.prepareDevice"
    ] == [
        False,
        False,
    ]

    configure(environment, ipus=2)  # the IPU system the cache was compiled for
    clear_log(environment)
    sources = python_json(
        SERVE.format(tests=str(Path(__file__).parent), model=str(model), options=options), env=environment
    )
    assert sources == ["cache", "cache"]
    calls = [entry["call"] for entry in call_log(environment)]
    assert calls.count("cache_hit") == 2 and "cache_write" not in calls  # PopART loaded the .popef


def test_compile_reports_cached_entries_on_a_second_run(tmp_path):
    model = tiny_model(tmp_path / "model" / "model.onnx")
    code = (
        "import sys\nfrom optimum_ipu_backend.cli.main import main\n"
        f"sys.exit(main(['compile', {str(model)!r}, '-o', 'device=emulator', '-o', 'batch_size=1,2,4', "
        f"'-o', 'executable_cache_dir={tmp_path / 'c'}', '--parallel', '2', '--dim', 'sequence_length=5']))"
    )
    first, second = python(code), python(code)
    assert first.returncode == 0 and "3 compiled, 0 already cached" in first.stdout, first.stderr
    assert second.returncode == 0 and "0 compiled, 3 already cached" in second.stdout, second.stderr
