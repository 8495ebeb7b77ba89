"""provider="auto": the best usable provider, with the test-only plugin distributions of tests/plugins/site
(acme-npu-provider, priority 20, always available; nimbus-accel-provider, priority 50, available when
NIMBUS_DEVICE=card, emulated when NIMBUS_DEVICE=simulator; broken-provider, which fails to import)."""

from __future__ import annotations

import json
import sys
import types
from importlib import metadata

import pytest
from subprocess_env import python, python_json

from optimum_ipu_backend.engines.base import Availability
from optimum_ipu_backend.integration import auto, native_providers
from optimum_ipu_backend.integration.auto import Candidate, ProviderPreferenceError
from optimum_ipu_backend.integration.discovery import ENTRY_POINT_GROUP, ProviderRegistry

ATOL = 1e-5


# -- the order and the native table, in this process -------------------------------------------------


def _candidate(name: str, origin: str = "onnxruntime", usable: bool = True, priority: int = 0) -> Candidate:
    return Candidate(name, origin, usable, "test", priority)


def test_default_order_is_plugins_by_priority_then_onnxruntime_accelerators_then_cpu():
    candidates = [
        _candidate("AzureExecutionProvider", usable=False),
        _candidate("CUDAExecutionProvider"),
        _candidate("CPUExecutionProvider"),
        _candidate("LowExecutionProvider", "low 1", priority=-5),
        _candidate("ZedExecutionProvider", "zed 1", priority=0),
        _candidate("HighExecutionProvider", "high 1", priority=50),
        _candidate("AbcExecutionProvider", "abc 1", priority=0),
    ]
    order = [c.name for c in auto.default_order(candidates)]
    assert order == [
        "HighExecutionProvider",
        "AbcExecutionProvider",  # plugins of equal priority: by name, before onnxruntime's
        "ZedExecutionProvider",
        "AzureExecutionProvider",  # onnxruntime's own order is kept
        "CUDAExecutionProvider",
        "LowExecutionProvider",  # a negative priority ranks after onnxruntime's accelerators
        "CPUExecutionProvider",
    ]


def test_native_table_never_takes_azure_and_needs_the_device(monkeypatch):
    assert not native_providers.native_availability("AzureExecutionProvider", {}).usable
    assert native_providers.native_availability("CPUExecutionProvider", {}).usable
    monkeypatch.setattr(native_providers, "_device_nodes", lambda pattern: [])
    cuda = native_providers.native_availability("CUDAExecutionProvider", {})
    assert not cuda.usable and "NVIDIA GPU" in cuda.reason and "/dev/nvidia" in cuda.reason
    unknown = native_providers.native_availability("QNNExecutionProvider", {})
    assert not unknown.usable and "cannot be confirmed" in unknown.reason
    # onnxruntime's own device list, or a device node, confirms the device
    assert native_providers.native_availability(
        "QNNExecutionProvider", {"QNNExecutionProvider": ["NPU"]}
    ).usable
    monkeypatch.setattr(
        native_providers, "_device_nodes", lambda pattern: ["/dev/nvidia0"] if "nvidia" in pattern else []
    )
    assert native_providers.native_availability("CUDAExecutionProvider", {}).usable


def test_a_cuda_build_without_gpu_chooses_the_cpu(monkeypatch):
    monkeypatch.setattr(
        auto,
        "available_providers",
        lambda: ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
    )
    monkeypatch.setattr(native_providers, "_device_nodes", lambda pattern: [])
    monkeypatch.setattr(native_providers, "_listed_devices", lambda: {})
    monkeypatch.delenv(auto.PREFERENCE_ENV, raising=False)
    no_plugins = ProviderRegistry(lambda: [])
    choice = auto.choose(no_plugins)
    assert choice.chosen.name == "CPUExecutionProvider"
    assert [c.name for c in choice.passed_over] == ["TensorrtExecutionProvider", "CUDAExecutionProvider"]
    monkeypatch.setattr(native_providers, "_device_nodes", lambda pattern: ["/dev/nvidia0"])
    assert auto.choose(no_plugins).chosen.name == "TensorrtExecutionProvider"


def _registry() -> ProviderRegistry:
    module = types.ModuleType("auto_test_plugins")
    module.FAST = {"name": "FastExecutionProvider", "session_factory": "json:loads", "priority": 5}
    sys.modules["auto_test_plugins"] = module
    return ProviderRegistry(
        lambda: [metadata.EntryPoint("fast", "auto_test_plugins:FAST", ENTRY_POINT_GROUP)]
    )


