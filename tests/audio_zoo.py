"""Tiny audio models at the real feature encoder's strides, and the real-size variants of the zoo's GPT-2
and ViT: test data for tests/integration/test_real_sizes.py and benchmarks/bench_audio_lengths.py.

Test-only, beside the conformance zoo (``optimum_ipu_backend.conformance.zoo``) and the class zoo
(tests/class_zoo.py), whose tiny sizes, seeds, feature extractor and exporter these share. Two families
of feature encoder, because they decide whether audio may be padded (issue 19):

* group norm (wav2vec2-base): ``feat_extract_norm="group"`` normalises the first convolution's output
  over time, so any padding changes every frame;
* layer norm (WavLM, HuBERT-large, wav2vec2-large-lv60): ``feat_extract_norm="layer"`` with
  ``do_stable_layer_norm=True`` normalises each frame on its own.

Each has a CTC, an audio classification, an x-vector and a frame classification head. The convolution
stack is wav2vec2-base's (strides 5,2,2,2,2,2,2: one frame per 320 samples, 49 frames per second of 16 kHz
audio, 1,499 for 30 s) at 16 channels; the zoo's own wav2vec2 (strides 5,4) yields one frame per 20
samples, whose 24,000 frames for 30 s would need 9 GB of attention scores per layer.

``real_size_zoo`` gives a zoo that builds them once per test session (or persistent zoo), keyed on disk
by this file, so a changed case is never served from a stale build.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from optimum_ipu_backend.conformance.zoo import (
    TINY_ENCODER_SIZES,
    ModelZoo,
    auto_model_class_for,
    build_once,
    export_onnx,
    seed_for,
    wav2vec2_config,
)

if TYPE_CHECKING:
    import transformers

SAMPLING_RATE = 16_000
#: wav2vec2-base's feature encoder (transformers' Wav2Vec2Config defaults), at 16 channels a layer.
CONV_STRIDE = (5, 2, 2, 2, 2, 2, 2)
CONV_KERNEL = (10, 3, 3, 3, 3, 2, 2)
CONV_DIM = (16,) * len(CONV_STRIDE)


class AudioCase(NamedTuple):
    """A tiny audio model: its ORTModel class, transformers class, feature-encoder norm and export task."""

    ort_class: str
    architecture: str
    norm: str  # "group" (normalised over time: exact only) or "layer" (per frame)
    export_task: str


_HEADS: Mapping[str, tuple[str, str, str]] = {
    # head: (ORTModel class, transformers class suffix, export task)
    "ctc": ("ORTModelForCTC", "ForCTC", "automatic-speech-recognition"),
    "audio-classification": (
        "ORTModelForAudioClassification",
        "ForSequenceClassification",
        "audio-classification",
    ),
    "xvector": ("ORTModelForAudioXVector", "ForXVector", "audio-xvector"),
    "frame-classification": (
        "ORTModelForAudioFrameClassification",
        "ForAudioFrameClassification",
        "audio-frame-classification",
    ),
}
_FAMILIES: Mapping[str, tuple[str, str]] = {"group": ("wav2vec2", "Wav2Vec2"), "layer": ("wavlm", "WavLM")}

#: ``<family>-<norm>-<head>``: wav2vec2 with group norm, WavLM with layer norm, each with every head.
AUDIO_CASES: Mapping[str, AudioCase] = {
    f"{family}-{norm}-{head}": AudioCase(ort_class, f"{prefix}{suffix}", norm, task)
    for norm, (family, prefix) in _FAMILIES.items()
    for head, (ort_class, suffix, task) in _HEADS.items()
}

# Heads' own sizes: label counts unlike the zoo's others, so a wrongly wired head cannot pass by accident.
_HEAD_SETTINGS: Mapping[str, Mapping[str, Any]] = {
    "automatic-speech-recognition": {"pad_token_id": 0},
    "audio-classification": {"num_labels": 5},
    "audio-frame-classification": {"num_labels": 7},
    "audio-xvector": {
        "tdnn_dim": (16, 16),
        "tdnn_kernel": (3, 1),
        "tdnn_dilation": (1, 1),
        "xvector_output_dim": 8,
        "num_labels": 3,
        # At the default 0.02 the x-vector's outputs are near 1e-4 (logits 6e-6), so a comparison at atol
        # 1e-4 could not fail; at 0.2 they are near 1 and 16,000 samples of zero padding left unmasked
        # after a 12,345-sample clip moves them by 0.1.
        "initializer_range": 0.2,
    },
}


def audio_config(out_dir: Path, case: AudioCase) -> transformers.PretrainedConfig:
    """The config of ``case``, with the zoo's wav2vec2 feature extractor (16 kHz, no attention mask, not
    normalised) saved to ``out_dir``."""
    import transformers

    base = wav2vec2_config(out_dir)  # writes the feature extractor; its sizes are the zoo's
    config_class = transformers.WavLMConfig if case.architecture.startswith("WavLM") else type(base)
    config = config_class(
        vocab_size=base.vocab_size,
        **TINY_ENCODER_SIZES,
        conv_dim=CONV_DIM,
        conv_stride=CONV_STRIDE,
        conv_kernel=CONV_KERNEL,
        num_conv_pos_embeddings=base.num_conv_pos_embeddings,
        num_conv_pos_embedding_groups=base.num_conv_pos_embedding_groups,
        feat_extract_norm=case.norm,
        do_stable_layer_norm=case.norm == "layer",
        **_HEAD_SETTINGS[case.export_task],
    )
    return config


def frames_for(samples: int) -> int:
    """Frames the feature encoder yields for ``samples`` (each convolution unpadded)."""
    for kernel, stride in zip(CONV_KERNEL, CONV_STRIDE, strict=True):
        samples = (samples - kernel) // stride + 1
    return samples


def audio_inputs(samples: int, batch: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    """``input_values`` of ``batch`` clips of ``samples`` random samples (speech-like scale, 0.1)."""
    rng = np.random.default_rng(seed)
    return {"input_values": (0.1 * rng.standard_normal((batch, samples))).astype(np.float32)}


def clip_lengths(count: int, seed: int = 0, shortest_s: float = 1.0, longest_s: float = 10.0) -> list[int]:
    """``count`` clip lengths in samples, uniform between ``shortest_s`` and ``longest_s`` seconds."""
    rng = np.random.default_rng(seed)
    low, high = round(shortest_s * SAMPLING_RATE), round(longest_s * SAMPLING_RATE)
    return [int(n) for n in rng.integers(low, high + 1, size=count)]


# ----------------------------------------------------------------------------------------------------
# Real-size variants of the zoo's text and image models
# ----------------------------------------------------------------------------------------------------


class Variant(NamedTuple):
    """A zoo model rebuilt with config overrides (fresh seeded weights, the base model's preprocessors)."""

    base: str  # the zoo model name
    task: str  # the export task
    overrides: Mapping[str, Any]


#: GPT-2 with room for a 1,024-token context; ViT at the common 224x224 and 384x384 (patch 16).
VARIANTS: Mapping[str, Variant] = {
    "gpt2-1040-positions": Variant("gpt2", "text-generation-with-past", {"n_positions": 1040}),
    # 144 key/value tensors of one shape, whose state positions (891 to 1,035) cross a digit count (issue 36).
    "gpt2-72-layers": Variant("gpt2", "text-generation-with-past", {"n_layer": 72}),
    # BERT with room for 512-token texts (the tiny zoo's BERT stops at 128), for static quantization.
    "bert-512-positions": Variant("bert", "feature-extraction", {"max_position_embeddings": 512}),
    "vit-224": Variant("vit", "image-classification", {"image_size": 224, "patch_size": 16}),
    "vit-384": Variant("vit", "image-classification", {"image_size": 384, "patch_size": 16}),
}


def _variant_preprocessors(variant: Variant, out_dir: Path) -> None:
    """Preprocessors that match the overrides: a long tokenizer limit, an image processor at the size."""
    import transformers

    if "image_size" in variant.overrides:
        side = variant.overrides["image_size"]
        transformers.ViTImageProcessor(size={"height": side, "width": side}).save_pretrained(out_dir)
    positions = variant.overrides.get("n_positions", variant.overrides.get("max_position_embeddings"))
    if positions is not None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
        tokenizer.model_max_length = positions
        tokenizer.save_pretrained(out_dir)


class RealSizeZoo:
    """Builds and exports ``AUDIO_CASES`` and ``VARIANTS`` beside a ``ModelZoo``, under a directory of
    the zoo's root keyed by this file, each once per process (and once per root on disk)."""

    def __init__(self, zoo: ModelZoo) -> None:
        self.zoo = zoo
        digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
        self.root = zoo.root / f"real-sizes-{digest}"
        self._exports: dict[str, Path] = {}

    def model(self, name: str) -> Path:
        """The saved transformers model of ``AUDIO_CASES[name]`` or ``VARIANTS[name]``."""
        if name in AUDIO_CASES:
            return build_once(self.root / "models" / name, lambda out: self._build_audio(name, out))
        if name in VARIANTS:
            return build_once(self.root / "models" / name, lambda out: self._build_variant(name, out))
        raise ValueError(f"unknown real-size model {name!r}; expected one of {(*AUDIO_CASES, *VARIANTS)}")

    def onnx(self, name: str) -> Path:
        """The export of ``name`` for its task, as ``from_pretrained(export=True)`` would make it."""
        if name not in self._exports:
            task = AUDIO_CASES[name].export_task if name in AUDIO_CASES else VARIANTS[name].task
            self._exports[name] = export_onnx(self.model(name), task, self.root / "onnx" / name)
        return self._exports[name]

    @staticmethod
    def _build_audio(name: str, out_dir: Path) -> None:
        import torch
        import transformers

        case = AUDIO_CASES[name]
        config = audio_config(out_dir, case)
        torch.manual_seed(seed_for(name, case.export_task))
        getattr(transformers, case.architecture)(config).eval().save_pretrained(out_dir)

    def _build_variant(self, name: str, out_dir: Path) -> None:
        import torch
        import transformers

        variant = VARIANTS[name]
        base_dir = self.zoo.model(variant.base, variant.task)
        for item in base_dir.iterdir():  # the tokenizer / processor files; the weights are rebuilt
            if item.is_file() and item.suffix not in (".safetensors", ".bin") and item.name != "config.json":
                shutil.copy2(item, out_dir / item.name)
        config = transformers.AutoConfig.from_pretrained(base_dir)
        for key, value in variant.overrides.items():
            setattr(config, key, value)
        _variant_preprocessors(variant, out_dir)
        torch.manual_seed(seed_for(name, variant.task))
        build_task = variant.task.removesuffix("-with-past")
        auto_model_class_for(build_task).from_config(config).eval().save_pretrained(out_dir)


_ZOOS: dict[Path, RealSizeZoo] = {}


def real_size_zoo(zoo: ModelZoo) -> RealSizeZoo:
    """The real-size zoo beside ``zoo`` (the session's, from tests/model_zoo.py), one per root."""
    if zoo.root not in _ZOOS:
        _ZOOS[zoo.root] = RealSizeZoo(zoo)
    return _ZOOS[zoo.root]
