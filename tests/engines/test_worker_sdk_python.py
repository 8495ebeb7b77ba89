"""The SDK worker on another interpreter (``sdk_python`` / ``OPTIMUM_IPU_SDK_PYTHON``).

On an SDK 3.4 host the SDK's Python holds PopTorch and its pinned torch, and the user's optimum stack
lives in another environment (engines/worker.py says why). Here the second environment is a virtual
environment holding numpy, onnx, torch and what they need at run time (links into this environment), plus
the SDK double on ``PYTHONPATH`` as the SDK's enable script would put the SDK there, and nothing else: no
transformers, optimum or onnxruntime, and not this package, which the worker gets from the host alone.
Building it costs a ``venv --without-pip`` and a few links, offline.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import distribution
from pathlib import Path

import pytest
from full_matrix import Matrix
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from sdk_testing import sdk_environment, use_sdk_double

import optimum_ipu_backend
from optimum_ipu_backend.cli.env import worker_python_report
from optimum_ipu_backend.engines import load_engine
from optimum_ipu_backend.engines.probe import (
    SDK_PYTHON_ENV,
    module_origin,
    probe_sdk,
    resolve_device,
    resolve_sdk_python,
)
from optimum_ipu_backend.engines.worker import package_path_entry, worker_environment
from optimum_ipu_backend.errors import ConfigurationError
from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions, ProviderOptionError

# What the SDK's Python holds besides the SDK: what the engines' worker side imports.
SDK_ENV_PACKAGES = ("numpy", "onnx", "torch")
ABSENT = ("transformers", "optimum", "onnxruntime", "optimum_ipu_backend")


def _runtime_closure(names: tuple[str, ...]) -> dict[str, object]:
    """The installed distributions ``names`` need at run time (no extras), by canonical name."""
    found: dict[str, object] = {}
    pending = list(names)
    while pending:
        name = canonicalize_name(pending.pop())
        if name in found:
            continue
        dist = distribution(name)
        found[name] = dist
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return found


def make_sdk_environment(root: Path) -> Path:
    """A virtual environment whose site-packages reaches numpy, onnx, torch and their run-time
    dependencies only (a .pth naming a directory of links into this environment); its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    links = root / "sdk-packages"
    links.mkdir()
    for dist in _runtime_closure(SDK_ENV_PACKAGES).values():
        tops = {Path(str(file)).parts[0] for file in dist.files or ()}
        for top in sorted(tops):
            if top in ("..", "__pycache__") or top.endswith(".pth"):
                continue  # scripts, byte code, and start-up hooks of this environment
            source = Path(dist.locate_file(top))
            if source.exists() and not (links / top).exists():
                (links / top).symlink_to(source)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "sdk-packages.pth").write_text(f"{links}\n")
    return python


@pytest.fixture(scope="module")
def sdk_python(tmp_path_factory) -> str:
    return str(make_sdk_environment(tmp_path_factory.mktemp("sdk-python") / "venv"))


def _imports(python: str, names, env: dict[str, str], cwd: Path) -> dict[str, bool]:
    code = (
        "import importlib.util, json, sys\n"
        "print(json.dumps({n: importlib.util.find_spec(n) is not None for n in sys.argv[1:]}))"
    )
    completed = subprocess.run(  # not from the repository: `-c` puts the working directory on the path
        [python, "-c", code, *names], capture_output=True, text=True, check=True, env=env, timeout=60, cwd=cwd
    )
    return json.loads(completed.stdout)


def test_the_second_environment_has_the_sdk_side_and_nothing_of_the_user_stack(sdk_python, tmp_path):
    environment = {**os.environ, **sdk_environment(tmp_path)}
    found = _imports(sdk_python, (*SDK_ENV_PACKAGES, *ABSENT, "popart", "poptorch"), environment, tmp_path)
    assert found == {
        **dict.fromkeys(SDK_ENV_PACKAGES, True),
        **dict.fromkeys(ABSENT, False),
        "popart": True,
        "poptorch": True,
    }
    for name in ("transformers", "optimum", "onnxruntime"):  # imports fail there, not only look-ups
        completed = subprocess.run(
            [sdk_python, "-c", f"import {name}"], capture_output=True, env=environment, cwd=tmp_path
        )
        assert completed.returncode != 0, name


