"""Run optimum-onnx's own ORTModel tests against an execution provider, on local stand-in models.

The promise of a provider plugin is that existing code runs by changing one string. optimum-onnx's own
ORTModel tests are the sharpest check of that promise, so this tool runs them twice, as written (on
CPUExecutionProvider) and with every ``from_pretrained`` that names no provider given the provider under
test, and prints both counts and every test that passes on CPU but not on the provider.

* **Their tests stay theirs.** The tests are fetched at the tag matching the installed optimum-onnx
  (``git clone --depth 1 --branch v<version>``), or taken from ``--source`` (a checkout or a git
  directory, for machines without network), into a temporary directory; nothing is vendored.
* **No network.** Every Hub id the selected tests load is replaced by a tiny random model of the same
  architecture, built locally from a config (optimum_ipu_backend.conformance.zoo's builders where the
  zoo has the family), with its tokenizer or image processor, and saved in a Hugging Face cache layout
  (``models--org--name/snapshots/<rev>`` + ``refs/main``) so that ``from_pretrained("org/name")``
  resolves with ``HF_HUB_OFFLINE=1``. The image tests' photograph is replaced by a local image.
* **Selection.** The parameterized tests of ``test_modeling.py``, ``test_decoder.py`` and
  ``test_seq2seq.py`` whose architecture is one of ``ARCHITECTURES``, and the unparameterized tests in
  ``EXTRA_TESTS`` (they load only ids stood in here). ``-k`` narrows further.
* **Provider injection** is a pytest plugin (tools/optimum_onnx_peer_conftest.py) copied into the
  temporary directory as ``conftest.py``. Calls that name a provider keep it; tests whose source names
  ``CPUExecutionProvider`` are expected to fail on another provider and are listed apart.

Exit status: 0 when every test that passes on CPU passes on the provider, tests naming the CPU provider
excepted; 1 otherwise; 2 for missing packages or a usage error.

Usage (offline, from a local git directory or checkout of optimum-onnx)::

    python tools/optimum_onnx_tests.py --provider ipu --device emulator \\
        --source /path/to/optimum-onnx --workers 2 --work-dir /tmp/peer
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFTEST_SOURCE = Path(__file__).resolve().with_name("optimum_onnx_peer_conftest.py")
UPSTREAM = "https://github.com/huggingface/optimum-onnx"

TEST_FILES = ("test_modeling.py", "test_decoder.py", "test_seq2seq.py")

#: Architectures (keys of their testing_utils.MODEL_NAMES) whose parameterized tests run.
ARCHITECTURES = ("bert", "vit", "gpt2", "llama", "t5", "bart", "distilbert", "roberta", "qwen2", "mistral")

#: Unparameterized tests that load only ids stood in here (``file::Class::test``).
EXTRA_TESTS = (
    "test_modeling.py::ORTModelIntegrationTest::test_load_model_from_hub",
    "test_modeling.py::ORTModelIntegrationTest::test_load_model_cpu_provider",
    "test_modeling.py::ORTModelIntegrationTest::test_load_model_unknown_provider",
    "test_modeling.py::ORTModelIntegrationTest::test_model_on_cpu",
    "test_modeling.py::ORTModelIntegrationTest::test_model_on_cpu_str",
    "test_modeling.py::ORTModelIntegrationTest::test_passing_session_options",
    "test_modeling.py::ORTModelIntegrationTest::test_save_load_ort_model_with_external_data",
    "test_decoder.py::ORTModelForCausalLMIntegrationTest::test_load_model_which_is_not_supported",
    "test_decoder.py::ORTModelForCausalLMIntegrationTest::test_load_model_with_provider",
    "test_decoder.py::ORTModelForCausalLMIntegrationTest::test_load_model_with_session_options",
    "test_seq2seq.py::ORTModelForSeq2SeqLMIntegrationTest::test_load_model_with_provider",
    "test_seq2seq.py::ORTModelForSeq2SeqLMIntegrationTest::test_load_model_with_session_options",
)

#: Packages their tests import that a plugin's environment may lack (import name -> pip name).
TEST_REQUIREMENTS = {
    "pytest": "pytest",
    "parameterized": "parameterized",
    "PIL": "pillow",
    "requests": "requests",
}

#: Provider options used when none are given, per provider.
DEFAULT_PROVIDER_OPTIONS = {"ipu": {"device": "emulator"}}


# ----------------------------------------------------------------------------------------------------
# Stand-in models
# ----------------------------------------------------------------------------------------------------

# The causal decoders the zoo lacks: a tiny config of each, sharing the zoo's GPT-2 byte-level tokenizer
# (EOS doubles as BOS and pad, as for GPT-2; their tests pad with EOS when a tokenizer has no pad token).
_TINY_DECODER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def _zoo():
    from optimum_ipu_backend.conformance import zoo

    return zoo


def _zoo_model(name: str, task: str | None = None) -> Callable[[Path], Path]:
    def build(root: Path) -> Path:
        return _zoo().build_model(name, root, task)

    return build


def _decoder_model(config_class_name: str, **config_kwargs: object) -> Callable[[Path], Path]:
    def build(root: Path) -> Path:
        import torch
        import transformers

        out_dir = root / config_class_name
        if out_dir.is_dir():
            return out_dir
        tokenizer_source = _zoo().build_model("gpt2", root, "text-generation")
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_source)
        config = getattr(transformers, config_class_name)(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **_TINY_DECODER,
            **config_kwargs,
        )
        torch.manual_seed(int(hashlib.sha1(config_class_name.encode()).hexdigest()[:8], 16))
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        staging = Path(tempfile.mkdtemp(prefix=f".{config_class_name}.", dir=root))
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, out_dir)
        return out_dir

    return build


#: Every Hub id the selected tests load, and how its stand-in is built (into a directory it returns).
#: The ids come from their testing_utils.MODEL_NAMES for ARCHITECTURES, plus the ids EXTRA_TESTS name.
STAND_INS: Mapping[str, Callable[[Path], Path]] = {
    "hf-internal-testing/tiny-random-BertModel": _zoo_model("bert"),
    "hf-internal-testing/tiny-random-DistilBertModel": _zoo_model("distilbert"),
    "hf-internal-testing/tiny-random-RobertaModel": _zoo_model("roberta"),
    "hf-internal-testing/tiny-random-vit": _zoo_model("vit"),
    "hf-internal-testing/tiny-random-GPT2LMHeadModel": _zoo_model("gpt2", "text-generation"),
    "hf-internal-testing/tiny-random-BartModel": _zoo_model("bart"),
    "hf-internal-testing/tiny-random-t5": _zoo_model("t5", "text2text-generation"),
    "optimum-internal-testing/tiny-random-llama": _decoder_model("LlamaConfig"),
    "fxmarty/tiny-dummy-qwen2": _decoder_model("Qwen2Config"),
    "echarlaix/tiny-random-mistral": _decoder_model("MistralConfig", sliding_window=None),
    # ORTModelIntegrationTest.ONNX_MODEL_ID (an exported DistilBERT on the Hub; exported on load here).
    "philschmid/distilbert-onnx": _zoo_model("distilbert"),
    # ORTModelForSeq2SeqLMIntegrationTest.ONNX_MODEL_ID.
    "optimum-internal-testing/tiny-random-T5Model": _zoo_model("t5", "text2text-generation"),
}


def snapshot_revision(repo_id: str) -> str:
    """A fixed 40-hex revision per id, as the Hub's commit hashes look."""
    return hashlib.sha1(f"stand-in:{repo_id}".encode()).hexdigest()


