"""``optimum-ipu conformance`` end to end, in fresh interpreters of the installed environment with the
test-only provider distributions on the path: CPU against itself exactly, a provider with one wrong
output, one that is right everywhere, an interrupted run, and ``pytest conformance/`` running the same
cases. The four reports are parsed by the tools a vendor's CI would use."""

from __future__ import annotations

import base64
import html.parser
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jsonschema
import pytest
from conformance_runs import Run, conformance_argv, run_fixture
from subprocess_env import PLUGIN_SITE, python

from optimum_ipu_backend.conformance.reports import report_schema

REPO = Path(__file__).resolve().parents[2]
PERTURBED = ("perturb_model=bert-text-classification", "perturb_output=logits", "perturb_by=1e-3")


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory, zoo) -> dict[str, Run]:
    """The three runs of this module, made together in one interpreter."""
    transformers_dir = zoo.model("bert", "question-answering")  # exported by the command itself
    exported_dir = zoo.onnx("bert", "fill-mask")
    cpu = ("--provider", "CPUExecutionProvider", "--models", "bert-text-classification")
    cpu += ("gpt2-text-generation", "--model-dir", str(transformers_dir), "--model-dir", str(exported_dir))
    cpu += ("--ops", "Add", "Softmax")
    options = tuple(arg for option in PERTURBED for arg in ("--provider-option", option))
    perturbed = ("--provider", "perturbed", *options, "--models", "bert-text-classification", "--ops", "Add")
    faithful = ("--provider", "faithful", "--models", "bert-text-classification", "--ops", "Add", "Relu")
    return Run.together(
        tmp_path_factory,
        {
            "cpu": (cpu, None),
            "perturbed": ((*perturbed, "--onnx-models", "none"), None),
            "faithful": ((*faithful, "--onnx-models", "simple/test_sign_model"), None),
        },
    )


cpu_run = run_fixture("cpu")
perturbed_run = run_fixture("perturbed")
faithful_run = run_fixture("faithful")


def test_cpu_against_itself_passes_exactly(cpu_run: Run) -> None:
    assert cpu_run.returncode == 0, cpu_run.output
    assert cpu_run.data["passed"] is True and "verdict: PASS" in cpu_run.output
    models = [case for case in cpu_run.data["cases"] if case["level"] == "model"]
    assert {case["case_id"] for case in models} == {
        "model/bert-text-classification",
        "model/gpt2-text-generation",
        "model-dir/bert-question-answering",
        "model-dir/bert-fill-mask",
    }
    for case in models:
        assert case["status"] == "passed", case["message"]
        assert case["outputs"], case["case_id"]
        for output in case["outputs"]:
            assert output["max_abs"] == 0.0 and output["cosine"] == 1.0, (case["case_id"], output)
    generation = cpu_run.cases["model/gpt2-text-generation"]
    (tokens,) = [m for m in generation["metrics"] if m["metric"] == "identical_new_tokens"]
    assert tokens["value"] == tokens["threshold"] == 16
    assert generation["info"]["generation"]["reference"] == generation["info"]["generation"]["provider"]


def test_model_dirs_are_checked_with_the_task_of_their_config(cpu_run: Run) -> None:
    by_class = {
        case["info"]["ort_class"]: case
        for case in cpu_run.data["cases"]
        if case["case_id"].startswith("model-dir/")
    }
    assert set(by_class) == {"ORTModelForQuestionAnswering", "ORTModelForMaskedLM"}
    # The transformers directory was exported by the command; the export was used as it is.
    assert "model-dirs" in by_class["ORTModelForQuestionAnswering"]["info"]["onnx_dir"]
    assert [m["metric"] for m in by_class["ORTModelForQuestionAnswering"]["metrics"]][:2] == [
        "start_agreement",
        "end_agreement",
    ]