def test_preference_orders_restricts_and_names_what_is_installed(monkeypatch):
    monkeypatch.setattr(
        auto, "available_providers", lambda: ["AzureExecutionProvider", "CPUExecutionProvider"]
    )
    monkeypatch.setenv(auto.PREFERENCE_ENV, "cpu, fast")
    choice = auto.choose(_registry())
    assert [c.name for c in choice.candidates] == ["CPUExecutionProvider", "FastExecutionProvider"]
    assert choice.chosen.name == "CPUExecutionProvider"
    monkeypatch.setenv(auto.PREFERENCE_ENV, "azure")
    assert auto.choose(_registry()).chosen is None  # restricted to a provider that never computes here
    monkeypatch.setenv(auto.PREFERENCE_ENV, "fast,cuda")
    with pytest.raises(ProviderPreferenceError) as info:
        auto.choose(_registry())
    message = str(info.value)
    assert "'cuda', which is not installed" in message
    assert "FastExecutionProvider (fast)" in message and "CPUExecutionProvider (CPU)" in message


def test_provider_options_with_auto_are_keyed_by_provider_name():
    nimbus = Candidate("NimbusExecutionProvider", "nimbus 1", False, "test", 50, ("nimbus",))
    choice = auto.AutoChoice((nimbus, _candidate("CPUExecutionProvider")))
    given = {"nimbus": {"cores": 2}, "CPUExecutionProvider": {"arena_extend_strategy": "kSameAsRequested"}}
    assert auto.options_for(choice, [given]) == {"arena_extend_strategy": "kSameAsRequested"}
    assert auto.options_for(choice, [{}]) == {}
    with pytest.raises(ValueError, match="keyed by provider name"):
        auto.options_for(choice, {"device": "emulator"})


# -- the test-only plugin distributions, in a fresh interpreter ------------------------------------------

SCENARIOS = """
import json, logging, os, sys, torch
from optimum.onnxruntime import ORTModelForSequenceClassification as Cls
from optimum_ipu_backend.conformance.zoo import preprocessed_inputs
model_dir, onnx_dir, scenarios = json.loads(sys.argv[1])
class Record(logging.Handler):
    def emit(self, record):
        lines.append(record.levelname + " " + record.name + ": " + record.getMessage())
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
logging.getLogger().addHandler(Record(logging.INFO))
inputs = {k: torch.from_numpy(v) for k, v in preprocessed_inputs(model_dir).items()}
expected = Cls.from_pretrained(onnx_dir, provider="CPUExecutionProvider")(**inputs).logits
results = {}
for name, env in scenarios.items():
    for key in ("NIMBUS_DEVICE", "ACME_NPU_ABSENT", "OPTIMUM_IPU_DEVICE", "OPTIMUM_PROVIDER_PREFERENCE"):
        os.environ.pop(key, None)
    os.environ.update(env)
    lines = []
    out = results[name] = {}
    try:
        for _ in range(2):  # the choice is logged once, not per model
            model = Cls.from_pretrained(onnx_dir, provider="auto")
        out["providers"] = [str(p) for p in model.providers]
        out["session_type"] = type(model.model).__module__ + "." + type(model.model).__name__
        out["options"] = model.model.get_provider_options()[model.provider]
        out["diff"] = float((model(**inputs).logits - expected).abs().max())
    except Exception as exc:
        out["error"] = type(exc).__name__ + ": " + str(exc)
    out["choice_log"] = [line for line in lines if "provider='auto' chose" in line]
print(json.dumps(results))
"""

PLUGIN_SCENARIOS = {
    "higher-priority-wins": {"NIMBUS_DEVICE": "card"},
    "unavailable-passed-over": {},
    "none-usable": {"ACME_NPU_ABSENT": "1"},
    "emulation": {
        "OPTIMUM_IPU_DEVICE": "emulator",
        "NIMBUS_DEVICE": "simulator",
        "OPTIMUM_PROVIDER_PREFERENCE": "ipu,nimbus,cpu",
    },
    "reordered": {"NIMBUS_DEVICE": "card", "OPTIMUM_PROVIDER_PREFERENCE": "npu,nimbus"},
    "restricted": {"OPTIMUM_PROVIDER_PREFERENCE": "nimbus,cpu"},
    "restricted-to-nothing-usable": {"OPTIMUM_PROVIDER_PREFERENCE": "nimbus"},
    "not-installed": {"OPTIMUM_PROVIDER_PREFERENCE": "cuda,cpu"},
}


