"""Another vendor's provider and a broken one, installed as real distributions next to ours."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from subprocess_env import python, python_json


def _compare_code(model_dir: Path, onnx_dir: Path, provider_lines: str) -> str:
    return f"""
        import json, numpy as np, torch, onnxruntime
        from optimum.onnxruntime import ORTModelForSequenceClassification as Cls
        from optimum_ipu_backend.conformance.zoo import preprocessed_inputs
        inputs = {{k: torch.from_numpy(v) for k, v in preprocessed_inputs({str(model_dir)!r}).items()}}
        cpu = Cls.from_pretrained({str(onnx_dir)!r}, provider="CPUExecutionProvider")
        expected = cpu(**inputs).logits
        out = {{"cpu_session_type": type(cpu.model).__module__ + "." + type(cpu.model).__name__}}
        raw = onnxruntime.InferenceSession({str(onnx_dir / "model.onnx")!r},
                                           providers=["CPUExecutionProvider"])
        feed = {{k: v.numpy() for k, v in inputs.items()}}
        out["cpu_vs_raw_ort"] = float(np.abs(raw.run(None, feed)[0] - expected.numpy()).max())
        def attempt(name, **kwargs):
            try:
                model = Cls.from_pretrained({str(onnx_dir)!r}, **kwargs)
                diff = float((model(**inputs).logits - expected).abs().max())
                options = {{k: dict(v) for k, v in model.model.get_provider_options().items()}}
                out[name] = {{"provider": model.provider, "diff": diff, "options": options}}
            except Exception as exc:
                out[name] = {{"error": type(exc).__name__ + ": " + str(exc)}}
        {provider_lines}
        print(json.dumps(out))
    """


def test_second_vendor_provider_works_beside_ipu_and_broken_one_is_isolated(bert):
    model_dir, onnx_dir = bert
    code = _compare_code(
        model_dir,
        onnx_dir,
        "attempt('npu', provider='npu', provider_options={'cores': 2}); "
        "attempt('ipu', provider='ipu', provider_options={'device': 'emulator'}); "
        "attempt('broken', provider='broken')",
    )
    result = python(code, plugins=True)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    # the second vendor's provider is discovered and dispatched, with its options
    assert out["npu"]["provider"] == "AcmeNPUExecutionProvider"
    assert out["npu"]["diff"] <= 1e-5
    assert out["npu"]["options"] == {"AcmeNPUExecutionProvider": {"cores": "2"}}
    # ours still works in the same process
    assert out["ipu"]["provider"] == "IPUExecutionProvider" and out["ipu"]["diff"] <= 1e-5
    # native CPU sessions are onnxruntime's own, with onnxruntime's results
    assert out["cpu_session_type"] == "onnxruntime.capi.onnxruntime_inference_collection.InferenceSession"
    assert out["cpu_vs_raw_ort"] == 0.0
    # the broken plugin: logged once, and asking for it names distribution, entry point and cause
    assert result.stderr.count("libbrokenaccel.so") == 1, result.stderr
    error = out["broken"]["error"]
    assert error.startswith("ProviderPluginError")
    assert "broken-provider 0.0.1" in error and "broken = broken_provider:SPEC" in error
    assert "ImportError: libbrokenaccel.so" in error


def test_plugins_env_limits_which_plugins_load(bert):
    model_dir, onnx_dir = bert
    code = _compare_code(
        model_dir,
        onnx_dir,
        "attempt('npu', provider='npu'); "
        "attempt('ipu', provider='ipu', provider_options={'device': 'emulator'})",
    )
    out = python_json(code, plugins=True, env={"OPTIMUM_PROVIDER_PLUGINS": "npu"})
    assert out["npu"]["provider"] == "AcmeNPUExecutionProvider"
    assert "Asked to use ipu as an ONNX Runtime execution provider" in out["ipu"]["error"]
    out = python_json(code, plugins=True, env={"OPTIMUM_PROVIDER_PLUGINS": "0"})
    assert "Asked to use npu" in out["npu"]["error"] and "Asked to use ipu" in out["ipu"]["error"]


def test_ipu_without_device_option_is_an_error_not_a_cpu_run(bert):
    model_dir, onnx_dir = bert
    code = _compare_code(model_dir, onnx_dir, "attempt('ipu', provider='ipu')")
    out = python_json(code)
    error = out["ipu"]["error"]
    assert error.startswith("DeviceUnavailableError") and "OPTIMUM_IPU_DEVICE=emulator" in error
    env_out = python_json(code, env={"OPTIMUM_IPU_DEVICE": "emulator"})
    assert env_out["ipu"]["provider"] == "IPUExecutionProvider" and env_out["ipu"]["diff"] <= 1e-5


def _cli(*args: str, plugins: bool = False) -> subprocess.CompletedProcess:
    return python(
        f"import sys; from optimum_ipu_backend.cli.main import main; sys.exit(main({list(args)!r}))",
        plugins=plugins,
    )


def test_cli_providers_lists_plugins_devices_and_broken_ones():
    result = _cli("providers", "--json", plugins=True)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    by_name = {p["name"]: p for p in report["providers"]}
    assert by_name["AcmeNPUExecutionProvider"]["distribution"] == "acme-npu-provider"
    assert by_name["AcmeNPUExecutionProvider"]["version"] == "0.3.0"
    ipu = by_name["IPUExecutionProvider"]
    assert ipu["distribution"] == "optimum-ipu-backend" and ipu["available"] is False
    devices = {row["device"]: row for row in ipu["devices"]}
    assert devices["emulator"]["usable"] and devices["emulator"]["emulated"] is True
    assert not devices["ipu"]["usable"] and "Poplar SDK" in devices["ipu"]["why"]
    assert [b["distribution"] for b in report["broken"]] == ["broken-provider"]
    assert "libbrokenaccel.so" in report["broken"][0]["error"]
    text = _cli("providers", plugins=True).stdout
    assert "EMULATION on the host CPU" in text and "BROKEN plugin broken" in text


def test_console_script_is_installed():
    exe = shutil.which("optimum-ipu", path=str(Path(sys.executable).parent))
    assert exe, "the optimum-ipu console script is not installed"
    result = subprocess.run([exe, "providers"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "IPUExecutionProvider" in result.stdout
