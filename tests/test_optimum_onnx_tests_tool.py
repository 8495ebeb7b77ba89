"""tools/optimum_onnx_tests.py's own logic: the stand-in cache layout, the provider-injection plugin,
the test selection, and reading and classifying the two runs' JUnit reports. Optimum-onnx's suite itself
is not run here (it needs their tests and minutes); docs/conformance.md says how it is run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tool():
    return _load("optimum_onnx_tests")


@pytest.fixture(scope="module")
def plugin():
    return _load("optimum_onnx_peer_conftest")


def test_stand_in_resolves_by_hub_id_offline(tool, tmp_path: Path) -> None:
    import huggingface_hub
    import transformers

    # A config is enough to check the layout; weights and tokenizer files resolve the same way.
    model_dir = tmp_path / "built"
    transformers.BertConfig(hidden_size=8, num_attention_heads=2).save_pretrained(model_dir)
    hub = tmp_path / "hub"
    snapshot = tool.add_to_hub_cache(hub, "some-org/tiny-random-thing", model_dir)

    repo_dir = hub / "models--some-org--tiny-random-thing"
    assert (
        (repo_dir / "refs" / "main").read_text()
        == snapshot.name
        == tool.snapshot_revision("some-org/tiny-random-thing")
    )
    assert len(snapshot.name) == 40 and snapshot.parent == repo_dir / "snapshots"
    # local_files_only goes through the same refs/main -> snapshot lookup as HF_HUB_OFFLINE=1.
    loaded = transformers.AutoConfig.from_pretrained(
        "some-org/tiny-random-thing", cache_dir=hub, local_files_only=True
    )
    assert (loaded.model_type, loaded.hidden_size) == ("bert", 8)
    path = huggingface_hub.hf_hub_download(
        "some-org/tiny-random-thing", "config.json", cache_dir=hub, local_files_only=True
    )
    assert Path(path) == snapshot / "config.json"
    with pytest.raises(OSError):
        transformers.AutoConfig.from_pretrained("some-org/not-stood-in", cache_dir=hub, local_files_only=True)


def test_every_selected_architecture_has_a_stand_in(tool, tmp_path: Path) -> None:
    # Their testing_utils.MODEL_NAMES, for the architectures the tool selects (optimum-onnx v0.1.0).
    model_names = {
        "bert": "hf-internal-testing/tiny-random-BertModel",
        "vit": "hf-internal-testing/tiny-random-vit",
        "gpt2": "hf-internal-testing/tiny-random-GPT2LMHeadModel",
        "llama": "optimum-internal-testing/tiny-random-llama",
        "t5": "hf-internal-testing/tiny-random-t5",
        "bart": "hf-internal-testing/tiny-random-BartModel",
        "distilbert": "hf-internal-testing/tiny-random-DistilBertModel",
        "roberta": "hf-internal-testing/tiny-random-RobertaModel",
        "qwen2": "fxmarty/tiny-dummy-qwen2",
        "mistral": "echarlaix/tiny-random-mistral",
    }
    assert set(tool.ARCHITECTURES) == set(model_names)
    assert set(model_names.values()) <= set(tool.STAND_INS)


def test_architecture_is_read_whole_from_the_parameterized_name(plugin) -> None:
    archs = ["bert", "roberta", "t5", "distilbert", "bart", "gpt2"]
    assert plugin.architecture_of("test_compare_to_transformers_02_bert", archs) == "bert"
    assert plugin.architecture_of("test_compare_to_transformers_10_distilbert", archs) == "distilbert"
    assert plugin.architecture_of("test_compare_to_transformers_21_xlm_roberta", archs) is None
    assert plugin.architecture_of("test_compare_to_transformers_09_deberta_v2", archs) is None
    assert plugin.architecture_of("test_compare_to_transformers_12_mt5_True_False", archs) is None
    assert plugin.architecture_of("test_compare_logits_to_transformers_14_gpt2_False", archs) == "gpt2"
    assert (
        plugin.architecture_of("test_compare_beam_search_to_transformers_00_bart_True_True", archs) == "bart"
    )
    assert plugin.architecture_of("test_pipeline_on_gpu_04_bert_CUDAExecutionProvider", archs) == "bert"
    assert plugin.architecture_of("test_load_model_from_hub", archs) is None
    assert plugin.architecture_of("test_inference_with_old_onnx_model_0", archs) is None


def test_selection_keeps_the_architectures_and_extra_tests_and_marks_cpu_naming_tests(
    plugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    def names_the_cpu_provider():
        return "CPUExecutionProvider"

    def names_nothing():
        return None

    def item(nodeid: str, function=names_nothing):
        return SimpleNamespace(
            nodeid=nodeid, name=nodeid.rsplit("::", 1)[-1], function=function, user_properties=[]
        )

    kept_param = item("test_modeling.py::QA::test_compare_to_transformers_02_bert")
    dropped_param = item("test_modeling.py::QA::test_compare_to_transformers_00_albert")
    kept_extra = item("test_modeling.py::ORTModelIntegrationTest::test_model_on_cpu", names_the_cpu_provider)
    dropped_plain = item("test_modeling.py::ORTModelIntegrationTest::test_load_model_from_cache")
    items = [kept_param, dropped_param, kept_extra, dropped_plain]
    deselected = []
    config = SimpleNamespace(hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)))
    monkeypatch.setattr(
        plugin,
        "SETTINGS",
        {
            "architectures": ["bert"],
            "extra_tests": ["test_modeling.py::ORTModelIntegrationTest::test_model_on_cpu"],
        },
    )

    plugin.pytest_collection_modifyitems(config, items)

    assert items == [kept_param, kept_extra]
    assert deselected == [dropped_param, dropped_plain]
    assert kept_extra.user_properties == [("names_cpu_provider", "1")]
    assert kept_param.user_properties == []


def test_provider_goes_to_calls_that_name_none(plugin, monkeypatch: pytest.MonkeyPatch) -> None:
    from optimum.onnxruntime import ORTModel, ORTModelForSequenceClassification

    calls = []

    def recording_from_pretrained(cls, model_id, **kwargs):
        calls.append((cls, model_id, kwargs))

    monkeypatch.setattr(ORTModel, "from_pretrained", classmethod(recording_from_pretrained))
    plugin._inject_provider("ipu", {"device": "emulator"})

    class Item:
        user_properties: list = []

    test = Item()
    monkeypatch.setitem(plugin._running, "item", test)
    ORTModelForSequenceClassification.from_pretrained("org/a", export=True)
    ORTModelForSequenceClassification.from_pretrained("org/b", provider="CPUExecutionProvider")
    ORTModelForSequenceClassification.from_pretrained("org/c", providers=["CPUExecutionProvider"])
    ORTModelForSequenceClassification.from_pretrained("org/d", provider_options={"device": "ipu"})

    assert calls == [
        (
            ORTModelForSequenceClassification,
            "org/a",
            {"export": True, "provider": "ipu", "provider_options": {"device": "emulator"}},
        ),
        (ORTModelForSequenceClassification, "org/b", {"provider": "CPUExecutionProvider"}),
        (ORTModelForSequenceClassification, "org/c", {"providers": ["CPUExecutionProvider"]}),
        (
            ORTModelForSequenceClassification,
            "org/d",
            {"provider_options": {"device": "ipu"}, "provider": "ipu"},
        ),
    ]
    # the two loads on the injected provider are counted for the running test, once
    assert test.user_properties == [("provider_models", "2")]


def _junit(path: Path, cases: str) -> Path:
    path.write_text(
        f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>'
    )
    return path


CPU_PROPERTY = '<properties><property name="names_cpu_provider" value="1"/></properties>'


def _case(test_id: str, body: str = "") -> str:
    class_name, name = test_id.split("::")
    return f'<testcase classname="test_modeling.{class_name}" name="{name}">{body}</testcase>'


def test_junit_outcomes_are_compared_and_classified(tool, tmp_path: Path) -> None:
    skipped = '<skipped message="needs a GPU"/>'
    cpu = tool.parse_junit(
        _junit(
            tmp_path / "cpu.xml",
            _case("QA::test_a_02_bert")
            + _case("QA::test_b_02_bert")
            + _case("Plain::test_model_on_cpu", CPU_PROPERTY)
            + _case("QA::test_c_02_bert", '<failure message="AssertionError: x"/>')
            + _case("QA::test_gpu", skipped),
        )
    )
    not_an_instance = "AssertionError: &lt;Session object at 0x7f00aa&gt; is not an instance"
    provider = tool.parse_junit(
        _junit(
            tmp_path / "ipu.xml",
            _case(
                "QA::test_a_02_bert", '<properties><property name="provider_models" value="2"/></properties>'
            )
            + _case("QA::test_b_02_bert", f'<failure message="{not_an_instance}"/>')
            + _case(
                "Plain::test_model_on_cpu", CPU_PROPERTY + '<failure message="AssertionError: Lists differ"/>'
            )
            + _case("QA::test_c_02_bert", '<error message="boom"/>')
            + _case("QA::test_gpu", skipped),
        )
    )

    assert tool.counts(cpu) == {"passed": 3, "failed": 1, "skipped": 1, "error": 0}
    assert tool.counts(provider) == {"passed": 1, "failed": 2, "skipped": 1, "error": 1}
    assert provider["QA::test_a_02_bert"].provider_models == 2  # what ran on the provider at all
    assert cpu["QA::test_a_02_bert"].provider_models == 0
    comparison = tool.compare(cpu, provider)
    assert set(comparison.regressions) == {"QA::test_b_02_bert"}
    assert set(comparison.expected) == {"Plain::test_model_on_cpu"}
    assert set(comparison.cpu_not_passing) == {"QA::test_c_02_bert"}  # failing on CPU: never a regression
    assert tool.group_by_cause(comparison.regressions) == {
        "AssertionError: <Session object at 0x...> is not an instance": ["QA::test_b_02_bert"]
    }
    # A test the provider run lost is a regression, not a pass.
    del provider["QA::test_a_02_bert"]
    assert "QA::test_a_02_bert" in tool.compare(cpu, provider).regressions
    assert tool.report("ipu", cpu, provider, {}) == 1


def test_missing_packages_are_named_with_the_pip_command(tool, monkeypatch, capsys) -> None:
    monkeypatch.setattr(tool, "missing_packages", lambda workers: ["parameterized"])
    assert tool.main(["--source", "/nonexistent"]) == 2
    assert "pip install parameterized" in capsys.readouterr().err