# -- the option and the variable -------------------------------------------------------------------------


def test_sdk_python_defaults_to_this_interpreter_and_follows_the_variable(sdk_python, monkeypatch):
    monkeypatch.delenv(SDK_PYTHON_ENV, raising=False)
    assert resolve_sdk_python() == sys.executable
    monkeypatch.setenv(SDK_PYTHON_ENV, sdk_python)
    assert resolve_sdk_python() == sdk_python
    assert resolve_sdk_python(sys.executable) == sys.executable  # the option wins over the variable
    options = IPUProviderOptions.parse({"device": "ipu-model", "sdk_python": sdk_python})
    assert options.sdk_python == sdk_python


@pytest.mark.parametrize("problem", ["missing", "not executable"])
def test_an_unusable_sdk_python_names_the_option_and_the_variable(problem, tmp_path, monkeypatch):
    path = tmp_path / "python"
    if problem == "not executable":
        path.write_text("")
        path.chmod(0o644)
    with pytest.raises(ProviderOptionError) as info:
        IPUProviderOptions.parse({"device": "ipu-model", "sdk_python": str(path)})
    message = str(info.value)
    assert "'sdk_python'" in message and SDK_PYTHON_ENV in message and str(path) in message
    monkeypatch.setenv(SDK_PYTHON_ENV, str(path))
    with pytest.raises(ConfigurationError, match=f"environment variable {SDK_PYTHON_ENV}"):
        resolve_sdk_python()
    with pytest.raises(ConfigurationError, match="sdk_python"):
        load_engine("popart", "ipu-model")
    # the probe reports it instead of raising, so `optimum-ipu env` and provider discovery still work
    assert SDK_PYTHON_ENV in "\n".join(probe_sdk().lines())


def test_the_probe_looks_for_the_sdk_in_the_sdk_python(sdk_python, tmp_path, monkeypatch):
    """This interpreter does not see the double; the SDK's Python does (its PYTHONPATH)."""
    monkeypatch.setenv("PYTHONPATH", sdk_environment(tmp_path)["PYTHONPATH"])
    monkeypatch.delenv(SDK_PYTHON_ENV, raising=False)
    assert module_origin("popart") is None
    assert module_origin("popart", sdk_python).endswith("popart/__init__.py")
    resolution = resolve_device("ipu-model", sdk_python=sdk_python)
    assert resolution.engine == "popart"
    monkeypatch.setenv(SDK_PYTHON_ENV, sdk_python)
    assert resolve_device("ipu-model", engine="poptorch").engine == "poptorch"
    lines = "\n".join(probe_sdk().lines())
    assert f"Python module popart (in {sdk_python}): " in lines


def test_workers_are_shared_per_sdk_and_interpreter(sdk_python, tmp_path, monkeypatch):
    with use_sdk_double(tmp_path, ipus=4):
        monkeypatch.delenv(SDK_PYTHON_ENV, raising=False)
        here = load_engine("popart", "ipu-model")
        there = load_engine("popart", "ipu-model", sdk_python=sdk_python)
        again = load_engine("popart", "ipu-model", sdk_python=sdk_python)
        try:
            assert here._worker is not there._worker and there._worker is again._worker
            assert here._worker.info["python"] == sys.executable
            assert there._worker.info["python"] == sdk_python
            assert there.sdk_python == sdk_python and there.sdk_version == here.sdk_version
            assert sdk_python in there.describe()
        finally:
            for engine in (here, there, again):
                engine.close()


