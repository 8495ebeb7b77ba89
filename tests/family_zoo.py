"""Tiny models of the architecture families whose graph patterns the compiler had to learn (issue 11).

Test-only, beside the conformance zoo (``optimum_ipu_backend.conformance.zoo``, the suite's matrix): each
family is built from a config with random weights and exported by optimum's exporter exactly as the zoo
exports (``export_onnx``), so a pattern test runs the graph a user of that family gets. CLIP, the
family of the ArgMax pattern, is the zero-shot class model of ``class_zoo`` (``CLASS_CASES["clip"]``).

* ``falcon``: FalconForCausalLM with past. Its causal mask is built by slice assignment,
  ``mask[:, :, :, :n] = mask[:, :, :, :n].masked_fill(...)``, which exports as a ScatterND.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from model_zoo import PERSISTENT_ZOO_ENV

from optimum_ipu_backend.conformance.zoo import build_once, cache_fingerprint, export_onnx

FALCON_TASK = "text-generation-with-past"
_VOCAB = 99


def _falcon() -> Any:
    import transformers

    config = transformers.FalconConfig(
        vocab_size=_VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    return transformers.FalconForCausalLM(config)


_BUILDERS: dict[str, tuple[Callable[[], Any], str]] = {
    "falcon": (_falcon, FALCON_TASK),
}


def family_root(fallback: Path) -> Path:
    """Where family models live: beside the persistent zoo when one is configured, keyed by this file."""
    persistent = os.environ.get(PERSISTENT_ZOO_ENV)
    digest = hashlib.sha256(Path(__file__).read_bytes() + cache_fingerprint().encode()).hexdigest()[:16]
    base = Path(persistent).expanduser() if persistent else Path(fallback)
    return (base / f"families-{digest}").resolve()


def family_export(name: str, root: Path) -> Path:
    """Build (once) the family's tiny model under ``root`` and export it (once); return the export dir."""
    build, task = _BUILDERS[name]

    def save(staging: Path) -> None:
        import torch

        torch.manual_seed(0)
        model = build()
        model.eval()
        model.save_pretrained(staging)

    return export_onnx(build_once(root / "models" / name, save), task, root / "onnx" / name)


def falcon_feeds(batch: int = 2, new: int = 3, past: int = 5, seed: int = 0) -> dict[str, np.ndarray]:
    """A step after a prompt: random past key/values (multi-query: one key/value head), a left-padded row."""
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {"input_ids": rng.integers(1, _VOCAB, (batch, new))}
    mask = np.ones((batch, past + new), np.int64)
    mask[-1, :2] = 0
    feeds["attention_mask"] = mask
    feeds["position_ids"] = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, past:]
    for layer in range(2):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{layer}.{kind}"] = rng.standard_normal((batch, 1, past, 8)).astype(
                np.float32
            )
    return feeds
