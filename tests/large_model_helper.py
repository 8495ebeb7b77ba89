"""A small BERT exported with its weights in an external data file, as exporters write large models.

The zoo's tiny models have no tensor large enough to count as a weight (``WEIGHT_MIN_BYTES``); this
one has (embeddings, attention and feed-forward matrices of 64 KiB and more), so the tests exercise
weights that stay in their files, the cache's shared weight files and the sharding pass over two
encoder layers. Built once per persistent zoo (file-locked) or test session.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from filelock import FileLock
from model_zoo import PERSISTENT_ZOO_ENV

from optimum_ipu_backend.compiler.passes.shard_over_ipus import (
    PIPELINE_STAGE_ATTRIBUTE,
    VIRTUAL_GRAPH_ATTRIBUTE,
)
from optimum_ipu_backend.conformance.zoo import export_onnx

TASK = "token-classification"
DATA_FILE = "model.onnx_data"
VOCAB = 512
LAYERS = 2
_VERSION = "large-models-1"


def _root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    persistent = os.environ.get(PERSISTENT_ZOO_ENV)
    if persistent:
        return Path(persistent).expanduser().resolve() / _VERSION
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return tmp_path_factory.getbasetemp().parent / _VERSION
    return tmp_path_factory.getbasetemp() / _VERSION


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
    root = _root(tmp_path_factory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / "bert-external"
    with FileLock(root / ".bert-external.lock"):
        if final.is_dir():
            return final
        model_dir = root / "bert-model"
        if not model_dir.is_dir():
            staging = Path(tempfile.mkdtemp(dir=root))
            _build_model(staging)
            os.replace(staging, model_dir)
        exported = export_onnx(model_dir, TASK, root / "bert-export")
        staging = Path(tempfile.mkdtemp(dir=root))
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
        os.replace(staging, final)
    return final


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