def test_the_worker_path_holds_this_package_and_the_sdk_not_the_working_directory(tmp_path, monkeypatch):
    """Only a link to this package comes before the user's PYTHONPATH (which holds the SDK); the working
    directory, which ``-c`` would put first, is not on the worker's path."""
    entry = Path(package_path_entry())
    assert [(path.name, path.resolve()) for path in entry.iterdir()] == [
        ("optimum_ipu_backend", Path(optimum_ipu_backend.__file__).resolve().parent)
    ]
    (tmp_path / "cwd").mkdir()
    (tmp_path / "cwd" / "popart.py").write_text(
        "raise ImportError('the working directory was on the path')\n"
    )
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.delenv(SDK_PYTHON_ENV, raising=False)
    with use_sdk_double(tmp_path / "double", ipus=4):
        assert worker_environment()["PYTHONPATH"].split(os.pathsep) == [str(entry), os.environ["PYTHONPATH"]]
        engine = load_engine("popart", "ipu-model")
        try:
            assert engine.sdk_version == "popart 3.4.0"
        finally:
            engine.close()
    shutil.rmtree(entry)  # a cleaner of the temporary directory removed it: the next worker gets another
    assert (
        Path(package_path_entry()) != entry and (Path(package_path_entry()) / "optimum_ipu_backend").is_dir()
    )


def test_the_sdk_python_option_reaches_the_session(sdk_python, tmp_path):
    """The provider option, through the session, to the worker (session.inference_session passes it)."""
    from tiny_models import tiny_model

    from optimum_ipu_backend.session.inference_session import IPUInferenceSession

    model = tiny_model(tmp_path / "model" / "model.onnx", sequence=5)
    with use_sdk_double(tmp_path / "double", ipus=4):
        options = IPUProviderOptions.parse(
            {"device": "ipu-model", "engine": "poptorch", "sdk_python": sdk_python}, model.parent
        )
        session = IPUInferenceSession(str(model), options=options)
        try:
            assert session.engine.sdk_python == sdk_python
            assert session.get_provider_options()["IPUExecutionProvider"]["sdk_python"] == sdk_python
        finally:
            session.close()


# -- optimum-ipu env -------------------------------------------------------------------------------------


def test_env_reports_the_worker_python_and_its_sdk(sdk_python, tmp_path, monkeypatch):
    monkeypatch.setenv(SDK_PYTHON_ENV, sdk_python)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.chdir(tmp_path)  # `-c` puts the working directory on the path; not the repository
    report = worker_python_report()
    assert report["python"] == f"{sdk_python} ({SDK_PYTHON_ENV})"
    assert report["version"] == ".".join(map(str, sys.version_info[:3]))
    assert report["torch"] == distribution("torch").version
    assert report["popart"] == report["poptorch"] == "not found"
    enabled = sdk_environment(tmp_path)
    for name in ("PYTHONPATH", "POPLAR_SDK_ENABLED"):  # what the SDK's enable script sets
        monkeypatch.setenv(name, enabled[name])
    report = worker_python_report()
    assert (report["popart"], report["poptorch"]) == ("3.4.0", "3.4.0")
    monkeypatch.setenv(SDK_PYTHON_ENV, str(tmp_path / "missing"))
    assert worker_python_report()["python"].startswith("unusable: ")


# -- ORTModel classes with their worker on the second environment ------------------------------------------

# (case, device, engine): a BERT classifier and a GPT-2 generation on both engines; by default each engine
# serves one of them, on one device each.
MATRIX = Matrix(
    "worker-on-the-sdk-python",
    product=[
        ("sequence-classification", "ipu", "popart"),
        ("sequence-classification", "ipu-model", "poptorch"),
        ("causal-lm-with-cache", "ipu-model", "popart"),
        ("causal-lm-with-cache", "ipu", "poptorch"),
    ],
    share=[("sequence-classification", "ipu", "popart"), ("causal-lm-with-cache", "ipu", "poptorch")],
    covers={"case": lambda run: run[0], "engine": lambda run: run[2]},
    why="each run loads its model through a worker on the second interpreter",
)
RUNS = list(MATRIX.cases)

