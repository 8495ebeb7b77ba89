"""Every ORTModel class the emulator serves, unchanged, with device="ipu" and device="ipu-model" on the
PopART and on the PopTorch engine (the SDK double on the path, a doubled system of 4 IPUs): the main
matrix (tests/integration/test_ortmodels.py), CLASS_CASES (tests/class_zoo.py: the other ORTModel
classes and the three diffusion pipelines, as tests/integration/test_ortmodel_classes.py runs them) and
the padding-pattern models (PATTERN_TASKS, as tests/integration/test_padding_patterns.py runs them).
Outputs match CPUExecutionProvider within the emulator's tolerances, generation is token-identical and
images agree.

By default (CI on two cores) each case but those of ``RELEASE_ONLY`` runs once: the cases alternate
between the two engines, and each engine's cases alternate between the two devices, so every class and
every architecture family runs and each engine serves forward and generation cases on both devices.
``OPTIMUM_IPU_FULL_MATRIX=1`` runs every case on both devices of both engines (the release check).

One fresh interpreter per engine, each engine's test in a module of its own
(tests/engines/test_ortmodels_on_popart.py, test_ortmodels_on_poptorch.py), so that pytest-xdist, which
keeps a module on one worker, runs the two in parallel; each serves every model of both devices from one
shared worker process.
"""

from __future__ import annotations

import json
from pathlib import Path

from class_zoo import CLASS_CASES
from full_matrix import FULL, Matrix
from integration.test_ortmodel_classes import ATOL as CLASS_ATOL
from integration.test_ortmodel_classes import IMAGE_ATOL, class_case_specs
from integration.test_ortmodels import ATOL, FORWARD, GENERATE, _onnx_dir
from sdk_testing import call_log, sdk_environment
from subprocess_env import python

from optimum_ipu_backend.conformance.zoo import PATTERN_TASKS

# PopTorch runs the graph as torch operators, whose float32 sums are ordered differently from
# onnxruntime's kernels: results may also differ by this fraction of the largest output (a few units in
# the last place; the real all-MiniLM-L6-v2 differs by 1.2e-5 on the first run of the full product).
TORCH_RTOL = 1e-6
DEVICES = ("ipu", "ipu-model")
ENGINES = ("popart", "poptorch")
# The padding-pattern models (tests/integration/test_padding_patterns.py): the audio frame classifier is
# the only model of its class, and the others carry the graphs the padding proof had to learn.
PATTERNS = {
    f"pattern-{case.model}": (class_name, case.model, case.task)
    for class_name, cases in PATTERN_TASKS.items()
    for case in cases
}
CASE_NAMES = [*FORWARD, *GENERATE, *CLASS_CASES, *PATTERNS]
#: Cases only the release check runs, each repeating the class and the architecture family of a case the
#: default share runs, with operators those cases bring to each engine's converter by default.
RELEASE_ONLY = {
    # 22 executables on PopTorch (every step recompiles the whole sequence at its new length, the extra
    # modes too): two thirds of that engine's compile time. GPT-2 and ORTModelForCausalLM run by default
    # with the cache (PopART here; PopTorch in tests/engines/test_kv_cache_on_engines.py), whose graphs
    # hold every operator type of the graph without it, and Concat; use_cache=False generation runs by
    # default on the emulator (tests/integration/test_ortmodels.py).
    "causal-lm-without-cache": "GPT-2 generation without its cache recompiles every step's full sequence",
}


