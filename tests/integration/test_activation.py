"""Activation without user code: .pth, torch.backends, late import, opt-out, and loud failure when
optimum-onnx's internals are not what the patches expect."""

from __future__ import annotations

import json

import pytest
from subprocess_env import python, python_checks, python_json

from integration.one_node import save_one_node_model

PATCH_STATE = """
import json, sys
import optimum.onnxruntime.utils as utils, optimum.onnxruntime.base as base
import optimum.onnxruntime.modeling as modeling, optimum.onnxruntime.modeling_decoder as decoder
import optimum.onnxruntime.modeling_seq2seq as seq2seq
flag = "__optimum_provider_plugin_original__"
print(json.dumps({
    "utils.validate": hasattr(utils.validate_provider_availability, flag),
    "base.validate": hasattr(base.validate_provider_availability, flag),
    "base.IOBinding": hasattr(base.IOBinding, flag),
    "modeling.InferenceSession": hasattr(modeling.InferenceSession, flag),
    "decoder.InferenceSession": hasattr(decoder.InferenceSession, flag),
    "seq2seq.InferenceSession": hasattr(seq2seq.InferenceSession, flag),
}))
"""


def test_interpreter_start_installs_the_hook_and_imports_nothing_heavy():
    state = python_json(
        """
        import json, sys
        hooked = any(type(f).__name__ == "_PostImportPatcher" for f in sys.meta_path)
        names = ("torch", "onnx", "onnxruntime", "numpy", "optimum", "popart")
        heavy = sorted(m for m in names if m in sys.modules)
        print(json.dumps({"hooked": hooked, "heavy": heavy}))
        """
    )
    assert state == {"hooked": True, "heavy": []}


def _last_json(result) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_pth_activation_patches_every_target_module(activated_interpreter):
    state = _last_json(activated_interpreter["pth"])
    assert all(state.values()), state


