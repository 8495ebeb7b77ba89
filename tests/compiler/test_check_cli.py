"""`optimum-ipu check`: exit status, per-pass report, unsupported nodes, memory, --save, --json, defaults."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from graph_testing import FLOAT, INT64, make_model, run_ort, tensor_info
from matrix_testing import MATRIX, SEQ2SEQ_MODELS, merged_export
from onnx import helper

from optimum_ipu_backend.cli.check import UsageError, add_check_parser, main, parse_dim, parse_shape
from optimum_ipu_backend.runtime.default_sizes import config_dims, graph_sizes, resolve_input_shapes


@pytest.fixture(scope="module")
def bert_export(zoo):
    return zoo.onnx("bert", "text-classification")


def _custom_op_model(path):
    model = make_model(
        [
            helper.make_node("Relu", ["x"], ["r"], name="fine_relu"),
            helper.make_node("FusedGelu", ["r"], ["y"], name="vendor_gelu", domain="com.microsoft"),
        ],
        [tensor_info("x", FLOAT, [2, 4])],
        [tensor_info("y", FLOAT, [2, 4])],
        opset=11,
        extra_opsets={"com.microsoft": 1},
        check=False,
    )
    onnx.save(model, path)
    return path


def test_ready_model_exits_0_and_reports_every_pass_and_memory(bert_export, capsys):
    status = main([str(bert_export), "--dim", "sequence_length=16", "--json"])
    document = json.loads(capsys.readouterr().out)
    assert status == 0 and document["ready"] is True
    (result,) = document["files"]
    assert result["bindings"] == {}
    assert result["input_shapes"] == {
        "input_ids": [1, 16],
        "attention_mask": [1, 16],
        "token_type_ids": [1, 16],
    }
    names = [p["name"] for p in result["passes"]]
    assert names[0] == "fix_shapes" and names[-1] == "verify" and "int64_to_int32" in names
    folded = next(p for p in result["passes"] if p["name"] == "fold_constants")
    assert folded["nodes_after"] < folded["nodes_before"] and folded["ops_removed"].get("Shape", 0) > 0
    memory = result["memory"]
    assert memory["ipus_needed"] == 1 and memory["ipu_memory_bytes"] == 900_000_000
    weights = sum(t.ByteSize() for t in onnx.load(bert_export / "model.onnx").graph.initializer)
    assert 0.5 * weights < memory["weights_bytes"] < 1.5 * weights


def test_text_output_and_save(bert_export, tmp_path, capsys):
    status = main(
        [
            str(bert_export / "model.onnx"),
            "--shape",
            "input_ids=2,8",
            "--shape",
            "attention_mask=2x8",
            "--shape",
            "token_type_ids=2,8",
            "--save",
            str(tmp_path / "out"),
        ]
    )
    out = capsys.readouterr().out
    assert status == 0
    assert "input_ids=2x8" in out and "PopART-ready: yes" in out and "IPU(s)" in out
    saved = onnx.load(tmp_path / "out" / "model.onnx")
    assert max(o.version for o in saved.opset_import if o.domain in ("", "ai.onnx")) <= 11
    assert [d.dim_value for d in saved.graph.input[0].type.tensor_type.shape.dim] == [2, 8]


def test_unsupported_nodes_are_listed_and_exit_1(tmp_path, capsys):
    path = _custom_op_model(tmp_path / "custom.onnx")
    status = main([str(path), "--json"])
    document = json.loads(capsys.readouterr().out)
    assert status == 1 and document["ready"] is False
    unsupported = document["files"][0]["unsupported"]
    assert any(u["name"] == "vendor_gelu" and u["domain"] == "com.microsoft" for u in unsupported)
    assert not any(u["name"] == "fine_relu" for u in unsupported)


def test_missing_sizes_are_reported_with_the_input_and_dims(tmp_path, capsys):
    model = make_model(
        [helper.make_node("Identity", ["ids"], ["y"])],
        [tensor_info("ids", INT64, ["batch_size", "mystery_size"])],
        [tensor_info("y", INT64, ["batch_size", "mystery_size"])],
    )
    onnx.save(model, tmp_path / "model.onnx")
    assert main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "ids" in out and "mystery_size" in out
    assert main([str(tmp_path), "--dim", "mystery_size=5"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize(
    "argv", [["/no/such/path"], ["{model}", "--shape", "input_ids"], ["{model}", "--dim", "batch_size=x"]]
)
def test_usage_errors_exit_2(argv, bert_export, capsys):
    argv = [a.format(model=bert_export) for a in argv]
    assert main(argv) == 2
    assert "optimum-ipu check:" in capsys.readouterr().err


def test_parsers():
    assert parse_shape("input_ids=1,128") == ("input_ids", [1, 128])
    assert parse_shape("pixel_values=1x3x224x224") == ("pixel_values", [1, 3, 224, 224])
    assert parse_dim("sequence_length=64") == ("sequence_length", 64)
    with pytest.raises(UsageError):
        parse_shape("=1,2")
    with pytest.raises(UsageError):
        parse_dim("sequence_length")


def _decoder_with_past(max_positions=16):
    """input_ids and one past key beside it: the two lengths a generation step has."""
    model = make_model(
        [helper.make_node("Identity", ["input_ids"], ["y"])],
        [
            tensor_info("input_ids", INT64, ["batch_size", "sequence_length"]),
            tensor_info("past_key_values.0.key", FLOAT, ["batch_size", 2, "past_sequence_length", 4]),
            tensor_info("attention_mask", INT64, ["batch_size", "past_sequence_length + sequence_length"]),
        ],
        [tensor_info("y", INT64, ["batch_size", "sequence_length"])],
    )
    return model, {"model_type": "gpt2", "n_positions": max_positions}


def test_defaults_follow_the_runtime_plan():
    model, config = _decoder_with_past(max_positions=16)
    sizes = graph_sizes(model, config, {})
    # One sample, one new token, and the largest planned past (powers of two) with room for it.
    assert sizes.dims == {"batch_size": 1, "sequence_length": 1, "past_sequence_length": 8}
    assert sizes.over_limit == []
    assert resolve_input_shapes(model, sizes.dims, {})["attention_mask"] == [1, 9]
    # The no-cache branch of a merged decoder reads no past: the prompt takes the longest size.
    prompt = graph_sizes(model, config, {}, {"use_cache_branch": False})
    assert prompt.dims["sequence_length"] == 16 and prompt.over_limit == []
    encoder = make_model(
        [helper.make_node("Identity", ["ids"], ["y"])],
        [tensor_info("ids", INT64, ["batch_size", "sequence_length"])],
        [tensor_info("y", INT64, ["batch_size", "sequence_length"])],
    )
    assert graph_sizes(encoder, {"max_position_embeddings": 64}, {}).dims == {
        "batch_size": 1,
        "sequence_length": 64,
    }


def test_defaults_plan_as_a_session_of_the_same_directory_would(tmp_path):
    """check reads the directory's ipu_config.json and audio sampling rate, as a session does."""
    encoder = make_model(
        [helper.make_node("Identity", ["ids"], ["y"])],
        [tensor_info("ids", INT64, ["batch_size", "sequence_length"])],
        [tensor_info("y", INT64, ["batch_size", "sequence_length"])],
    )
    (tmp_path / "ipu_config.json").write_text(
        json.dumps({"batch_size": [2, 4], "sequence_lengths": [16, 32]})
    )
    sizes = graph_sizes(encoder, {"max_position_embeddings": 64}, {}, model_dir=tmp_path)
    assert sizes.dims == {"batch_size": 2, "sequence_length": 32}
    audio = make_model(
        [helper.make_node("Identity", ["input_values"], ["y"])],
        [tensor_info("input_values", FLOAT, ["batch_size", "sequence_length"])],
        [tensor_info("y", FLOAT, ["batch_size", "sequence_length"])],
    )
    (tmp_path / "ipu_config.json").unlink()
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"sampling_rate": 8000}))
    assert graph_sizes(audio, {}, {}, model_dir=tmp_path).dims["sequence_length"] == 30 * 8000