def test_a_provider_off_by_1e3_in_one_output_fails_naming_case_output_and_error(perturbed_run: Run) -> None:
    assert perturbed_run.returncode == 1, perturbed_run.output
    case = perturbed_run.cases["model/bert-text-classification"]
    assert case["status"] == "failed"
    assert all(
        "output logits" in failure and "max abs error 0.001" in failure for failure in case["failures"]
    )
    worst = max(output["max_abs"] for output in case["outputs"] if output["output"] == "logits")
    assert worst == pytest.approx(1e-3, rel=1e-3)
    # Only that model is wrong: the operator cases of the same provider pass.
    assert {c["status"] for c in perturbed_run.data["cases"] if c["level"] == "operator"} == {"passed"}
    assert "FAILED model/bert-text-classification: output logits" in perturbed_run.output


def test_a_provider_right_everywhere_passes_with_its_own_expectation_file(faithful_run: Run) -> None:
    assert faithful_run.returncode == 0, faithful_run.output
    provider = faithful_run.data["provider"]
    assert provider["name"] == "FaithfulNPUExecutionProvider" and provider["kind"] == "plugin"
    assert provider["expectation_files"] == [str(PLUGIN_SITE / "faithful_npu_provider" / "conformance.toml")]
    # Its table declares Add, not Relu; its known failure passes and is reported for removal.
    coverage = faithful_run.data["operators"]
    assert coverage["Relu"] == {"out_of_table": coverage["Relu"]["out_of_table"]}
    assert faithful_run.cases["op/test_add_bcast"]["status"] == "xpass"
    assert "NOW PASSING op/test_add_bcast passes but is listed as a known failure" in faithful_run.output
    toml = PLUGIN_SITE / "faithful_npu_provider" / "conformance.toml"
    assert f"remove it with `optimum-ipu conformance-expectations remove {toml} op/test_add_bcast`" in (
        faithful_run.output
    )
    markdown = (faithful_run.report / "conformance.md").read_text()
    assert "## Known failures that now pass (1): remove their entries" in markdown


# ------------------------------------------------------------------------------------------------
# The four reports, parsed
# ------------------------------------------------------------------------------------------------


def test_junit_xml(perturbed_run: Run) -> None:
    from junitparser import Failure, JUnitXml

    xml = JUnitXml.fromfile(str(perturbed_run.report / "conformance.junit.xml"))
    cases = {case.name: case for suite in xml for case in suite}
    failed = cases["model/bert-text-classification"]
    (failure,) = failed.result
    assert isinstance(failure, Failure)
    assert "model/bert-text-classification: output logits on input set" in failure.message
    assert "max abs error 0.001" in failure.message
    assert all(case.is_passed for name, case in cases.items() if name.startswith("op/"))
    assert xml.failures == 1 and xml.tests == len(cases)


def test_json_report_matches_its_schema(perturbed_run: Run, faithful_run: Run, cpu_run: Run) -> None:
    for run in (perturbed_run, faithful_run, cpu_run):
        jsonschema.validate(run.data, report_schema())
    assert perturbed_run.data["schema_version"] == "1.2" and perturbed_run.data["passed"] is False
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**perturbed_run.data, "passed": "no"}, report_schema())


def test_markdown_summary(perturbed_run: Run) -> None:
    markdown = (perturbed_run.report / "conformance.md").read_text()
    assert "**Verdict: FAIL**" in markdown
    row = next(
        line
        for line in markdown.splitlines()
        if line.startswith("| `model/bert-text-classification` | failed")
    )
    assert "output logits" in row and "max abs error 0.001" in row