def test_torch_backends_entry_point_activates_without_pth():
    # -S skips .pth files; only torch's entry-point autoload can activate the plugin here.
    state = python_json(PATCH_STATE, no_site=True)
    assert all(state.values()), state
    # Control: with torch's autoload off and no .pth, nothing patches optimum.
    control = python_json(PATCH_STATE, no_site=True, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert not any(control.values()), control


def test_explicit_install_after_optimum_was_imported():
    code = (
        "import optimum.onnxruntime.modeling, optimum.onnxruntime.utils, optimum.onnxruntime.base\n"
        "import optimum_ipu_backend; assert optimum_ipu_backend.install() is True\n" + PATCH_STATE
    )
    state = python_json(code, no_site=True, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert all(state.values()), state


def test_plugins_env_zero_disables_activation_and_ipu_is_refused_by_optimum():
    checks = python_checks(
        {
            "state": PATCH_STATE,
            "ipu": """
            from optimum.onnxruntime.utils import prepare_providers_and_provider_options
            prepare_providers_and_provider_options(provider="ipu")
            """,
        },
        env={"OPTIMUM_PROVIDER_PLUGINS": "0"},
    )
    state = _last_json(checks["state"])
    assert not any(state.values()), state
    result = checks["ipu"]
    assert result.returncode != 0
    assert "Asked to use ipu as an ONNX Runtime execution provider" in result.stderr


def test_changed_optimum_internals_fail_loudly_instead_of_running_on_cpu(tmp_path):
    # Simulate an optimum-onnx whose modeling module no longer has the InferenceSession global.
    result = python(
        """
        import optimum.onnxruntime.modeling as modeling
        modeling.create_inference_session = modeling.InferenceSession
        del modeling.InferenceSession
        import optimum_ipu_backend
        optimum_ipu_backend.install()
        # Run optimum's provider preparation from the modeling module, as its from_pretrained does.
        exec("prepare_providers_and_provider_options(provider='ipu')", vars(modeling))
        """,
        no_site=True,
        env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
    )
    assert result.returncode != 0
    # The error names what is missing and which optimum-onnx versions are supported.
    assert "optimum.onnxruntime.modeling" in result.stderr
    assert "InferenceSession" in result.stderr
    assert ">=0.1,<0.2" in result.stderr


# -- the patches fail closed (issue 8, item 2) ------------------------------------------------------------


SCAN_CALLERS = """
import importlib, json, pkgutil, types
import optimum.onnxruntime
from optimum_ipu_backend._bootstrap import PATCHED_GLOBALS
names = {name for names in PATCHED_GLOBALS.values() for name in names}
def code_names(code):
    found = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= code_names(const)
    return found
callers = {}
for info in pkgutil.walk_packages(optimum.onnxruntime.__path__, "optimum.onnxruntime."):
    try:
        module = importlib.import_module(info.name)
    except Exception:
        continue  # optional extras (training, diffusers) that are not installed
    used = set()
    for value in vars(module).values():
        functions = []
        if isinstance(value, type) and value.__module__ == module.__name__:
            functions = [v for v in vars(value).values() if isinstance(v, types.FunctionType)]
        elif isinstance(value, types.FunctionType) and value.__module__ == module.__name__:
            functions = [value]
        for function in functions:
            used |= code_names(function.__code__) & names
    if used:
        callers[info.name] = sorted(used)
print(json.dumps({"callers": callers, "patched": {k: list(v) for k, v in PATCHED_GLOBALS.items()}}))
"""


UNLISTED_MODULE = """
import sys, types
import onnxruntime
import optimum.onnxruntime.modeling  # the patched modules, as a real from_pretrained would have them
module = types.ModuleType("optimum.onnxruntime.modeling_newkind")
sys.modules[module.__name__] = module
exec('''
from onnxruntime import InferenceSession
from optimum.onnxruntime.utils import prepare_providers_and_provider_options
def load(path):
    providers, options = prepare_providers_and_provider_options(
        provider="ipu", provider_options={"device": "emulator"})
    return InferenceSession(path, providers=providers, provider_options=options)
''', vars(module))
session = module.load(PATH)
print("created", session.get_providers())
"""


VALIDATED_ELSEWHERE = """
loader = (
    "def load(path):\\n"
    "    import onnxruntime\\n"
    "    providers, options = prepare_providers_and_provider_options(provider='ipu')\\n"
    "    return onnxruntime.InferenceSession(path, providers=providers, provider_options=options)\\n"
)
import onnxruntime, optimum.onnxruntime.modeling as modeling
exec(loader, vars(modeling))
session = modeling.load(PATH)
print("created", session.get_providers())
"""


@pytest.fixture(scope="module")
def activated_interpreter(tmp_path_factory) -> dict:
    """One interpreter activated by the installed .pth, as a user's is, for the checks that need nothing
    else (no environment variable, no import order of their own) and cannot interfere: the patch state
    first (before the scan imports every optimum-onnx module), then the scan, then the two refusals."""
    path = repr(str(save_one_node_model(tmp_path_factory.mktemp("activation") / "model.onnx")))
    return python_checks(
        {
            "pth": PATCH_STATE,
            "scan": SCAN_CALLERS,
            "unlisted": UNLISTED_MODULE.replace("PATH", path),
            "validated": VALIDATED_ELSEWHERE.replace("PATH", path),
        }
    )


def test_one_list_of_patched_modules_drives_the_finder_and_the_patches():
    from optimum_ipu_backend import _bootstrap
    from optimum_ipu_backend.integration import patches

    assert _bootstrap.TARGET_MODULES == frozenset(_bootstrap.PATCHED_GLOBALS)
    assert patches.PATCHED_GLOBALS is _bootstrap.PATCHED_GLOBALS
    patched_names = {name for names in _bootstrap.PATCHED_GLOBALS.values() for name in names}
    assert patched_names == set(patches._WRAPPERS)
    assert set(patches.SESSION_MODULES) == {
        module for module, names in _bootstrap.PATCHED_GLOBALS.items() if "InferenceSession" in names
    }


def test_every_optimum_module_that_calls_a_patched_name_is_on_the_list(activated_interpreter):
    # A new optimum-onnx module that creates sessions or validates providers must be patched, or the
    # list must say why not: find every module whose code calls one of the names we patch.
    state = _last_json(activated_interpreter["scan"])
    assert state["callers"], "found no optimum-onnx module calling a patched name: the scan is broken"
    for module, used in state["callers"].items():
        assert module in state["patched"], f"{module} calls {used} and is not patched"
        assert set(used) <= set(state["patched"][module]), (module, used, state["patched"][module])


def test_a_session_creating_module_outside_the_list_is_refused_with_its_name(activated_interpreter):
    result = activated_interpreter["unlisted"]
    assert result.returncode != 0, result.stdout  # before: a CPU session and a printed line
    assert "IntegrationError" in result.stderr
    assert "optimum.onnxruntime.modeling_newkind" in result.stderr
    assert "does not patch" in result.stderr


def test_a_validated_provider_that_reaches_onnxruntime_is_refused_with_the_module(activated_interpreter):
    # A listed module whose session is created some other way (a new helper): onnxruntime's own
    # InferenceSession refuses the plugin name instead of running on the CPU.
    result = activated_interpreter["validated"]
    assert result.returncode != 0, result.stdout
    assert (
        "IntegrationError: module optimum.onnxruntime.modeling created an onnxruntime.InferenceSession"
        in result.stderr
    )
    assert "provider 'ipu'" in result.stderr


def test_optimum_onnx_outside_the_checked_range_is_reported(monkeypatch, caplog):
    from optimum_ipu_backend.integration import patches

    assert patches.optimum_onnx_supported() is True  # the version this environment installs
    monkeypatch.setattr(patches, "optimum_onnx_version", lambda: "0.3.0")
    monkeypatch.setattr(patches, "_version_checked", False)
    assert patches.optimum_onnx_supported() is False
    with caplog.at_level("WARNING", logger=patches.__name__):
        patches._check_version_once()
        patches._check_version_once()
    messages = [r.getMessage() for r in caplog.records if "outside the range" in r.getMessage()]
    assert messages == [
        "optimum-onnx 0.3.0 is outside the range >=0.1,<0.2 that optimum-ipu-backend's patches were checked "
        "against. The patches still refuse to run a provider plugin when optimum-onnx's internals differ "
        "from what they expect; report what you see."
    ]