def test_config_fixed_sizes():
    vit = config_dims({"model_type": "vit", "image_size": 224, "num_channels": 3})
    assert (vit["height"], vit["width"], vit["num_channels"]) == (224, 224, 3)
    clip = config_dims({"vision_config": {"image_size": 30, "num_channels": 3}, "text_config": {}})
    assert (clip["height"], clip["num_channels"]) == (30, 3)
    whisper = config_dims({"model_type": "whisper", "max_source_positions": 1500, "num_mel_bins": 80})
    assert whisper["feature_size"] == 80 and whisper["encoder_sequence_length"] == 1500


def test_sizes_over_the_model_limit_are_named(tmp_path, capsys):
    model, config = _decoder_with_past(max_positions=16)
    onnx.save(model, tmp_path / "model.onnx")
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main([str(tmp_path), "--dim", "past_sequence_length=16", "--json"]) == 1
    (result,) = json.loads(capsys.readouterr().out)["files"]
    assert not result["ready"] and result["passes"] == []
    assert (
        "past_sequence_length 16 + sequence_length 1 = 17 positions is over the model's 16" in result["error"]
    )
    assert "n_positions in config.json" in result["error"]
    assert main([str(tmp_path), "--dim", "sequence_length=20", "--dim", "past_sequence_length=0"]) == 1
    assert "sequence_length 20 is over the model's 16 positions" in capsys.readouterr().out
    assert main([str(tmp_path)]) == 0  # the defaults stay within the limit
    capsys.readouterr()


