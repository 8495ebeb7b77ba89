"""`optimum-ipu check` over the model matrix: every graph it saves is PopART-ready and, run by the emulator
engine, computes what the original export computes on onnxruntime CPU.

For each model, the real command (``optimum_ipu_backend.cli.main.main(["check", DIR, ...])``) checks every
ONNX file of its export directory; the seq2seq models are also exported with optimum's post-processing into
a second directory that adds ``decoder_model_merged.onnx``, which `check` legalizes once per
``use_cache_branch`` value. Sizes are given with ``--dim`` so that each saved graph takes the realistic
feeds built for it (matrix_testing): a prompt or a teacher-forced prefix, and generation steps on the
present key/values of an earlier step. Each saved graph is then loaded back and checked for what PopART
needs (opset <= 11, table operators in every subgraph, static tensors, no forbidden dtype), compiled by
the host emulator engine, fed exactly its input specs, and compared with the original graph: atol 1e-5.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import pytest
from graph_testing import run_ort
from matrix_testing import (
    BATCH,
    MATRIX,
    MATRIX_IDS,
    SEQ,
    SEQ2SEQ_MODELS,
    assert_popart_ready,
    decoder_only_steps,
    executable_feed,
    merged_export,
    only_inputs,
    seq2seq_steps,
)

from optimum_ipu_backend.cli.main import main
from optimum_ipu_backend.conformance.zoo import ModelZoo, preprocessed_inputs
from optimum_ipu_backend.engines import load_engine
from optimum_ipu_backend.engines.base import CompileOptions

# Float outputs of the emulator against the original export on onnxruntime CPU. The largest difference
# at these shapes is all-MiniLM-L6-v2's (6.2e-6); at larger batches its float32 floor exceeds 1e-5 (see
# matrix_testing.FP32_RTOL), which test_pipeline_models.py allows for.
ATOL = 1e-5
BRANCH_INPUT = "use_cache_branch"
#: (file name, bound branch value or None) -> the original graph's feeds.
FeedKey = tuple[str, bool | None]


@dataclass
class CheckRun:
    """One `optimum-ipu check` of an export directory, at sizes that match the feeds of its graphs."""

    label: str
    directory: Path
    dims: dict[str, int]
    feeds: dict[FeedKey, dict[str, np.ndarray]] = field(default_factory=dict)


def _check_runs(zoo: ModelZoo, name: str, task: str) -> list[CheckRun]:
    export_dir = zoo.onnx(name, task)
    sample = preprocessed_inputs(zoo.model(name, task), batch=BATCH, seq=SEQ)
    if name == "gpt2":
        model = onnx.load(export_dir / "model.onnx")
        prompt, next_token = decoder_only_steps(model, sample)
        return [
            CheckRun(
                "prompt",
                export_dir,
                {"batch_size": BATCH, "sequence_length": SEQ, "past_sequence_length": 0},
                {("model.onnx", None): prompt},
            ),
            CheckRun(
                "next-token",
                export_dir,
                {"batch_size": BATCH, "sequence_length": 1, "past_sequence_length": SEQ},
                {("model.onnx", None): next_token},
            ),
        ]
    if name in SEQ2SEQ_MODELS:
        steps = seq2seq_steps(export_dir, sample)
        prefix_length = steps.prefix["input_ids"].shape[1]
        dims = {"batch_size": BATCH, "past_decoder_sequence_length": prefix_length}
        if name != "whisper":  # Whisper's encoder length is the config's, which `check` defaults to
            dims["encoder_sequence_length"] = SEQ
        # The merged decoder takes past inputs on both branches; the first step ignores them.
        first_step = {**steps.next_step, **steps.first_step}
        return [
            CheckRun(
                "prefix",
                export_dir,
                {**dims, "decoder_sequence_length": prefix_length},
                {
                    ("encoder_model.onnx", None): steps.encoder,
                    ("decoder_model.onnx", None): steps.prefix,
                    ("decoder_with_past_model.onnx", None): steps.chunk,
                },
            ),
            CheckRun(
                "generation-step",
                merged_export(zoo, name, task),
                {**dims, "decoder_sequence_length": 1},
                {
                    ("encoder_model.onnx", None): steps.encoder,
                    ("decoder_model.onnx", None): steps.first_step,
                    ("decoder_with_past_model.onnx", None): steps.next_step,
                    ("decoder_model_merged.onnx", False): first_step,
                    ("decoder_model_merged.onnx", True): steps.next_step,
                },
            ),
        ]
    dims = {"batch_size": BATCH} if name == "vit" else {"batch_size": BATCH, "sequence_length": SEQ}
    return [CheckRun("inputs", export_dir, dims, {("model.onnx", None): sample})]


def _run_check(run: CheckRun, out_dir: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    argv = ["check", str(run.directory), "--save", str(out_dir), "--json"]
    for dim, size in run.dims.items():
        argv += ["--dim", f"{dim}={size}"]
    status = main(argv)
    document = json.loads(capsys.readouterr().out)
    not_ready = [(f["label"], f["error"], f["unsupported"]) for f in document["files"] if not f["ready"]]
    assert status == 0 and document["ready"] is True, not_ready
    return document


def _feed_key(entry: Mapping) -> FeedKey:
    bindings = entry["bindings"]
    assert set(bindings) <= {BRANCH_INPUT}, bindings
    return Path(entry["file"]).name, bindings.get(BRANCH_INPUT)


def _assert_matches_the_original(entry: Mapping, feeds: Mapping[str, np.ndarray], label: str) -> None:
    """Run the saved graph on the emulator and the original graph on onnxruntime CPU, on the same feeds."""
    original = onnx.load(entry["file"])
    key = _feed_key(entry)
    original_feeds = only_inputs(original, feeds)
    if key[1] is not None:
        original_feeds[BRANCH_INPUT] = np.array([key[1]])
    expected = run_ort(original, original_feeds)
    executable = load_engine("emulator").compile(Path(entry["saved_to"]), CompileOptions())
    actual = executable.run(executable_feed(executable, feeds))
    assert set(actual) == set(expected), (label, sorted(actual), sorted(expected))
    for output, want in expected.items():
        got = actual[output]
        assert got.shape == want.shape, (label, output, got.shape, want.shape)
        assert np.issubdtype(want.dtype, np.floating), (label, output, want.dtype)
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0, err_msg=f"{label}: {output}")


@pytest.mark.slow
@pytest.mark.parametrize(("name", "task"), MATRIX, ids=MATRIX_IDS)
def test_check_saves_popart_ready_graphs_that_the_emulator_runs_like_the_export(
    zoo, tmp_path, capsys, name, task
):
    for run in _check_runs(zoo, name, task):
        document = _run_check(run, tmp_path / run.label, capsys)
        checked = {_feed_key(entry) for entry in document["files"]}
        exported = {path.name for path in run.directory.glob("*.onnx")}
        # Every file of the export, and each branch of a merged decoder, was checked and has a feed.
        assert {file for file, _ in checked} == exported, (run.label, sorted(exported))
        assert checked == set(run.feeds), (run.label, sorted(checked, key=str))
        for entry in document["files"]:
            label = f"{run.label}: {entry['label']}"
            saved = onnx.load(entry["saved_to"])
            assert Path(entry["saved_to"]).parent == tmp_path / run.label
            assert_popart_ready(saved, label)
            assert all(i.name != BRANCH_INPUT for i in saved.graph.input), label
            _assert_matches_the_original(entry, run.feeds[_feed_key(entry)], label)