def add_to_hub_cache(hub_cache: Path, repo_id: str, model_dir: Path) -> Path:
    """Lay ``model_dir`` out in ``hub_cache`` as the snapshot of ``repo_id`` at ``refs/main``; return it.

    This is huggingface_hub's cache layout (``models--org--name/snapshots/<rev>/`` and
    ``refs/main`` holding ``<rev>``), which ``from_pretrained`` reads under ``HF_HUB_OFFLINE=1``.
    """
    repo_dir = Path(hub_cache) / ("models--" + repo_id.replace("/", "--"))
    revision = snapshot_revision(repo_id)
    snapshot = repo_dir / "snapshots" / revision
    if snapshot.is_dir():
        shutil.rmtree(snapshot)
    shutil.copytree(model_dir, snapshot, ignore=shutil.ignore_patterns(".*"))
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(revision)
    return snapshot


def build_stand_ins(hub_cache: Path, build_root: Path, repo_ids: Iterable[str] | None = None) -> list[str]:
    """Build the stand-in of every id (all of ``STAND_INS`` by default) into ``hub_cache``."""
    built = []
    for repo_id in repo_ids if repo_ids is not None else STAND_INS:
        add_to_hub_cache(hub_cache, repo_id, STAND_INS[repo_id](Path(build_root)))
        built.append(repo_id)
    return built


