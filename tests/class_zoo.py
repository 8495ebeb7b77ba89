"""One tiny model for each ORTModel class optimum-onnx exports beyond the conformance matrix, and the
diffusion pipelines (``CLASS_CASES``): test data for tests/integration/test_ortmodel_classes.py and the
engine matrix (tests/engines/ortmodels_on_engines.py).

Test-only, beside the conformance zoo (``optimum_ipu_backend.conformance.zoo``), whose sizes, seeds,
tokenizers and exporter these share: each model is built from a small config with random weights and
exported by optimum's exporter exactly as the zoo exports. ``class_zoo`` gives a zoo that builds them,
keyed on disk by this file, so a changed case is never served from a stale build.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from optimum_ipu_backend.conformance.zoo import (
    NUM_LABELS,
    TINY_ENCODER_SIZES,
    TINY_FFN,
    TINY_HEADS,
    TINY_HIDDEN,
    TINY_LAYERS,
    TINY_MAX_POSITIONS,
    ModelZoo,
    build_model,
    build_once,
    export_onnx,
    preprocessed_inputs,
    seed_for,
    unigram_tokenizer,
    wav2vec2_config,
)

if TYPE_CHECKING:
    import transformers

_TINY_SD = "StableDiffusionPipeline (CLIPTextModel, UNet2DConditionModel, AutoencoderKL, DDIMScheduler)"


class ClassCase(NamedTuple):
    """A tiny model of one ORTModel class: how it is built, exported and checked."""

    ort_class: str
    architecture: str  # the transformers architecture, as docs/models.md lists it
    export_task: str
    kind: str  # "forward": outputs compared; "generate": generated tokens compared


#: The ORTModel classes outside ``TASKS`` and ``PATTERN_TASKS``, one tiny model each. Built by
#: ``build_class_model`` and fed by ``class_inputs``; kept apart from the conformance matrix so that
#: adding a class costs one export, not a new column of the suite.
CLASS_CASES: Mapping[str, ClassCase] = {
    "clip": ClassCase(
        "ORTModelForZeroShotImageClassification", "CLIPModel", "zero-shot-image-classification", "forward"
    ),
    "vit-gpt2": ClassCase(
        "ORTModelForVision2Seq",
        "VisionEncoderDecoderModel (ViT + GPT-2)",
        "image-to-text-with-past",
        "generate",
    ),
    "pix2struct": ClassCase(
        "ORTModelForPix2Struct", "Pix2StructForConditionalGeneration", "image-to-text-with-past", "generate"
    ),
    "swin2sr": ClassCase(
        "ORTModelForImageToImage", "Swin2SRForImageSuperResolution", "image-to-image", "forward"
    ),
    "efficientnet": ClassCase(
        "ORTModelForImageClassification",
        "EfficientNetForImageClassification",
        "image-classification",
        "forward",
    ),
    "segformer": ClassCase(
        "ORTModelForSemanticSegmentation",
        "SegformerForSemanticSegmentation",
        "semantic-segmentation",
        "forward",
    ),
    "wav2vec2-ctc": ClassCase("ORTModelForCTC", "Wav2Vec2ForCTC", "automatic-speech-recognition", "forward"),
    "wav2vec2-audio-classification": ClassCase(
        "ORTModelForAudioClassification",
        "Wav2Vec2ForSequenceClassification",
        "audio-classification",
        "forward",
    ),
    "wav2vec2-xvector": ClassCase(
        "ORTModelForAudioXVector", "Wav2Vec2ForXVector", "audio-xvector", "forward"
    ),
    # Any graph with any inputs and outputs: BERT's feature-extraction export, outputs by name.
    "bert-custom": ClassCase("ORTModelForCustomTasks", "BertModel", "feature-extraction", "forward"),
    # Diffusion pipelines: their images are compared after a few denoising steps from one seed
    # (``diffusion_call``). Both load one export of one tiny Stable Diffusion pipeline.
    "tiny-sd": ClassCase("ORTPipelineForText2Image", _TINY_SD, "text-to-image", "diffusion"),
    "tiny-sd-img2img": ClassCase("ORTPipelineForImage2Image", _TINY_SD, "text-to-image", "diffusion"),
    "tiny-sd-inpaint": ClassCase(
        "ORTPipelineForInpainting",
        _TINY_SD.replace("Pipeline", "InpaintPipeline", 1),
        "inpainting",
        "diffusion",
    ),
}

_DIFFUSION_PROMPTS = ["a red car", "the lazy dog"]


def diffusion_call(name: str) -> tuple[dict[str, Any], int]:
    """The arguments a diffusion case calls its pipeline with (besides the generator and
    ``output_type``) and the generator's seed: two prompts, classifier-free guidance (the UNet runs the
    batch twice, with and without text) and 3 DDIM steps on 16x16 images; image-to-image starts from
    random images at strength 0.75 of 4 steps, inpainting repaints the middle 8x8 of random images."""
    call: dict[str, Any] = {"prompt": list(_DIFFUSION_PROMPTS), "guidance_scale": 7.5}
    images = np.random.default_rng(0).random((len(_DIFFUSION_PROMPTS), 16, 16, 3), dtype=np.float32)
    if name == "tiny-sd-img2img":
        call.update(image=images, strength=0.75, num_inference_steps=4)
    elif name == "tiny-sd-inpaint":
        mask = np.zeros((len(_DIFFUSION_PROMPTS), 16, 16, 1), np.float32)
        mask[:, 4:12, 4:12] = 1  # repaint the middle of each image
        call.update(image=images, mask_image=mask, height=16, width=16, num_inference_steps=3)
    else:
        call.update(height=16, width=16, num_inference_steps=3)
    return call, 0


_CLIP_EOS = 98
_CLIP_VOCAB = 99
_CLIP_IMAGE = 30
_VIT_GPT2_IMAGE = 32
_SWIN2SR_IMAGE = 16
_PIX2STRUCT_PATCHES = 16


def _clip_model(out_dir: Path) -> transformers.PreTrainedModel:
    import transformers

    text = transformers.CLIPTextConfig(
        vocab_size=_CLIP_VOCAB,
        hidden_size=TINY_HIDDEN,
        intermediate_size=TINY_FFN,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=TINY_HEADS,
        max_position_embeddings=16,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=_CLIP_EOS,  # not 2, so the text tower pools where input_ids == eos (an ArgMax)
    )
    vision = transformers.CLIPVisionConfig(
        hidden_size=TINY_HIDDEN,
        intermediate_size=TINY_FFN,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=TINY_HEADS,
        image_size=_CLIP_IMAGE,
        patch_size=15,
    )
    config = transformers.CLIPConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=8
    )
    return transformers.CLIPModel(config)


def _vit_gpt2_model(out_dir: Path) -> transformers.PreTrainedModel:
    import transformers

    encoder = transformers.ViTConfig(
        image_size=_VIT_GPT2_IMAGE, patch_size=8, num_channels=3, **TINY_ENCODER_SIZES
    )
    decoder = transformers.GPT2Config(
        vocab_size=_CLIP_VOCAB,
        n_positions=TINY_MAX_POSITIONS,
        n_embd=TINY_HIDDEN,
        n_layer=TINY_LAYERS,
        n_head=TINY_HEADS,
        n_inner=TINY_FFN,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        initializer_range=0.3,  # as for the zoo's GPT-2: greedy decoding of a random decoder varies
    )
    config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id = config.pad_token_id = config.eos_token_id = 0
    return transformers.VisionEncoderDecoderModel(config)


def _pix2struct_model(out_dir: Path) -> transformers.PreTrainedModel:
    import transformers

    # optimum's export reads the patch budget from the processor, so the model needs one: a T5-style
    # tokenizer (as for the zoo's T5) and an image processor of 4x4 patches.
    unigram_tokenizer(
        out_dir,
        special_tokens=["<pad>", "</s>", "<unk>"],
        templates=("$A </s>", "$A </s> $B </s>"),
        model_input_names=["input_ids", "attention_mask"],
        token_roles={"pad_token": "<pad>", "eos_token": "</s>"},
    )
    tokenizer = transformers.T5TokenizerFast.from_pretrained(out_dir)
    image_processor = transformers.Pix2StructImageProcessor(
        patch_size={"height": 4, "width": 4}, max_patches=_PIX2STRUCT_PATCHES
    )
    transformers.Pix2StructProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(
        out_dir
    )
    sizes = {"hidden_size": TINY_HIDDEN, "d_kv": TINY_HIDDEN // TINY_HEADS, "d_ff": TINY_FFN}
    text = transformers.Pix2StructTextConfig(
        vocab_size=len(tokenizer),
        num_layers=TINY_LAYERS,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        num_heads=TINY_HEADS,
        **sizes,
    )
    vision = transformers.Pix2StructVisionConfig(
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=TINY_HEADS,
        patch_embed_hidden_size=4 * 4 * 3,
        seq_len=_PIX2STRUCT_PATCHES,
        **sizes,
    )
    config = transformers.Pix2StructConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict(), initializer_factor=2.0
    )
    config.decoder_start_token_id = config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    return transformers.Pix2StructForConditionalGeneration(config)


def _swin2sr_model(out_dir: Path) -> transformers.PreTrainedModel:
    import transformers

    config = transformers.Swin2SRConfig(
        image_size=_SWIN2SR_IMAGE,
        patch_size=1,
        num_channels=3,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 2],
        window_size=4,
        upscale=2,
        upsampler="pixelshuffle",
    )
    return transformers.Swin2SRForImageSuperResolution(config)


def _efficientnet_model(out_dir: Path) -> transformers.PreTrainedModel:
    import torch
    import transformers

    config = transformers.EfficientNetConfig(
        image_size=_VIT_GPT2_IMAGE,
        width_coefficient=0.1,
        depth_coefficient=0.1,
        hidden_dim=128,  # round_filters(1280) at this width: the top convolution's channels
        num_labels=NUM_LABELS["image-classification"],
    )
    model = transformers.EfficientNetForImageClassification(config)
    # transformers draws every weight, batch-norm scales included, from N(0, 0.02): the signal dies within
    # a few blocks and the logits come out equal for every image. He-initialised convolutions and a
    # batch-norm scale of 1.3 keep the activations near 1 through all stages instead.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Conv2d):
                torch.nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
            elif isinstance(module, torch.nn.BatchNorm2d):
                module.reset_parameters()
                module.weight.fill_(1.3)
    return model


def _segformer_model(out_dir: Path) -> transformers.PreTrainedModel:
    import transformers

    config = transformers.SegformerConfig(
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[8, 16],
        patch_sizes=[7, 3],
        strides=[4, 2],
        num_attention_heads=[1, 2],
        mlp_ratios=[2, 2],
        decoder_hidden_size=16,
        num_labels=3,
    )
    return transformers.SegformerForSemanticSegmentation(config)


def _wav2vec2_head(class_name: str, **config_kwargs: Any) -> Callable[[Path], transformers.PreTrainedModel]:
    def build(out_dir: Path) -> transformers.PreTrainedModel:
        import transformers

        config = wav2vec2_config(out_dir)
        for key, value in config_kwargs.items():
            setattr(config, key, value)
        return getattr(transformers, class_name)(config)

    return build


def clip_bpe_tokenizer(out_dir: Path) -> transformers.CLIPTokenizer:
    """CLIP's byte-level BPE with no merges: one token per byte (and per byte ending a word), 514 ids."""
    import transformers
    from transformers.models.clip.tokenization_clip import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for symbol in (*symbols, *(f"{s}</w>" for s in symbols), "<|startoftext|>", "<|endoftext|>"):
        vocab.setdefault(symbol, len(vocab))
    (out_dir / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (out_dir / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    return transformers.CLIPTokenizer(
        str(out_dir / "vocab.json"), str(out_dir / "merges.txt"), model_max_length=16
    )


def clip_text_encoder(tokenizer, projection: bool = False, **sizes: int):
    """A tiny CLIP text encoder over ``tokenizer`` (``clip_bpe_tokenizer``), with the text projection when
    ``projection`` (SDXL's second encoder, SD3's); ``sizes``: further config fields (``projection_dim``)."""
    import transformers

    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = transformers.CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=TINY_HIDDEN,
        intermediate_size=TINY_FFN,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=TINY_HEADS,
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|startoftext|>"),
        eos_token_id=end,
        pad_token_id=end,
        **sizes,
    )
    cls = transformers.CLIPTextModelWithProjection if projection else transformers.CLIPTextModel
    return cls(config).eval()


def build_diffusion_pipeline(root: Path, inpainting: bool = False) -> Path:
    """Build (or reuse) a tiny Stable Diffusion pipeline under ``root`` and return its directory: a CLIP
    text encoder, a two-level UNet with cross-attention, a two-level VAE (16x16 images from 8x8
    latents) and a DDIM scheduler, each from a small config (``diffusers`` is a test dependency). An
    inpainting pipeline's UNet also reads the mask and the masked image's latents (9 channels)."""
    root = Path(root)

    def build(staging: Path) -> None:
        import diffusers
        import torch

        with tempfile.TemporaryDirectory(dir=root) as scratch:
            tokenizer = clip_bpe_tokenizer(Path(scratch))
        torch.manual_seed(seed_for("tiny-sd", "text-to-image"))
        text_encoder = clip_text_encoder(tokenizer)
        levels = {"block_out_channels": (16, 32), "norm_num_groups": 8, "layers_per_block": 1}
        unet = diffusers.UNet2DConditionModel(
            sample_size=8,
            in_channels=9 if inpainting else 4,
            out_channels=4,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=TINY_HIDDEN,
            attention_head_dim=4,
            **levels,
        )
        vae = diffusers.AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            latent_channels=4,
            sample_size=16,
            **levels,
        )
        scheduler = diffusers.DDIMScheduler(
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            clip_sample=False,
            set_alpha_to_one=False,
        )
        pipeline_class = "StableDiffusionInpaintPipeline" if inpainting else "StableDiffusionPipeline"
        pipeline = getattr(diffusers, pipeline_class)(
            vae=vae,
            text_encoder=text_encoder.eval(),
            tokenizer=tokenizer,
            unet=unet.eval(),
            scheduler=scheduler,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
        pipeline.save_pretrained(staging)

    return build_once(root / ("class-tiny-sd-inpaint" if inpainting else "class-tiny-sd"), build)


_CLASS_BUILDERS: Mapping[str, Callable[[Path], transformers.PreTrainedModel]] = {
    "clip": _clip_model,
    "vit-gpt2": _vit_gpt2_model,
    "pix2struct": _pix2struct_model,
    "swin2sr": _swin2sr_model,
    "efficientnet": _efficientnet_model,
    "segformer": _segformer_model,
    "wav2vec2-ctc": _wav2vec2_head("Wav2Vec2ForCTC", pad_token_id=0),
    "wav2vec2-audio-classification": _wav2vec2_head("Wav2Vec2ForSequenceClassification", num_labels=5),
    "wav2vec2-xvector": _wav2vec2_head(
        "Wav2Vec2ForXVector",
        tdnn_dim=(16, 16),
        tdnn_kernel=(3, 1),
        tdnn_dilation=(1, 1),
        xvector_output_dim=8,
    ),
}


def build_class_model(name: str, root: Path) -> Path:
    """Build (or reuse) the tiny model of ``CLASS_CASES[name]`` under ``root``; return its directory."""
    if name == "bert-custom":
        return build_model("bert", root, "feature-extraction")
    if name in CLASS_CASES and CLASS_CASES[name].kind == "diffusion":
        return build_diffusion_pipeline(root, inpainting=name == "tiny-sd-inpaint")
    if name not in _CLASS_BUILDERS:
        raise ValueError(f"unknown class model {name!r}; expected one of {tuple(CLASS_CASES)}")

    def build(staging: Path) -> None:
        import torch

        torch.manual_seed(seed_for(name, CLASS_CASES[name].export_task))
        model = _CLASS_BUILDERS[name](staging)
        model.eval()
        model.save_pretrained(staging)

    return build_once(Path(root) / f"class-{name}", build)


def class_inputs(name: str, model_dir: Path, batch: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs for ``CLASS_CASES[name]``: random pixels, patches or audio; CLIP's token ids end in its
    end-of-text token at a different position per row with padding after it (the last row padded most)."""
    rng = np.random.default_rng(seed)
    if name == "clip":
        seq = 7
        ids = rng.integers(2, _CLIP_EOS, (batch, seq))
        mask = np.ones((batch, seq), np.int64)
        for row in range(batch):
            end = seq - 1 - row % seq
            ids[row, end] = _CLIP_EOS
            ids[row, end + 1 :] = 1
            mask[row, end + 1 :] = 0
        pixels = rng.standard_normal((batch, 3, _CLIP_IMAGE, _CLIP_IMAGE)).astype(np.float32)
        return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels}
    if name == "pix2struct":
        # Images of different sizes, so the processor leaves 16, 8 and 4 real patches under the mask.
        import transformers

        processor = transformers.Pix2StructImageProcessor.from_pretrained(model_dir)
        sides = [(16, 16), (8, 16), (8, 8)]
        images = [rng.integers(0, 256, (*sides[row % len(sides)], 3), dtype=np.uint8) for row in range(batch)]
        encoded = processor(images=images, return_tensors="np")
        return {key: np.asarray(encoded[key]) for key in ("flattened_patches", "attention_mask")}
    if name.startswith("wav2vec2"):
        samples = 12 * 5 * 4  # 12 frames of the feature encoder's strides (5, 4)
        return {"input_values": (0.1 * rng.standard_normal((batch, samples))).astype(np.float32)}
    if name == "bert-custom":
        return preprocessed_inputs(model_dir, batch, seq=11, seed=seed)
    if CLASS_CASES[name].kind == "diffusion":
        raise ValueError(f"{name} is a pipeline called with prompts (diffusion_call), not with arrays")
    side = {"vit-gpt2": _VIT_GPT2_IMAGE, "efficientnet": _VIT_GPT2_IMAGE, "swin2sr": _SWIN2SR_IMAGE}.get(
        name, 32
    )
    return {"pixel_values": rng.standard_normal((batch, 3, side, side)).astype(np.float32)}


class ClassZoo(ModelZoo):
    """A ``ModelZoo`` that also builds and exports the ``CLASS_CASES`` models, under a directory of the
    zoo's root keyed by this file."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
        self.class_root = self.root / f"classes-{digest}"
        self._class_models: dict[str, Path] = {}
        self._class_exports: dict[tuple[str, str], Path] = {}

    def class_model(self, name: str) -> Path:
        """The built model of ``CLASS_CASES[name]`` (``bert-custom`` is the BERT base model)."""
        if name == "bert-custom":
            return self.model("bert", "feature-extraction")
        if name not in self._class_models:
            self._class_models[name] = build_class_model(name, self.class_root / "models")
        return self._class_models[name]

    def class_onnx(self, name: str) -> Path:
        """The export of ``CLASS_CASES[name]`` (``bert-custom`` is BERT's feature-extraction export)."""
        if name == "bert-custom":
            return self.onnx("bert", "feature-extraction")
        task = CLASS_CASES[name].export_task
        model_dir = self.class_model(name)  # the diffusion cases share one pipeline and its export
        key = (str(model_dir), task)
        if key not in self._class_exports:
            # a pipeline's export is a folder per component, from the diffusers library
            library = {"library_name": "diffusers"} if CLASS_CASES[name].kind == "diffusion" else {}
            self._class_exports[key] = export_onnx(
                model_dir, task, self.class_root / "onnx" / f"{model_dir.name}-{task}", **library
            )
        return self._class_exports[key]


_CLASS_ZOOS: dict[Path, ClassZoo] = {}


def class_zoo(zoo: ModelZoo) -> ClassZoo:
    """The class zoo beside ``zoo`` (the session's, from tests/model_zoo.py), one per root."""
    if zoo.root not in _CLASS_ZOOS:
        _CLASS_ZOOS[zoo.root] = ClassZoo(zoo.root)
    return _CLASS_ZOOS[zoo.root]
