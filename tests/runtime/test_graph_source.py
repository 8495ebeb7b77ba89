"""The cached description of an exported graph: a warm start parses nothing, a changed or corrupt
file is never trusted."""

from __future__ import annotations

import logging
import os

import onnx
import pytest

from optimum_ipu_backend.runtime import graph_source
from optimum_ipu_backend.runtime.graph_source import GraphSource


@pytest.fixture(scope="module")
def t5_dir(zoo):
    return zoo.onnx("t5", "text2text-generation-with-past")


def _copy(source_dir, target_dir, name):
    target_dir.mkdir()
    (target_dir / name).write_bytes((source_dir / name).read_bytes())
    return target_dir / name


def test_a_warm_start_parses_nothing(t5_dir, tmp_path, monkeypatch):
    path = _copy(t5_dir, tmp_path / "model", "decoder_with_past_model.onnx")
    cold = GraphSource(path, tmp_path / "cache").description
    (past_mask,) = cold.masks()
    assert past_mask.dim == "past_decoder_sequence_length" and past_mask.side == "left"

    def refuse(*args, **kwargs):
        raise AssertionError("the graph was parsed on a warm start")

    monkeypatch.setattr(graph_source.onnx, "load", refuse)
    warm = GraphSource(path, tmp_path / "cache").description
    assert warm == cold


def test_a_changed_model_is_described_again(t5_dir, tmp_path):
    path = _copy(t5_dir, tmp_path / "model", "decoder_with_past_model.onnx")
    first = GraphSource(path, tmp_path / "cache").description
    path.write_bytes((t5_dir / "encoder_model.onnx").read_bytes())  # same name, other graph
    os.utime(path, ns=(1, 1))
    second = GraphSource(path, tmp_path / "cache").description
    assert second.digest != first.digest
    assert [spec[0] for spec in second.inputs] == ["input_ids", "attention_mask"]


def test_a_corrupt_description_is_not_served(t5_dir, tmp_path, caplog):
    path = _copy(t5_dir, tmp_path / "model", "decoder_with_past_model.onnx")
    expected = GraphSource(path, tmp_path / "cache").description
    (stored,) = (tmp_path / "cache" / graph_source.DESCRIPTIONS_DIR).glob("*.json")
    stored.write_text(
        stored.read_text().replace("past_decoder_sequence_length", "past_decoder_sequence_lengtx")
    )
    with caplog.at_level(logging.WARNING):
        again = GraphSource(path, tmp_path / "cache").description
    assert again == expected
    assert "corrupt graph description" in caplog.text


def test_without_a_cache_the_graph_is_parsed(t5_dir):
    source = GraphSource(t5_dir / "encoder_model.onnx", None)
    assert isinstance(source.model(), onnx.ModelProto)
    assert source.description.masks() == []
