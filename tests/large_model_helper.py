"""A small BERT exported with its weights in an external data file, as exporters write large models.

The zoo's tiny models have no tensor large enough to count as a weight (``WEIGHT_MIN_BYTES``); this
one has (embeddings, attention and feed-forward matrices of 64 KiB and more), so the tests exercise
weights that stay in their files, the cache's shared weight files and the sharding pass over two
encoder layers. Built once per persistent zoo (file-locked) or test session.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from model_zoo import zoo_dir

from optimum_ipu_backend.compiler.passes.shard_over_ipus import (
    PIPELINE_STAGE_ATTRIBUTE,
    VIRTUAL_GRAPH_ATTRIBUTE,
)
from optimum_ipu_backend.conformance.zoo import build_once, export_onnx

TASK = "token-classification"
DATA_FILE = "model.onnx_data"
VOCAB = 512
LAYERS = 2
_VERSION = "large-models-1"


def _build_model(directory: Path) -> None:
    import torch
    import transformers

    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=64,
        type_vocab_size=2,
        num_labels=3,
    )
    torch.manual_seed(13)
    model = transformers.BertForTokenClassification(config).eval()
    model.save_pretrained(directory)


def external_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The export directory: ``model.onnx`` (graph only), ``model.onnx_data`` (weights), ``config.json``."""
    root = zoo_dir(tmp_path_factory, _VERSION)
    model_dir = build_once(root / "bert-model", _build_model)
    exported = export_onnx(model_dir, TASK, root / "bert-export")

    def externalize(staging: Path) -> None:
        for item in exported.iterdir():
            if item.is_file() and item.name != "model.onnx":
                shutil.copy(item, staging / item.name)
        model = onnx.load(exported / "model.onnx")
        onnx.save_model(
            model,
            staging / "model.onnx",
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=DATA_FILE,
            size_threshold=1024,
        )

    return build_once(root / "bert-external", externalize)


def sample_feed(batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "input_ids": rng.integers(0, VOCAB, size=(batch, seq), dtype=np.int64),
        "attention_mask": np.ones((batch, seq), dtype=np.int64),
        "token_type_ids": np.zeros((batch, seq), dtype=np.int64),
    }


def copy_export(source: Path, target: Path) -> Path:
    """A private copy of an export directory (tests that change files must not touch the shared one)."""
    shutil.copytree(source, target)
    return target


def placement(model: onnx.ModelProto) -> dict[str, tuple[int | None, int | None]]:
    """Each top-level node's (IPU, pipeline stage) as annotated, by node name (or output name)."""

    def attribute(node: onnx.NodeProto, name: str) -> int | None:
        values = [a.i for a in node.attribute if a.name == name and a.type == onnx.AttributeProto.INT]
        return values[0] if values else None

    return {
        node.name or node.output[0]: (
            attribute(node, VIRTUAL_GRAPH_ATTRIBUTE),
            attribute(node, PIPELINE_STAGE_ATTRIBUTE),
        )
        for node in model.graph.node
    }


def emulator_session(onnx_dir: Path, cache_dir: Path, **options):
    """An emulator session on ``onnx_dir/model.onnx`` caching in ``cache_dir``, buckets of 8 and 16 tokens
    unless ``options`` say otherwise."""
    from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions
    from optimum_ipu_backend.session import IPUInferenceSession

    options = {
        "device": "emulator",
        "executable_cache_dir": str(cache_dir),
        "sequence_lengths": "8,16",
        **options,
    }
    return IPUInferenceSession(
        str(onnx_dir / "model.onnx"), options=IPUProviderOptions.parse(options, onnx_dir)
    )


def cpu_outputs(onnx_dir: Path, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The export's outputs on onnxruntime's CPU provider."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    return session.run(None, feed)