def test_symbolic_sums_are_evaluated():
    model = make_model(
        [helper.make_node("Identity", ["mask"], ["y"])],
        [tensor_info("mask", INT64, ["batch_size", "past_sequence_length + sequence_length"])],
        [tensor_info("y", INT64, ["batch_size", "past_sequence_length + sequence_length"])],
    )
    dims = {"batch_size": 2, "past_sequence_length": 5, "sequence_length": 3}
    assert resolve_input_shapes(model, dims, {}) == {"mask": [2, 8]}
    assert resolve_input_shapes(model, dims, {"mask": [2, 1]}) == {"mask": [2, 1]}


def test_subcommand_registration():
    parser = argparse.ArgumentParser(prog="optimum-ipu")
    add_check_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["check", "some/dir", "--precision", "fp16", "--shape", "x=1,2"])
    assert args.command == "check" and args.precision == "fp16" and args.shape == ["x=1,2"]
    assert callable(args.func)


def test_runs_as_a_module(tmp_path):
    path = _custom_op_model(tmp_path / "custom.onnx")
    completed = subprocess.run(
        [sys.executable, "-m", "optimum_ipu_backend.cli.check", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 1, completed.stderr
    assert "vendor_gelu" in completed.stdout and "PopART-ready: no" in completed.stdout


def test_fp16_precision_is_reported(tmp_path, capsys):
    model = make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [tensor_info("x", FLOAT, ["batch_size", 4])],
        [tensor_info("y", FLOAT, ["batch_size", 3])],
        {"w": np.ones((4, 3), np.float32)},
    )
    onnx.save(model, tmp_path / "model.onnx")
    assert main([str(tmp_path), "--precision", "fp16", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["precision"] == "fp16"
    assert "precision_fp16" in [p["name"] for p in document["files"][0]["passes"]]


def test_merged_decoders_are_checked_once_per_branch(tmp_path, capsys):
    def branch(name, scale):
        return helper.make_graph(
            [helper.make_node("Mul", ["x", f"{name}_scale"], [f"{name}_y"])],
            name,
            [],
            [tensor_info(f"{name}_y", FLOAT, ["batch_size", 4])],
            initializer=[onnx.numpy_helper.from_array(np.array(scale, np.float32), f"{name}_scale")],
        )

    model = make_model(
        [
            helper.make_node(
                "If", ["use_cache_branch"], ["y"], then_branch=branch("a", 2.0), else_branch=branch("b", 3.0)
            )
        ],
        [
            tensor_info("use_cache_branch", onnx.TensorProto.BOOL, [1]),
            tensor_info("x", FLOAT, ["batch_size", 4]),
        ],
        [tensor_info("y", FLOAT, ["batch_size", 4])],
    )
    onnx.save(model, tmp_path / "decoder_model_merged.onnx")
    assert main([str(tmp_path), "--json", "--save", str(tmp_path / "out")]) == 0
    document = json.loads(capsys.readouterr().out)
    labels = [f["label"] for f in document["files"]]
    assert labels == [
        "decoder_model_merged.onnx [use_cache_branch=False]",
        "decoder_model_merged.onnx [use_cache_branch=True]",
    ]
    assert [f["bindings"] for f in document["files"]] == [
        {"use_cache_branch": False},
        {"use_cache_branch": True},
    ]
    saved = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert saved == [
        "decoder_model_merged.use_cache_branch_false.onnx",
        "decoder_model_merged.use_cache_branch_true.onnx",
    ]
    # Each saved graph is its branch alone: no branch input left, the branch's outputs.
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    for entry in document["files"]:
        branch = onnx.load(entry["saved_to"])
        assert [i.name for i in branch.graph.input] == ["x"]
        flag = np.array([entry["bindings"]["use_cache_branch"]])
        expected = run_ort(model, {"use_cache_branch": flag, "x": x})["y"]
        np.testing.assert_array_equal(run_ort(branch, {"x": x})["y"], expected)


@pytest.mark.slow
@pytest.mark.parametrize("name", SEQ2SEQ_MODELS)
def test_defaults_pass_on_every_seq2seq_export(name, zoo, capsys):
    """Every file of the export with its merged decoder, each branch, at the sizes the runtime compiles."""
    task = dict(MATRIX)[name]
    status = main([str(merged_export(zoo, name, task)), "--json"])
    files = json.loads(capsys.readouterr().out)["files"]
    assert status == 0, [(f["label"], f["error"], f["unsupported"][:3]) for f in files if not f["ready"]]
    assert len(files) == 5  # encoder, decoder, decoder with past, the merged decoder's two branches
    step = next(f for f in files if f["label"] == "decoder_with_past_model.onnx")
    assert step["input_shapes"]["input_ids"] == [1, 1]


def test_a_checkpoint_is_exported_as_optimum_cli_would_then_checked(tmp_path, zoo, capsys):
    checkpoint = zoo.model("bert", "text-classification")
    assert not list(checkpoint.glob("*.onnx"))
    export_dir = tmp_path / "export"
    status = main([str(checkpoint), "--export-dir", str(export_dir), "--json"])
    document = json.loads(capsys.readouterr().out)
    assert status == 0 and [f["label"] for f in document["files"]] == ["model.onnx"]
    # The task comes from the config (a sequence classifier), as `optimum-cli export onnx` infers it.
    assert [o.name for o in onnx.load(export_dir / "model.onnx").graph.output] == ["logits"]
    features = tmp_path / "features"
    assert main([str(checkpoint), "--task", "feature-extraction", "--export-dir", str(features)]) == 0
    assert [o.name for o in onnx.load(features / "model.onnx").graph.output] == ["last_hidden_state"]
    capsys.readouterr()


def test_export_options_need_a_checkpoint(bert_export, capsys):
    assert main([str(bert_export), "--task", "feature-extraction"]) == 2
    assert "checkpoint" in capsys.readouterr().err


def test_a_missing_subcommand_module_is_an_error_not_a_missing_command(monkeypatch):
    """A packaging mistake that drops a command's module must fail loudly, not shrink the CLI."""
    from optimum_ipu_backend.cli import main as cli_main

    monkeypatch.setattr(
        cli_main, "SUBCOMMANDS", (*cli_main.SUBCOMMANDS, ("optimum_ipu_backend.cli.gone", "add"))
    )
    with pytest.raises(ModuleNotFoundError, match="optimum_ipu_backend.cli.gone"):
        cli_main.build_parser()