def _run_scenarios(bert, scenarios: dict, **kwargs) -> tuple[dict, str]:
    model_dir, onnx_dir = bert
    argument = json.dumps([str(model_dir), str(onnx_dir), scenarios])
    result = python(f"import sys; sys.argv = ['auto', {argument!r}]\n" + SCENARIOS, **kwargs)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


# The conformance suite's test providers (faithful, perturbed) are always usable: they would win every
# scenario, so only the plugins these scenarios are about are loaded.
AUTO_PLUGINS = "ipu,nimbus,npu,broken"


@pytest.fixture(scope="module")
def with_plugins(bert):
    return _run_scenarios(
        bert, PLUGIN_SCENARIOS, plugins=True, env={"OPTIMUM_PROVIDER_PLUGINS": AUTO_PLUGINS}
    )


def test_available_higher_priority_plugin_wins_beside_a_broken_one(with_plugins):
    results, stderr = with_plugins
    out = results["higher-priority-wins"]
    assert out["providers"] == ["NimbusExecutionProvider"], out
    assert out["diff"] <= ATOL
    assert out["options"]["auto"].endswith("Nimbus card 0 found (test double)")
    # broken-provider failed to import (logged once), and auto still chose
    warnings = [
        line for line in stderr.splitlines() if line.startswith("WARNING") and "libbrokenaccel" in line
    ]
    assert len(warnings) == 1, stderr
    (line,) = out["choice_log"]  # logged once for two models
    assert line.startswith("INFO optimum_ipu_backend.integration.auto: provider='auto' chose Nimbus")


def test_unavailable_plugin_is_passed_over_with_its_reason_logged(with_plugins):
    out = with_plugins[0]["unavailable-passed-over"]
    assert out["providers"] == ["AcmeNPUExecutionProvider"] and out["diff"] <= ATOL
    (line,) = out["choice_log"]
    assert "passed over: NimbusExecutionProvider: no Nimbus card: /dev/nimbus0 not found" in line
    assert "NimbusExecutionProvider: no Nimbus card" in out["options"]["auto_passed_over"]


def test_with_no_usable_plugin_auto_is_the_cpu(with_plugins):
    out = with_plugins[0]["none-usable"]
    assert out["providers"] == ["CPUExecutionProvider"], out
    assert out["session_type"] == "onnxruntime.capi.onnxruntime_inference_collection.InferenceSession"
    assert out["diff"] == 0.0
    passed = out["options"]["auto_passed_over"]
    for reason in (
        "NimbusExecutionProvider: no Nimbus card",
        "AcmeNPUExecutionProvider: no Acme NPU",
        "IPUExecutionProvider: device 'ipu' cannot be used here: engine 'popart': the Python module popart",
        "broken: the plugin failed to load: ImportError: libbrokenaccel.so",
        "AzureExecutionProvider: forwards inference to a remote Azure endpoint",
    ):
        assert reason in passed


def test_emulation_is_never_chosen(with_plugins):
    out = with_plugins[0]["emulation"]
    assert out["providers"] == ["CPUExecutionProvider"], out
    passed = out["options"]["auto_passed_over"]
    assert "IPUExecutionProvider: its default device is emulated" in passed
    assert "NimbusExecutionProvider: its default device is emulated" in passed
    assert "emulation is never chosen automatically" in passed


def test_preference_variable_reorders_and_restricts(with_plugins):
    results = with_plugins[0]
    out = results["reordered"]
    assert out["providers"] == ["AcmeNPUExecutionProvider"]  # npu before the higher-priority nimbus
    assert "OPTIMUM_PROVIDER_PREFERENCE=npu,nimbus" in out["options"]["auto"]
    assert results["restricted"]["providers"] == ["CPUExecutionProvider"]  # acme is not a candidate
    error = results["restricted-to-nothing-usable"]["error"]
    assert error.startswith("NoUsableProviderError") and "no Nimbus card" in error
    error = results["not-installed"]["error"]
    assert error.startswith("ProviderPreferenceError") and "'cuda', which is not installed here" in error
    assert "AcmeNPUExecutionProvider (npu)" in error and "IPUExecutionProvider (ipu)" in error