# Run by this environment's python (the user's stack); the worker runs on OPTIMUM_IPU_SDK_PYTHON.
_RUNNER = """
import json, sys, traceback, warnings
from pathlib import Path
sys.path.insert(0, INTEGRATION)
import ortmodel_checks as checks
from optimum_ipu_backend.engines import worker
spec = json.loads(Path(SPEC).read_text())
results = {}
for name, device, engine in spec["runs"]:
    checks.IPU = {"provider": "ipu", "provider_options": {"device": device, "engine": engine}}
    check = checks.forward_case if spec["kinds"][name] == "forward" else checks.generate_case
    key = f"{device}/{engine}/{name}"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results[key] = check(spec["cases"][name])
        messages = [str(w.message) for w in caught]
        results[key]["fallback_warnings"] = [m for m in messages if "Falling back" in m]
    except Exception:
        results[key] = {"error": traceback.format_exc()}
    # the workers stay up between cases (OPTIMUM_IPU_WORKER_IDLE_SECONDS): which Python each runs on
    results[key]["worker_pythons"] = sorted({w.info.get("python") for w in worker._workers.values()})
print(json.dumps(results))
"""


def _model_cases(zoo) -> tuple[dict, dict]:
    from integration.test_ortmodels import FORWARD, GENERATE, _onnx_dir

    cls, model, task = FORWARD["sequence-classification"]
    forward = {"class": cls, "model": model, "model_dir": str(zoo.model(model, task))}
    forward["onnx_dir"] = str(_onnx_dir(zoo, model, task))
    cls, model, task, load_kwargs = GENERATE["causal-lm-with-cache"]
    generate = {"class": cls, "model": model, "load_kwargs": load_kwargs}
    generate.update(model_dir=str(zoo.model(model, task)), onnx_dir=str(_onnx_dir(zoo, model, task)))
    return (
        {"sequence-classification": forward, "causal-lm-with-cache": generate},
        {"sequence-classification": "forward", "causal-lm-with-cache": "generate"},
    )


@pytest.fixture(scope="module")
def ortmodel_results(sdk_python, tmp_path_factory, zoo) -> dict:
    from subprocess_env import python

    scratch = tmp_path_factory.mktemp("sdk-python-ortmodels")
    cases, kinds = _model_cases(zoo)
    spec = scratch / "spec.json"
    spec.write_text(json.dumps({"runs": RUNS, "cases": cases, "kinds": kinds}))
    integration = Path(__file__).resolve().parent.parent / "integration"
    completed = python(
        f"SPEC = {str(spec)!r}\nINTEGRATION = {str(integration)!r}\n{_RUNNER}",
        timeout=900,
        env={
            **sdk_environment(scratch, ipus=4),
            SDK_PYTHON_ENV: sdk_python,
            "OPTIMUM_IPU_CACHE": str(scratch / "cache"),
            "OPTIMUM_IPU_WORKER_IDLE_SECONDS": "60",
        },
    )
    assert completed.returncode == 0, completed.stderr[-5000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("name", "device", "engine"), RUNS)
def test_ortmodels_match_cpu_with_the_worker_on_the_sdk_python(
    ortmodel_results, sdk_python, name, device, engine
):
    from engines.ortmodels_on_engines import TORCH_RTOL, _check_sessions
    from integration.test_ortmodels import ATOL

    result = ortmodel_results[f"{device}/{engine}/{name}"]
    _check_sessions(result, device, engine)
    assert result["worker_pythons"] == [sdk_python]
    if name == "sequence-classification":
        atol = ATOL + (TORCH_RTOL * result["max_abs_expected"] if engine == "poptorch" else 0.0)
        assert result["max_abs_diff"] <= atol, (result["max_abs_diff"], atol)
    else:
        assert result["tokens_equal"], result["expected_tokens"]
        assert result["distinct_tokens"] >= 3