def write_stand_in_image(path: Path) -> Path:
    """A 640x480 RGB picture with structure (gradients, not noise), in place of the tests' photograph."""
    import numpy as np
    from PIL import Image

    height, width = 480, 640
    rows, columns = np.mgrid[0:height, 0:width]
    pixels = np.stack(
        [(columns * 255 // width), (rows * 255 // height), ((rows + columns) * 255 // (height + width))],
        axis=-1,
    ).astype(np.uint8)
    Image.fromarray(pixels).save(path, format="JPEG")
    return path


# ----------------------------------------------------------------------------------------------------
# Their tests
# ----------------------------------------------------------------------------------------------------


def installed_optimum_onnx_version() -> str:
    return importlib.metadata.version("optimum-onnx")


def missing_packages(workers: int) -> list[str]:
    """pip names of the packages their tests import that are not importable here."""
    required = dict(TEST_REQUIREMENTS)
    if workers > 1:
        required["xdist"] = "pytest-xdist"
    return [pip_name for module, pip_name in required.items() if importlib.util.find_spec(module) is None]


def fetch_tests(destination: Path, version: str, source: Path | None) -> Path:
    """Put optimum-onnx's ``tests/`` at tag ``v<version>`` under ``destination``; return ``tests/``.

    ``source`` may be a git directory (bare or not) or a checkout: a git one is read at the tag with
    ``git archive``; a plain directory with ``tests/onnxruntime`` is copied as it is. Without ``source``
    the tag is cloned from GitHub.
    """
    destination.mkdir(parents=True, exist_ok=True)
    tag = f"v{version}"
    if source is None:
        checkout = destination / "optimum-onnx"
        subprocess.run(
            ["git", "clone", "--quiet", "--depth", "1", "--branch", tag, UPSTREAM, str(checkout)], check=True
        )
        return checkout / "tests"
    source = Path(source)
    is_git = (
        subprocess.run(
            ["git", "-C", str(source), "rev-parse", "--git-dir"], capture_output=True, check=False
        ).returncode
        == 0
    )
    if is_git:
        archive = subprocess.run(
            ["git", "-C", str(source), "archive", tag, "tests"], capture_output=True, check=False
        )
        if archive.returncode != 0:
            raise SystemExit(f"{source} has no tag {tag}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", str(destination)], input=archive.stdout, check=True)
        return destination / "tests"
    if (source / "tests" / "onnxruntime").is_dir():
        shutil.copytree(source / "tests", destination / "tests")
        return destination / "tests"
    raise SystemExit(f"--source {source}: neither a git directory nor a checkout with tests/onnxruntime")


# ----------------------------------------------------------------------------------------------------
# Runs and their results
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    status: str  # passed, failed, error, skipped
    message: str
    names_cpu_provider: bool
    provider_models: int = 0  # models the test loaded on the injected provider


def parse_junit(path: Path) -> dict[str, Outcome]:
    """Outcome of every test case in a pytest JUnit XML report, by ``Class::test`` id."""
    outcomes = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        class_name = case.get("classname", "").rsplit(".", 1)[-1]
        test_id = f"{class_name}::{case.get('name')}"
        status, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                status = {"failure": "failed"}.get(tag, tag)
                text_lines = (element.text or "").strip().splitlines()
                message = element.get("message") or (text_lines[-1] if text_lines else "")
                break
        names_cpu = any(
            prop.get("name") == "names_cpu_provider" and prop.get("value") == "1"
            for prop in case.iter("property")
        )
        provider_models = max(
            (
                int(prop.get("value", "0"))
                for prop in case.iter("property")
                if prop.get("name") == "provider_models"
            ),
            default=0,
        )
        outcomes[test_id] = Outcome(status, message, names_cpu, provider_models)
    return outcomes


def counts(outcomes: Mapping[str, Outcome]) -> dict[str, int]:
    totals = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    for outcome in outcomes.values():
        totals[outcome.status] += 1
    return totals


@dataclass(frozen=True)
class Comparison:
    regressions: dict[str, Outcome]  # pass on CPU, fail on the provider, source does not name the CPU EP
    expected: dict[str, Outcome]  # the same, but the test's source names CPUExecutionProvider
    cpu_not_passing: dict[str, Outcome]  # did not pass on CPU: not counted for the provider


def compare(cpu: Mapping[str, Outcome], provider: Mapping[str, Outcome]) -> Comparison:
    regressions, expected = {}, {}
    for test_id, cpu_outcome in cpu.items():
        if cpu_outcome.status != "passed":
            continue
        outcome = provider.get(test_id, Outcome("error", "did not run on the provider", False))
        if outcome.status in ("failed", "error"):
            (expected if outcome.names_cpu_provider or cpu_outcome.names_cpu_provider else regressions)[
                test_id
            ] = outcome
    cpu_not_passing = {test_id: o for test_id, o in cpu.items() if o.status in ("failed", "error")}
    return Comparison(regressions, expected, cpu_not_passing)


_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def cause_of(message: str) -> str:
    """A failure message reduced to its cause: first line, object addresses and long tails removed."""
    first_line = message.strip().splitlines()[0] if message.strip() else "(no message)"
    return _ADDRESS.sub("0x...", first_line)[:200]


def group_by_cause(failures: Mapping[str, Outcome]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for test_id, outcome in sorted(failures.items()):
        groups.setdefault(cause_of(outcome.message), []).append(test_id)
    return dict(sorted(groups.items(), key=lambda item: -len(item[1])))


def settings_for(
    provider: str | None, provider_options: Mapping[str, str], image: Path, architectures: Iterable[str]
) -> dict[str, object]:
    return {
        "provider": provider,
        "provider_options": dict(provider_options),
        "architectures": list(architectures),
        "extra_tests": list(EXTRA_TESTS),
        "image": str(image),
    }


def run_pytest(
    tests_dir: Path,
    junit: Path,
    settings: Mapping[str, object],
    hub_cache: Path,
    workers: int,
    keyword: str | None,
    log: Path,
) -> float:
    """Run their selected tests once; return the wall time. Output goes to ``log``."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_CACHE=str(hub_cache),
        HUGGINGFACE_HUB_CACHE=str(hub_cache),
        HF_HUB_DISABLE_TELEMETRY="1",
        OPTIMUM_PEER_SETTINGS=json.dumps(settings),
        PYTHONDONTWRITEBYTECODE="1",
    )
    command = [sys.executable, "-m", "pytest", *TEST_FILES, "-p", "no:cacheprovider", "-q", "-rN"]
    command += ["--junitxml", str(junit), "-o", "junit_family=xunit1"]
    if workers > 1:
        # One worker per test class: their classes export each model once and share it between tests
        # (ORTModelTestMixin._setup), and one test reads an export another test of its class made
        # (test_decoder's test_compare_generation_with_and_without_past_key_values), so a class split
        # across workers exports more and fails by order.
        command += ["-n", str(workers), "--dist", "loadscope"]
    if keyword:
        command += ["-k", keyword]
    start = time.monotonic()
    with open(log, "w") as log_file:
        subprocess.run(
            command, cwd=tests_dir / "onnxruntime", env=env, stdout=log_file, stderr=subprocess.STDOUT
        )
    return time.monotonic() - start


def parse_provider_options(pairs: Iterable[str]) -> dict[str, str]:
    options = {}
    for pair in pairs:
        key, separator, value = pair.partition("=")
        if not separator:
            raise SystemExit(f"--provider-option {pair!r}: expected KEY=VALUE")
        options[key] = value
    return options


def _print_counts(label: str, totals: Mapping[str, int], seconds: float | None) -> None:
    wall = f" in {seconds:.0f} s" if seconds is not None else ""
    print(
        f"{label}: {totals['passed']} passed, {totals['failed']} failed, "
        f"{totals['error']} errors, {totals['skipped']} skipped{wall}"
    )


def _print_by_cause(failures: Mapping[str, Outcome]) -> None:
    for cause, tests in group_by_cause(failures).items():
        print(f"  [{len(tests)}] {cause}")
        for test_id in tests:
            print(f"      {test_id}")


def report(
    provider_label: str,
    cpu: Mapping[str, Outcome],
    provider: Mapping[str, Outcome],
    times: Mapping[str, float | None],
) -> int:
    """Print the counts and the differences; return the exit status."""
    _print_counts("CPUExecutionProvider (as written)", counts(cpu), times.get("cpu"))
    if not provider:
        print(f"{provider_label}: not run (no report)")
        return 0
    _print_counts(provider_label, counts(provider), times.get("provider"))
    passing = [o for o in provider.values() if o.status == "passed"]
    on_provider = sum(1 for o in passing if o.provider_models > 0)
    print(
        f"  {on_provider} of the {len(passing)} passing tests loaded at least one model on {provider_label} "
        "(the others load only models on a provider they name, or no model)"
    )
    comparison = compare(cpu, provider)
    if comparison.cpu_not_passing:
        print(f"\n{len(comparison.cpu_not_passing)} tests fail on CPU (a stand-in problem; not counted):")
        _print_by_cause(comparison.cpu_not_passing)
    print(
        f"\nPass on CPU, fail on {provider_label}: {len(comparison.regressions) + len(comparison.expected)}"
    )
    if comparison.expected:
        print(f"  expected, the test names CPUExecutionProvider ({len(comparison.expected)}):")
        for test_id in sorted(comparison.expected):
            print(f"      {test_id}  [names CPUExecutionProvider]")
    if comparison.regressions:
        print(f"  regressions ({len(comparison.regressions)}), by cause:")
        _print_by_cause(comparison.regressions)
    return 1 if comparison.regressions else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--provider", default="ipu", help="the provider under test (default: ipu)")
    parser.add_argument("--device", help="shorthand for --provider-option device=DEVICE")
    parser.add_argument("--provider-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--source", type=Path, help="a checkout or git directory of optimum-onnx (offline)")
    parser.add_argument("--version", default=None, help="optimum-onnx tag to test (default: the installed)")
    parser.add_argument("--workers", type=int, default=1, help="pytest-xdist workers (default 1)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression, applied to both runs")
    parser.add_argument("--work-dir", type=Path, help="keep tests, stand-ins and reports here")
    parser.add_argument(
        "--runs", default="cpu,provider", help="which runs: cpu, provider or both (default cpu,provider)"
    )
    parser.add_argument(
        "--architectures", default=",".join(ARCHITECTURES), help="comma-separated (their MODEL_NAMES keys)"
    )
    args = parser.parse_args(argv)

    missing = missing_packages(args.workers)
    if missing:
        print(
            "optimum-onnx's tests need packages that are not installed: " + ", ".join(missing),
            f"\n  {sys.executable} -m pip install " + " ".join(missing),
            file=sys.stderr,
        )
        return 2
    options = dict(DEFAULT_PROVIDER_OPTIONS.get(args.provider, {}))
    options.update(parse_provider_options(args.provider_option))
    if args.device:
        options["device"] = args.device
    runs = {run.strip() for run in args.runs.split(",")}
    architectures = [name.strip() for name in args.architectures.split(",") if name.strip()]

    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="optimum-onnx-tests-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    version = args.version or installed_optimum_onnx_version()
    tests_dir = work_dir / "tests"
    if tests_dir.exists():
        shutil.rmtree(tests_dir)
    tests_dir = fetch_tests(work_dir, version, args.source)
    shutil.copy(CONFTEST_SOURCE, tests_dir / "onnxruntime" / "conftest.py")

    hub_cache = work_dir / "hub"
    print(f"optimum-onnx v{version} tests in {tests_dir}; building stand-ins in {hub_cache}", flush=True)
    build_stand_ins(hub_cache, work_dir / "models")
    image = write_stand_in_image(work_dir / "stand-in.jpg")

    provider_label = args.provider + (f" {options}" if options else "")
    times: dict[str, float | None] = {"cpu": None, "provider": None}
    junits = {"cpu": work_dir / "cpu.junit.xml", "provider": work_dir / "provider.junit.xml"}
    for run in ("cpu", "provider"):
        if run not in runs:
            continue
        provider = None if run == "cpu" else args.provider
        settings = settings_for(provider, options if provider else {}, image, architectures)
        print(f"running {run} ({junits[run]}, log {work_dir / (run + '.log')})", flush=True)
        times[run] = run_pytest(
            tests_dir, junits[run], settings, hub_cache, args.workers, args.keyword, work_dir / f"{run}.log"
        )
    results = {run: parse_junit(path) if path.exists() else {} for run, path in junits.items()}
    print(f"\nwork directory: {work_dir}")
    return report(provider_label, results["cpu"], results["provider"], times)


if __name__ == "__main__":
    sys.exit(main())