def _providers_cli(*args: str, env: dict[str, str] | None = None):
    return python(
        f"import sys; from optimum_ipu_backend.cli.main import main; sys.exit(main({list(args)!r}))",
        plugins=True,
        env=env,
    )


def test_providers_command_lists_native_providers_and_the_auto_choice():
    result = _providers_cli("providers", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    native = {row["name"]: row for row in report["native"]}
    assert native["CPUExecutionProvider"]["usable"] is True
    assert native["AzureExecutionProvider"]["usable"] is False
    assert report["auto"]["chosen"] == "AcmeNPUExecutionProvider"
    statuses = {row["name"]: row["status"] for row in report["auto"]["order"]}
    assert statuses["NimbusExecutionProvider"] == "passed over"
    assert statuses["AcmeNPUExecutionProvider"] == "chosen"
    assert statuses["broken"] == "not reached" and statuses["CPUExecutionProvider"] == "not reached"
    text = _providers_cli("providers").stdout
    assert "onnxruntime providers:" in text
    assert "AzureExecutionProvider - not usable here: forwards inference to a remote Azure endpoint" in text
    assert "provider='auto' takes AcmeNPUExecutionProvider" in text
    assert (
        "- NimbusExecutionProvider (nimbus-accel-provider 1.2.0, priority 50): passed over: no Nimbus" in text
    )
    # a preference naming an uninstalled provider: reported, exit status 1
    bad = _providers_cli("providers", "--json", env={"OPTIMUM_PROVIDER_PREFERENCE": "cuda"})
    assert bad.returncode == 1
    assert "'cuda', which is not installed" in json.loads(bad.stdout)["auto"]["error"]


# -- every ORTModel class and the pipelines -----------------------------------------------------------

EVERY_CLASS = """
import json, sys, torch, transformers
import optimum.onnxruntime as ort_models
from optimum.pipelines import pipeline as optimum_pipeline
from optimum_ipu_backend.conformance.zoo import preprocessed_inputs
cases = json.loads(sys.argv[1])
out = {}
def flat(value):
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in flat(item)]
    if hasattr(value, "keys"):
        return [t for key in value.keys() for t in flat(value[key])]
    return [] if value is None else [value]
def providers(model):
    parts = [getattr(model, n, None) for n in ("model", "encoder", "decoder", "decoder_with_past")]
    return sorted({p.session.get_providers()[0] if hasattr(p, "session") else p.get_providers()[0]
                   for p in parts if hasattr(p, "get_providers") or hasattr(p, "session")})
for name, case in cases.items():
    cls = getattr(ort_models, case["class"])
    kwargs = case.get("load_kwargs", {})
    cpu = cls.from_pretrained(case["onnx_dir"], provider="CPUExecutionProvider", **kwargs)
    chosen = cls.from_pretrained(case["onnx_dir"], provider="auto", **kwargs)
    arrays = preprocessed_inputs(case["model_dir"], batch=2)
    skip = ("decoder_input_ids", "position_ids")
    inputs = {k: torch.from_numpy(v) for k, v in arrays.items() if k not in skip}
    with torch.no_grad():
        if case["kind"] == "generate":
            inputs.pop("token_type_ids", None)
            gen = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "num_beams": 1}
            same = torch.equal(cpu.generate(**inputs, **gen), chosen.generate(**inputs, **gen))
            diff = 0.0 if same else 1.0
        else:
            diff = max(float((a.float() - b.float()).abs().max())
                       for a, b in zip(flat(cpu(**inputs)), flat(chosen(**inputs))))
    out[name] = {"provider": chosen.provider, "session_providers": providers(chosen), "diff": diff}
seq_cls = cases["sequence-classification"]
texts = ["the cat sat on the mat", "a quick brown fox jumps over the lazy dog today"]
tokenizer = transformers.AutoTokenizer.from_pretrained(seq_cls["model_dir"])
cpu = ort_models.ORTModelForSequenceClassification.from_pretrained(seq_cls["onnx_dir"])
expected = transformers.pipeline("text-classification", model=cpu, tokenizer=tokenizer, top_k=None)(texts)
chosen = ort_models.ORTModelForSequenceClassification.from_pretrained(seq_cls["onnx_dir"], provider="auto")
via_transformers = transformers.pipeline("text-classification", model=chosen, tokenizer=tokenizer, top_k=None)
via_optimum = optimum_pipeline("text-classification", model=seq_cls["onnx_dir"], tokenizer=tokenizer,
                               accelerator="ort", model_kwargs={"provider": "auto"}, top_k=None)
def scores(rows):
    return [[d["score"] for d in sorted(row, key=lambda d: d["label"])] for row in rows]
def gap(rows):
    return max(abs(a - b) for x, y in zip(scores(expected), scores(rows)) for a, b in zip(x, y))
out["pipelines"] = {"transformers": gap(via_transformers(texts)), "optimum": gap(via_optimum(texts)),
                    "optimum_provider": via_optimum.model.provider}
print(json.dumps(out))
"""


def test_every_ortmodel_class_and_the_pipelines_take_the_auto_choice(tmp_path_factory, zoo):
    from integration.test_ortmodels import FORWARD, GENERATE, _onnx_dir

    cases = {}
    for name, (cls, model, task) in FORWARD.items():
        if model == "minilm":  # the same class as the bert case; its export path depends on the venv
            continue
        cases[name] = {"kind": "forward", "class": cls, "model": model}
        cases[name].update(model_dir=str(zoo.model(model, task)), onnx_dir=str(_onnx_dir(zoo, model, task)))
    for name, (cls, model, task, load_kwargs) in GENERATE.items():
        build_task = "text2text-generation" if task == "merged" else task
        cases[name] = {"kind": "generate", "class": cls, "model": model, "load_kwargs": load_kwargs}
        cases[name].update(
            model_dir=str(zoo.model(model, build_task)), onnx_dir=str(_onnx_dir(zoo, model, task))
        )
    spec = tmp_path_factory.mktemp("auto") / "cases.json"
    spec.write_text(json.dumps(cases))
    out = python_json(
        f"import sys; sys.argv = ['auto', open({str(spec)!r}).read()]\n" + EVERY_CLASS,
        plugins=True,
        env={"NIMBUS_DEVICE": "card"},
    )
    for name in cases:
        assert out[name]["provider"] == "NimbusExecutionProvider", (name, out[name])
        assert out[name]["session_providers"] == ["NimbusExecutionProvider"], (name, out[name])
        assert out[name]["diff"] <= ATOL, (name, out[name])
    assert out["pipelines"]["transformers"] <= ATOL and out["pipelines"]["optimum"] <= ATOL
    assert out["pipelines"]["optimum_provider"] == "NimbusExecutionProvider"


def test_the_ipu_probe_wants_ipu_hardware_and_reports_host_devices_as_emulated(monkeypatch):
    from types import SimpleNamespace

    from optimum_ipu_backend.engines import probe as engine_probe
    from optimum_ipu_backend.integration import ipu_provider

    monkeypatch.setattr(engine_probe, "provider_availability", lambda: (True, "PopART found (test)"))
    monkeypatch.delenv("OPTIMUM_IPU_DEVICE", raising=False)
    monkeypatch.setattr(engine_probe, "probe_sdk", lambda: SimpleNamespace(hardware_visible=False))
    build_host = ipu_provider.probe()  # the SDK, and no IPU: auto must not take it
    assert not build_host.available and "no IPU is visible here" in build_host.detail
    monkeypatch.setattr(engine_probe, "probe_sdk", lambda: SimpleNamespace(hardware_visible=True))
    assert ipu_provider.probe() == Availability(True, "device 'ipu': PopART found (test)")
    monkeypatch.setattr(
        auto, "available_providers", lambda: ["AzureExecutionProvider", "CPUExecutionProvider"]
    )
    monkeypatch.delenv(auto.PREFERENCE_ENV, raising=False)
    ours = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == "ipu"]
    registry = ProviderRegistry(lambda: ours)
    assert auto.choose(registry).chosen.name == "IPUExecutionProvider"  # an IPU host: ipu first
    for device, what in (("ipu-model", "IPU Model simulator"), ("emulator", "host emulator")):
        monkeypatch.setenv("OPTIMUM_IPU_DEVICE", device)
        availability = ipu_provider.probe()
        assert availability.available and availability.emulated and what in availability.detail
        assert auto.choose(registry).chosen.name == "CPUExecutionProvider"
