"""`optimum-cli ipu ...`, `optimum-cli export ipu` and `env`: the installed console scripts, each in a fresh
interpreter, as a user runs them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_env import python_json

from integration.one_node import save_one_node_model

BIN = Path(sys.executable).parent
ATOL = 1e-5


def _run(
    *command: str, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    exe = shutil.which(command[0], path=str(BIN))
    assert exe, f"the {command[0]} console script is not installed"
    full_env = {
        k: v for k, v in os.environ.items() if not k.startswith(("OPTIMUM_IPU_DEVICE", "OPTIMUM_PROVIDER"))
    }
    full_env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})})
    return subprocess.run([exe, *command[1:]], capture_output=True, text=True, env=full_env, timeout=timeout)


def _with_stdout_closed(*command: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a console script whose reader has gone away before it writes, as `... | head -0` would."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("OPTIMUM_IPU_DEVICE", "OPTIMUM_PROVIDER"))
    }
    process = subprocess.Popen(
        [str(BIN / command[0]), *command[1:]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=cwd,
    )
    process.stdout.close()  # every write now fails with EPIPE
    stderr = process.stderr.read().decode()
    return subprocess.CompletedProcess(command, process.wait(timeout=600), "", stderr)


def _same_help(optimum_cli: str, optimum_ipu: str) -> bool:
    """The same help text, once the program names agree (argparse wraps the usage by the name's length)."""
    return optimum_cli.replace("optimum-cli ipu", "optimum-ipu").split() == optimum_ipu.split()


def _without_timings(text: str) -> str:
    return re.sub(r"\d+\.\d+s\b", "<t>", text)


def test_optimum_cli_help_lists_ipu_and_imports_nothing_heavy():
    assert re.search(r"^\s+ipu\s+Graphcore IPU tools", _run("optimum-cli", "--help").stdout, re.M)
    loaded = python_json(
        """
        import json, sys
        sys.argv = ["optimum-cli", "--help"]
        from optimum.commands.optimum_cli import main
        try:
            main()
        except SystemExit:
            pass
        heavy = ("torch", "onnx", "onnxruntime", "numpy", "optimum_ipu_backend.cli.providers",
                 "optimum_ipu_backend.engines", "optimum_ipu_backend.compiler")
        print(json.dumps(sorted(name for name in heavy if name in sys.modules)))
        """
    )
    assert loaded == []


def test_optimum_cli_ipu_has_the_subcommands_and_help_of_optimum_ipu():
    ours = _run("optimum-ipu", "--help")
    theirs = _run("optimum-cli", "ipu", "--help")
    assert ours.returncode == theirs.returncode == 0
    assert _same_help(theirs.stdout, ours.stdout)
    # every subcommand of cli/main.py's SUBCOMMANDS, including ones added after this test was written
    names = re.search(r"\{([a-z,-]+)\}", ours.stdout).group(1).split(",")
    assert {"providers", "check", "cache", "env", "export"} <= set(names)
    for name in names:
        assert _same_help(
            _run("optimum-cli", "ipu", name, "--help").stdout, _run("optimum-ipu", name, "--help").stdout
        )
    assert _run("optimum-cli", "ipu", "--version").stdout == _run("optimum-ipu", "--version").stdout


def test_optimum_cli_ipu_providers_json_is_optimum_ipu_providers_json():
    ours = _run("optimum-ipu", "providers", "--json")
    theirs = _run("optimum-cli", "ipu", "providers", "--json")
    assert ours.returncode == theirs.returncode == 0, theirs.stderr
    assert json.loads(theirs.stdout) == json.loads(ours.stdout)
    assert theirs.stdout == ours.stdout


def test_optimum_cli_ipu_check_is_optimum_ipu_check_with_its_exit_status(tmp_path):
    # GlobalLpPool has no PopART implementation and no rewrite into one
    for name, op in (("ready", "Relu"), ("not-ready", "GlobalLpPool")):
        save_one_node_model(tmp_path / f"{name}.onnx", op, (2, 4))
        ours = _run("optimum-ipu", "check", str(tmp_path / f"{name}.onnx"))
        theirs = _run("optimum-cli", "ipu", "check", str(tmp_path / f"{name}.onnx"))
        assert ours.returncode == theirs.returncode == (0 if name == "ready" else 1), (
            ours.stdout,
            ours.stderr,
        )
        assert _without_timings(theirs.stdout) == _without_timings(ours.stdout)
        assert "PopART-ready" in ours.stdout


def test_optimum_cli_ipu_env_prints_optimum_report_then_ours():
    result = _run("optimum-cli", "ipu", "env")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    optimum_part, _, ours = text.partition("optimum-ipu-backend:\n")
    # Optimum's own report, as `optimum-cli env` prints it
    assert "Copy-and-paste the text below in your GitHub issue" in optimum_part
    assert "- `optimum` version:" in optimum_part and "- PyTorch version (GPU?):" in optimum_part
    env_alone = _run("optimum-cli", "env").stdout
    assert optimum_part.strip() == env_alone.strip()
    # ours
    for line in (
        "- optimum-ipu-backend version: 0.1.0",
        "- optimum-onnx version: ",
        "- optimum-onnx within that range: True",
        "  - optimum.onnxruntime.modeling: patched: InferenceSession",
        "- Poplar SDK found: False",
        "  - Python module popart: not found",
        "  - emulator: usable: ",
        "  - ipu: not usable: ",
        "- provider='auto' takes: CPUExecutionProvider",
        "- executable cache: ",
    ):
        assert line in ours, (line, ours)
    report = json.loads(_run("optimum-ipu", "env", "--json").stdout)
    assert set(report) == {"optimum", "optimum-ipu-backend"}
    assert report["optimum-ipu-backend"]["patches"]["optimum.onnxruntime.base"].startswith("patched")


# -- optimum-cli export ipu ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory, zoo):
    model_dir = zoo.model("bert", "text-classification")
    output = tmp_path_factory.mktemp("export-ipu") / "bert-ipu"
    result = _run(
        "optimum-cli",
        "export",
        "ipu",
        "--model",
        str(model_dir),
        str(output),
        "--task",
        "text-classification",
        "--sequence-lengths",
        "8,16",
        "--batch-sizes",
        "2",
        "--device",
        "emulator",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return model_dir, output, result


def test_export_writes_the_graphs_and_the_buckets(exported):
    model_dir, output, result = exported
    assert (output / "model.onnx").is_file() and (output / "config.json").is_file()
    config = json.loads((output / "ipu_config.json").read_text())
    assert config == {"batch_size": [2], "sequence_lengths": [8, 16]}
    # both bucket combinations are in the cache now (an identical export elsewhere in the run may have
    # put one there first: the cache is keyed by the graph's content)
    assert re.search(r"Executable cache: 2 executables for device 'emulator' \(\d compiled", result.stdout)


def test_exported_directory_starts_warm_in_a_new_process_and_matches_cpu(exported):
    model_dir, output, _ = exported
    out = python_json(
        f"""
        import json, torch
        from optimum.onnxruntime import ORTModelForSequenceClassification as Cls
        from optimum_ipu_backend.conformance.zoo import preprocessed_inputs
        cpu = Cls.from_pretrained({str(output)!r}, provider="CPUExecutionProvider")
        ipu = Cls.from_pretrained({str(output)!r}, provider="ipu", provider_options={{"device": "emulator"}})
        diffs = []
        for seq in (5, 16):  # one call per compiled sequence length
            arrays = preprocessed_inputs({str(model_dir)!r}, seq=seq)
            inputs = {{k: torch.from_numpy(v) for k, v in arrays.items()}}
            diffs.append(float((ipu(**inputs).logits - cpu(**inputs).logits).abs().max()))
        print(json.dumps({{"diffs": diffs, "executables": ipu.model.compiled_executables(),
                           "buckets": ipu.model.bucket_sizes()}}))
        """
    )
    assert max(out["diffs"]) <= ATOL
    assert out["buckets"] == {"batch_size": [2], "sequence_length": [8, 16]}
    assert [entry["source"] for entry in out["executables"]] == ["cache", "cache"], out["executables"]


@pytest.mark.parametrize(
    "command",
    [
        ("optimum-ipu", "--help"),
        ("optimum-ipu", "providers"),
        ("optimum-ipu", "providers", "--json"),
        ("optimum-ipu", "cache", "list"),
        ("optimum-ipu", "cache", "info"),
        ("optimum-ipu", "check", "GRAPH"),
        ("optimum-ipu", "env"),
        ("optimum-ipu", "export", "--help"),
        ("optimum-cli", "ipu", "providers"),
    ],
    ids=lambda command: " ".join(command[1:]).replace("GRAPH", "graph"),
)
def test_a_closed_stdout_ends_every_subcommand_quietly(command, tmp_path):
    save_one_node_model(tmp_path / "model.onnx")
    command = tuple(str(tmp_path / "model.onnx") if part == "GRAPH" else part for part in command)
    result = _with_stdout_closed(*command)
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr, result.stderr
    # 141: what a shell reports for a command stopped by SIGPIPE; argparse ignores a failed --help write
    assert result.returncode == (0 if "--help" in command else 141)


def test_export_without_a_usable_device_writes_the_buckets_and_says_why_nothing_was_compiled(
    tmp_path_factory, zoo, monkeypatch, capsys
):
    from optimum_ipu_backend.cli import export
    from optimum_ipu_backend.cli.main import build_parser

    exported_gpt2 = zoo.onnx("gpt2", "text-generation-with-past")
    output = tmp_path_factory.mktemp("export-no-device") / "gpt2-ipu"

    def copy_export(model, out, task):  # the ONNX export itself is covered above
        shutil.copytree(exported_gpt2, out)
        return sorted(out.glob("*.onnx"))

    monkeypatch.setattr(export, "export_onnx", copy_export)
    argv = ["export", "-m", "gpt2", str(output), "--sequence-lengths", "8,16", "--batch-sizes", "1,2"]
    assert export.run_export(build_parser().parse_args([*argv, "--device", "ipu"])) == 0
    config = json.loads((output / "ipu_config.json").read_text())
    # the decoder with a past also compiles one-token steps, so the file records them for every graph
    assert config["sequence_lengths"] == [1, 8, 16] and config["batch_size"] == [1, 2]
    assert config["past_sequence_lengths"][0] == 8
    captured = capsys.readouterr()
    assert "The executable cache was not filled: device 'ipu' cannot be used here" in captured.err
    with pytest.raises(ValueError, match="precision"):  # a bad option fails before anything is exported
        export.run_export(build_parser().parse_args([*argv, "--precision", "fp8"]))
