"""`optimum-ipu check` legalizes byte for byte the graph a session compiles, for the same model and sizes.

Both reach the compiler through ``compiler.pipeline.legalize``; a spy there records the graph and the input
shapes each one hands over and stops before legalizing. Check runs as the command does (its default sizes,
each branch of a merged decoder); the session then builds the executable of the same shapes and branches.
The models are the main matrix (encoders, a decoder with past, seq2seq exports with a merged decoder,
vision, audio) and the pattern models of each served-graph rewrite: a past padding mask (decoders with
past), an audio frame mask (wav2vec2), an end-of-sentence selection (BART, MBart) and dense experts
(Qwen3-MoE).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compiler"))  # matrix_testing
from matrix_testing import MATRIX, SEQ2SEQ_MODELS, merged_export  # noqa: E402

from optimum_ipu_backend.cli.check import main as check_main
from optimum_ipu_backend.compiler import pipeline
from optimum_ipu_backend.compiler.errors import LegalizationError
from optimum_ipu_backend.conformance.zoo import ModelZoo
from optimum_ipu_backend.runtime import executables
from optimum_ipu_backend.session import IPUInferenceSession, IPUProviderOptions

MERGED = (
    "merged"  # the export with optimum's post-processing: a decoder merged into an If on use_cache_branch
)
# The main matrix of tests/compiler (its seq2seq models as merged exports), then the pattern models.
MODELS = tuple((name, task, MERGED) if name in SEQ2SEQ_MODELS else (name, task) for name, task in MATRIX) + (
    ("wav2vec2", "audio-frame-classification"),
    ("bart", "text-classification"),
    ("mbart", "text-classification"),
    ("qwen3_moe", "text-generation-with-past"),
)


class _Stop(Exception):
    """Raised by the spy in a session: the graph is recorded, nothing is legalized."""


def _export(zoo: ModelZoo, name: str, task: str, *form: str) -> Path:
    return merged_export(zoo, name, task) if form else zoo.onnx(name, task)


@pytest.mark.parametrize("case", MODELS, ids=["-".join(case) for case in MODELS])
def test_check_and_a_session_serve_byte_identical_graphs(zoo, case, monkeypatch, capsys):
    directory = _export(zoo, *case)
    handed: list[tuple[bytes, dict[str, list[int]]]] = []

    def spy(model, input_shapes, *args, error=LegalizationError, **kwargs):
        handed.append(
            (model.SerializeToString(), {name: list(shape) for name, shape in input_shapes.items()})
        )
        raise error("recorded by the served-graph identity test")

    monkeypatch.setattr(pipeline, "legalize", spy)
    check_main([str(directory), "--json"])
    files = json.loads(capsys.readouterr().out)["files"]
    assert len(handed) == len(files) and files, [f["error"] for f in files]

    def key(entry: dict) -> tuple[str, str]:
        return entry["file"], json.dumps(entry["bindings"], sort_keys=True)

    checked = dict(zip(map(key, files), handed, strict=True))

    monkeypatch.setattr(pipeline, "legalize", lambda *args, **kwargs: spy(*args, **kwargs, error=_Stop))
    # graphs legalized by earlier tests of this process would be reused without legalizing again
    monkeypatch.setattr(executables, "_legalized_files", {})
    options = IPUProviderOptions.parse({"device": "emulator", "cache_enabled": "0"}, directory)
    for path in sorted({f["file"] for f in files}):
        with IPUInferenceSession(path, options=options) as session:
            table = session._runner.executables
            for entry in (f for f in files if f["file"] == path):
                shapes = {name: tuple(shape) for name, shape in entry["input_shapes"].items()}
                with pytest.raises(_Stop):
                    table.entry_for(shapes, entry["bindings"])
                (served, shapes_served), (checked_graph, checked_shapes) = (
                    handed[-1],
                    checked[key(entry)],
                )
                assert shapes_served == checked_shapes, entry["label"]
                identical = served == checked_graph  # bytes: no diff of megabytes in the report
                assert identical, f"{entry['label']}: check legalizes another graph than the session"