class _Page(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: dict[str, str] = {}
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "img":
            self.images[values.get("id") or ""] = values.get("src") or ""
        assert tag not in ("script", "link"), "the page must be self-contained and script-free"

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _embedded_png(src: str) -> tuple[int, int]:
    from PIL import Image

    prefix = "data:image/png;base64,"
    assert src.startswith(prefix)
    image = Image.open(io.BytesIO(base64.b64decode(src[len(prefix) :])))
    assert image.format == "PNG"
    return image.size


def test_html_page_is_self_contained_with_its_plots_embedded(perturbed_run: Run, cpu_run: Run) -> None:
    page = _Page()
    page.feed((perturbed_run.report / "conformance.html").read_text())
    text = " ".join(page.text)
    assert (
        "model/bert-text-classification" in text and "output logits" in text and "max abs error 0.001" in text
    )
    width, height = _embedded_png(page.images["plot-model-errors"])
    assert width > 300 and height > 100
    page = _Page()
    page.feed((cpu_run.report / "conformance.html").read_text())
    assert set(page.images) == {"plot-model-errors", "plot-operator-coverage"}
    for src in page.images.values():
        _embedded_png(src)


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def test_html_page_renders_in_headless_chromium(cpu_run: Run, tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium)")
    # A copy with a probe appended: after load it records, for every image, whether the browser decoded
    # it and its drawn size. The report itself carries no script.
    probe = textwrap.dedent(
        """
        <script>
        window.addEventListener("load", () => {
          for (const img of document.images) {
            const box = img.getBoundingClientRect();
            img.setAttribute("data-drawn", [img.complete, img.naturalWidth, Math.round(box.width)].join(","));
          }
        });
        </script>
        """
    )
    page = tmp_path / "page.html"
    page.write_text((cpu_run.report / "conformance.html").read_text().replace("</body>", probe + "</body>"))
    dom = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--virtual-time-budget=5000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    drawn = {}

    class _Drawn(html.parser.HTMLParser):
        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            values = dict(attrs)
            if tag == "img":
                drawn[values.get("id")] = values.get("data-drawn")

    _Drawn().feed(dom)
    assert set(drawn) == {"plot-model-errors", "plot-operator-coverage"}, dom[:500]
    for plot, state in drawn.items():
        complete, natural_width, shown_width = state.split(",")
        assert complete == "true" and int(natural_width) > 300 and int(shown_width) > 300, (plot, state)


# ------------------------------------------------------------------------------------------------
# Interruption, and the pytest route
# ------------------------------------------------------------------------------------------------


def test_an_interrupted_run_writes_what_it_finished(tmp_path: Path) -> None:
    report = tmp_path / "report"
    argv = conformance_argv(report, "--provider", "CPUExecutionProvider", "--models", "none")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update({"PYTHONPATH": str(PLUGIN_SITE), "HF_HUB_OFFLINE": "1"})
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sys; from optimum_ipu_backend.cli.main import main; sys.exit(main({argv!r}))",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    progress = report / "progress.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if progress.is_file() and len(progress.read_text().splitlines()) >= 30:
            break
        time.sleep(0.2)
    assert process.poll() is None, "the run ended before it could be interrupted"
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 130, output
    data = json.loads((report / "conformance.json").read_text())
    jsonschema.validate(data, report_schema())
    assert data["interrupted"] is True and data["passed"] is False and data["not_run"]
    finished = {json.loads(line)["case_id"] for line in progress.read_text().splitlines()}
    assert len(finished) >= 30 and finished <= {case["case_id"] for case in data["cases"]}
    assert "INTERRUPTED" in (report / "conformance.md").read_text().upper()


def test_pytest_conformance_runs_the_same_cases(faithful_run: Run) -> None:
    args = ("--provider", "faithful", "--models", "bert-text-classification", "--ops", "Add,Relu")
    args += ("--onnx-models", "simple/test_sign_model")
    code = f"""
        import sys, pytest
        sys.exit(pytest.main(["conformance", "--collect-only", "-q", "-p", "no:cacheprovider", *{args!r}]))
    """
    result = python(code, plugins=True, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    collected = {
        line.rpartition("[")[2].rstrip("]")
        for line in result.stdout.splitlines()
        if "::test_conformance[" in line
    }
    ran = {
        case["case_id"]
        for case in faithful_run.data["cases"]
        if case["status"] not in ("out_of_table", "not_applicable")
    }
    assert collected == ran and len(collected) > 5
