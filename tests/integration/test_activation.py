"""Activation without user code: .pth, torch.backends, late import, opt-out, and loud failure when
optimum-onnx's internals are not what the patches expect."""

from __future__ import annotations

from subprocess_env import python, python_json

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


def test_pth_activation_patches_every_target_module():
    state = python_json(PATCH_STATE)
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
    state = python_json(PATCH_STATE, env={"OPTIMUM_PROVIDER_PLUGINS": "0"})
    assert not any(state.values()), state
    result = python(
        """
        from optimum.onnxruntime.utils import prepare_providers_and_provider_options
        prepare_providers_and_provider_options(provider="ipu")
        """,
        env={"OPTIMUM_PROVIDER_PLUGINS": "0"},
    )
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