def _alternating(index: int, name: str) -> tuple[str, str, str]:
    """The share's run of the ``index``-th case: the cases alternate between the engines and, within an
    engine, between the devices."""
    return (DEVICES[(index // len(ENGINES)) % len(DEVICES)], ENGINES[index % len(ENGINES)], name)


def _class_and_family(name: str) -> tuple[str, str]:
    """The ORTModel class of a case and its architecture family (the zoo's model; a class case's own
    model, which no other case shares)."""
    if name in CLASS_CASES:
        return CLASS_CASES[name].ort_class, name
    cls, model = (PATTERNS.get(name) or FORWARD.get(name) or GENERATE[name])[:2]
    return cls, model


MATRIX = Matrix(
    "ortmodels-on-engines",
    product=[(device, engine, name) for engine in ENGINES for device in DEVICES for name in CASE_NAMES],
    share=[_alternating(index, name) for index, name in enumerate(CASE_NAMES) if name not in RELEASE_ONLY],
    covers={
        "class": lambda run: _class_and_family(run[2])[0],
        "architecture family": lambda run: _class_and_family(run[2])[1],
        "engine and device": lambda run: run[:2],
        "engine and kind": lambda run: (run[1], _kind(run[2])),
    },
    why="each run loads the model and compiles every shape it is called at on the SDK double; "
    + "; ".join(f"{name}: {reason}" for name, reason in RELEASE_ONLY.items()),
)


#: New tokens per generation: 8 by default, 16 in the release check. A decoder whose past the padding proof
#: keeps exact (Qwen3-MoE, M2M100, merged T5) compiles one executable per step, most of this matrix's time.
GENERATED_TOKENS = 16 if FULL else 8


def _runs(engine: str) -> list[tuple[str, str, str]]:
    """(device, engine, case) triples this run serves on ``engine``."""
    return [run for run in MATRIX.cases if run[1] == engine]


def _cases(zoo, scratch: Path, engine: str) -> dict:
    """Every case; on PopTorch, generation also runs greedy, 4 beams and seeded sampling on one row, a batch
    whose decoding steps keep the cache on the device (issue 36: the cache as PopTorch keeps it)."""
    cases = _all_cases(zoo, scratch)
    for case in cases.values():
        if case["kind"] == "generate":
            case["new_tokens"] = GENERATED_TOKENS
            if engine == "poptorch":
                case["extra_modes"] = True
    return cases


def _all_cases(zoo, scratch: Path) -> dict:
    cases = class_case_specs(zoo, scratch)
    for name, (cls, model, task) in FORWARD.items():
        cases[name] = {
            "matrix": "main",
            "kind": "forward",
            "class": cls,
            "model": model,
            "model_dir": str(zoo.model(model, task)),
            "onnx_dir": str(_onnx_dir(zoo, model, task)),
        }
    for name, (cls, model, task) in PATTERNS.items():
        cases[name] = {
            "matrix": "main",
            "kind": _kind(name),
            "class": cls,
            "model": model,
            "model_dir": str(zoo.model(model, task)),
            "onnx_dir": str(zoo.onnx(model, task)),
        }
    for name, (cls, model, task, load_kwargs) in GENERATE.items():
        cases[name] = {
            "matrix": "main",
            "kind": "generate",
            "class": cls,
            "model": model,
            "load_kwargs": load_kwargs,
            "model_dir": str(zoo.model(model, "text2text-generation" if task == "merged" else task)),
            "onnx_dir": str(_onnx_dir(zoo, model, task)),
        }
    return cases


def _run(tmp_path_factory, zoo, engine: str) -> tuple[dict, list[dict]]:
    scratch = tmp_path_factory.mktemp(f"matrix-{engine}")
    environment = sdk_environment(scratch, ipus=4)
    spec = scratch / "spec.json"
    spec.write_text(json.dumps({"runs": _runs(engine), "cases": _cases(zoo, scratch, engine)}))
    script = Path(__file__).with_name("ortmodel_matrix.py")
    completed = python(
        f"import runpy, sys; sys.argv = ['matrix', {str(spec)!r}]; "
        f"runpy.run_path({str(script)!r}, run_name='__main__')",
        # one worker serves every model in turn (it waits for the next session instead of stopping)
        timeout=2400,  # up to 54 model loads and their compiles; a shared 2-core machine can take long
        # The test run's cache (OPTIMUM_IPU_CACHE): the emulator matrices' entries hold the graphs
        # legalized for the same models and shapes, which the engines compile without legalizing again.
        env={**environment, "OPTIMUM_IPU_WORKER_IDLE_SECONDS": "60"},
    )
    assert completed.returncode == 0, completed.stderr[-5000:]
    results = json.loads(completed.stdout.strip().splitlines()[-1])
    (scratch / "seconds.json").write_text(
        json.dumps({key: result["seconds"] for key, result in results.items()})
    )
    return results, call_log(environment)


def _check_sessions(result: dict, device: str, engine: str) -> None:
    assert "error" not in result, result.get("error")
    assert result["provider"] == "IPUExecutionProvider"
    assert result["sessions"], "no session found on the model"
    for session in result["sessions"]:
        options = session["options"]
        assert (options["device"], options["engine"], options["emulated"]) == (device, engine, "0")
        assert options["sdk_version"] == f"{engine} 3.4.0"
    assert result["fallback_warnings"] == []


def _kind(name: str) -> str:
    """How a case is judged: "forward" (outputs), "generate" (tokens) or "diffusion" (images)."""
    if name in CLASS_CASES:
        return CLASS_CASES[name].kind
    if name in PATTERNS:
        return "generate" if "generation" in PATTERNS[name][2] else "forward"
    return "forward" if name in FORWARD else "generate"


def _failures(results: dict, engine: str) -> list[str]:
    """Every case run: the session facts, then CPU tolerance, identical tokens or the same image."""
    failures = []
    for device, _, name in _runs(engine):
        result = results[f"{device}/{engine}/{name}"]
        try:
            _check_sessions(result, device, engine)
            kind = _kind(name)
            if kind == "forward":
                atol = CLASS_ATOL if name in CLASS_CASES else ATOL
                if engine == "poptorch":
                    atol += TORCH_RTOL * result["max_abs_expected"]
                largest = result["max_abs_expected"]
                assert result["max_abs_diff"] <= atol, (
                    f"max abs diff {result['max_abs_diff']} > {atol} (largest output {largest})"
                )
            elif kind == "diffusion":
                assert result["max_abs_diff"] <= IMAGE_ATOL, f"image diff {result['max_abs_diff']}"
                assert result["image_std"] > 0.01, "a flat image cannot tell providers apart"
            else:
                assert result["tokens_equal"], f"tokens differ from CPU: {result['expected_tokens']}"
                assert result["distinct_tokens"] >= 3, "degenerate generation"
                if engine == "poptorch":
                    _check_modes_and_cache(result)
        except AssertionError as exc:
            failures.append(f"{device}/{engine}/{name}: {str(exc)[-3000:]}")
    return failures


def _check_modes_and_cache(result: dict) -> None:
    """Greedy, 4 beams and seeded sampling on one row give CPU's tokens too, and every decoder session that
    carries a past kept it on the device for its decoding steps (PopTorch: float buffers, named in order),
    unless the padding proof refuses to pad its past, on any engine (positions counted from the past
    length): the verdict then says the cache is streamed."""
    assert result["modes"] and all(result["modes"].values()), f"modes that differ from CPU: {result['modes']}"
    for session in result["sessions"]:
        verdict = session["kv_cache"]
        if verdict is None:
            continue
        if session["device_cache_calls"] > 0:
            assert verdict.startswith("the key/value cache stays on the device"), verdict
        else:
            assert verdict == (
                "the key/value cache is streamed: padding the past is not proven invisible for these calls"
            ), verdict


def check_engine(tmp_path_factory, zoo, engine: str) -> None:
    """Every run of the matrix on ``engine`` in one interpreter, judged case by case, then the SDK calls
    the engine made (PopART's documented call order; PopTorch's options)."""
    results, log = _run(tmp_path_factory, zoo, engine)
    failures = _failures(results, engine)
    assert not failures, "\n\n".join(failures)
    if engine == "popart":
        _check_popart_call_log(log)
    else:
        _check_poptorch_options(log)


def _check_popart_call_log(log: list[dict]) -> None:
    """PopART's documented call order: GraphTransformer(path).convertINT64ToINT32(clip=True), DataFlow
    with All anchors, a new SessionOptions, the device, InferenceSession(bytes, ...), prepareDevice,
    weightsFromHost, initAnchorArrays, then PyStepIO runs with C-contiguous arrays."""
    calls = [entry["call"] for entry in log]
    sessions = [index for index, call in enumerate(calls) if call == "InferenceSession.__init__"]
    assert sessions, "no PopART session was created"
    for index in sessions:
        before = calls[max(0, index - 6) : index]
        assert before[-2:] == ["GraphTransformer.__init__", "GraphTransformer.convertINT64ToINT32"], before
        assert calls[index + 1 : index + 2] == ["InferenceSession.prepareDevice"]
        after = [c for c in calls[index + 1 : index + 8] if c.startswith("InferenceSession.")]
        wanted = (
            "InferenceSession.prepareDevice",
            "InferenceSession.weightsFromHost",
            "InferenceSession.initAnchorArrays",
        )
        order = [c for c in after if c in wanted]
        assert order[:3] == [
            "InferenceSession.prepareDevice",
            "InferenceSession.weightsFromHost",
            "InferenceSession.initAnchorArrays",
        ]
    for entry in log:
        if entry["call"] == "GraphTransformer.__init__":
            assert entry["arg_type"] == "str" and entry["is_path"]
        if entry["call"] == "GraphTransformer.convertINT64ToINT32":
            assert entry["clip"] is True
        if entry["call"] == "InferenceSession.__init__":
            assert entry["fnModel_type"] == "bytes" and entry["deviceInfo_type"] == "DeviceInfo"
            assert entry["default_options"] is False, "the import-time default SessionOptions was used"
            assert set(entry["anchors"].values()) == {"All"}
            assert entry["options"]["partialsTypeMatMuls"] == "float"
            assert entry["options"]["enableEngineCaching"] is (entry["device"]["type"] == "Ipu")
            if entry["device"]["type"] == "IpuModel":
                assert entry["device"]["tilesPerIPU"] == 1472
        if entry["call"] == "InferenceSession.run":
            assert all(arg["c_contiguous"] for arg in entry["inputs"].values())
        if entry["call"] == "DeviceManager.createIpuModelDevice":
            assert entry["options"] == {"numIPUs": 1, "tilesPerIPU": 1472}
            assert entry["types"] == {"numIPUs": "int", "tilesPerIPU": "int"}
    assert "DeviceManager.enumerateDevices" in calls
    assert "DeviceInfo.detach" in calls


def _check_poptorch_options(log: list[dict]) -> None:
    compiles = [entry for entry in log if entry["call"] == "poptorch.compile"]
    assert compiles
    for entry in compiles:
        assert entry["outputMode"] == "All" and entry["partials"] == "torch.float32"
        assert (entry["deviceIterations"], entry["replicationFactor"]) == (1, 1)
        assert entry["ipuModel"] is (entry["cachePath"] is None)
