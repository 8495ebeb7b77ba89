"""Tiny Stable Diffusion XL, Latent Consistency, Stable Diffusion 3 and Flux pipelines (``PIPELINES``) and
the calls that compare each ORT pipeline class on them (``DIFFUSION_CASES``): test data for
tests/integration/test_diffusion_pipelines.py.

Each pipeline is built from small configs with random weights (``diffusers`` and ``transformers`` are test
dependencies): CLIP text encoders with the byte-level tokenizer of tests/class_zoo.py, a T5 encoder with
the conformance zoo's SentencePiece-style tokenizer, a UNet or a transformer, and a VAE of four levels, so
latents are an eighth of the image's side as in the released pipelines. It is exported by optimum-onnx's
exporter exactly as ``ORTDiffusionPipeline.from_pretrained(..., export=True)`` exports it, and each build
and export is keyed on disk by this file, so a changed case is never served from a stale build.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from class_zoo import clip_bpe_tokenizer, clip_text_encoder

from optimum_ipu_backend.conformance.zoo import (
    TINY_FFN,
    TINY_HEADS,
    TINY_HIDDEN,
    TINY_LAYERS,
    ModelZoo,
    build_once,
    export_onnx,
    seed_for,
    unigram_tokenizer,
)

#: The images' side in pixels. With the VAE's three downsamplings the latents are 32x32, those of a
#: released pipeline drawing 256x256 images; the tiny denoisers keep that fast on the CPU.
IMAGE_SIDE = 256
_PROMPTS = ["a red car", "the lazy dog"]
#: optimum's export task of every pipeline here; each ORT pipeline class loads the same export.
EXPORT_TASK = "text-to-image"
_VAE_LEVELS = {"block_out_channels": (8, 8, 16, 16), "norm_num_groups": 4, "layers_per_block": 1}


class DiffusionCase(NamedTuple):
    """One ORT pipeline class called on one tiny pipeline."""

    ort_class: str
    pipeline: str  # the key of ``PIPELINES`` it loads
    mode: str  # "text-to-image", "image-to-image" or "inpainting": what ``diffusion_call`` passes
    steps: int  # denoising steps (before image-to-image's strength)
    guidance_scale: float


def _t5_encoder(scratch: Path):
    import transformers

    unigram_tokenizer(
        scratch,
        special_tokens=["<pad>", "</s>", "<unk>"],
        templates=("$A </s>", "$A </s> $B </s>"),
        model_input_names=["input_ids", "attention_mask"],
        token_roles={"pad_token": "<pad>", "eos_token": "</s>"},
        model_max_length=16,
    )
    tokenizer = transformers.T5TokenizerFast.from_pretrained(scratch)
    config = transformers.T5Config(
        vocab_size=len(tokenizer),
        d_model=TINY_HIDDEN,
        d_kv=TINY_HIDDEN // TINY_HEADS,
        d_ff=TINY_FFN,
        num_layers=TINY_LAYERS,
        num_heads=TINY_HEADS,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return tokenizer, transformers.T5EncoderModel(config).eval()


def _vae(latent_channels: int, **config: Any):
    import diffusers

    return diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=latent_channels,
        sample_size=IMAGE_SIDE,
        **_VAE_LEVELS,
        **config,
    ).eval()


def _sdxl(scratch: Path):
    """SDXL: two CLIP text encoders (the second with a projection, its pooled output and the image's
    sizes feed the UNet's added time embedding) and a UNet whose second level cross-attends to both."""
    import diffusers

    tokenizer = clip_bpe_tokenizer(scratch)
    unet = diffusers.UNet2DConditionModel(
        sample_size=IMAGE_SIDE // 8,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(16, 32),
        norm_num_groups=8,
        layers_per_block=1,
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + TINY_HIDDEN,  # six sizes, the pooled text
        cross_attention_dim=2 * TINY_HIDDEN,  # both encoders' hidden states side by side
    ).eval()
    scheduler = diffusers.EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", timestep_spacing="leading"
    )
    return diffusers.StableDiffusionXLPipeline(
        vae=_vae(4),
        text_encoder=clip_text_encoder(tokenizer, projection=False),
        text_encoder_2=clip_text_encoder(tokenizer, projection=True, projection_dim=TINY_HIDDEN),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        unet=unet,
        scheduler=scheduler,
    )


def _lcm(scratch: Path):
    """A latent consistency model: one CLIP text encoder, a UNet that also embeds the guidance scale
    (``timestep_cond``) instead of running the batch twice, and the LCM scheduler."""
    import diffusers

    tokenizer = clip_bpe_tokenizer(scratch)
    unet = diffusers.UNet2DConditionModel(
        sample_size=IMAGE_SIDE // 8,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(16, 32),
        norm_num_groups=8,
        layers_per_block=1,
        cross_attention_dim=TINY_HIDDEN,
        attention_head_dim=4,
        time_cond_proj_dim=32,
    ).eval()
    scheduler = diffusers.LCMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    return diffusers.LatentConsistencyModelPipeline(
        vae=_vae(4),
        text_encoder=clip_text_encoder(tokenizer, projection=False),
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def _sd3(scratch: Path):
    """SD3: two projecting CLIP encoders and a T5 encoder feed an MMDiT transformer (joint attention of
    image patches and text), denoised by flow matching."""
    import diffusers

    tokenizer = clip_bpe_tokenizer(scratch)
    t5_tokenizer, t5 = _t5_encoder(scratch)
    transformer = diffusers.SD3Transformer2DModel(
        sample_size=IMAGE_SIDE // 8,
        patch_size=2,
        in_channels=16,  # SD3's latent channels, which its inpainting pipeline requires
        out_channels=16,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=TINY_HIDDEN,
        caption_projection_dim=TINY_HIDDEN,
        pooled_projection_dim=2 * TINY_HIDDEN,  # both CLIP encoders' pooled outputs
        pos_embed_max_size=IMAGE_SIDE // 16,
    ).eval()
    return diffusers.StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(
            16, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5
        ),
        text_encoder=clip_text_encoder(tokenizer, projection=True, projection_dim=TINY_HIDDEN),
        tokenizer=tokenizer,
        text_encoder_2=clip_text_encoder(tokenizer, projection=True, projection_dim=TINY_HIDDEN),
        tokenizer_2=tokenizer,
        text_encoder_3=t5,
        tokenizer_3=t5_tokenizer,
    )


def _flux(scratch: Path):
    """Flux: a CLIP encoder's pooled output and a T5 encoder's states feed a transformer of double- and
    single-stream blocks with rotary positions over 2x2-packed latents, denoised by flow matching."""
    import diffusers

    tokenizer = clip_bpe_tokenizer(scratch)
    t5_tokenizer, t5 = _t5_encoder(scratch)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * 4,  # 2x2 patches of 4 latent channels
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TINY_HIDDEN,
        pooled_projection_dim=TINY_HIDDEN,
        axes_dims_rope=(4, 4, 8),
    ).eval()
    return diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(4, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5),
        text_encoder=clip_text_encoder(tokenizer, projection=False),
        tokenizer=tokenizer,
        text_encoder_2=t5,
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
    )


class TinyPipeline(NamedTuple):
    build: Callable[[Path], Any]  # returns the diffusers pipeline; tokenizer files go to the given folder
    architecture: str  # the diffusers pipeline and its components, as docs/models.md lists them
    scheduler: str  # the scheduler's steps, as docs/models.md names them


PIPELINES: Mapping[str, TinyPipeline] = {
    "tiny-sdxl": TinyPipeline(
        _sdxl,
        "StableDiffusionXLPipeline (CLIPTextModel, CLIPTextModelWithProjection, UNet2DConditionModel "
        "with text_time embedding, AutoencoderKL)",
        "Euler",
    ),
    "tiny-lcm": TinyPipeline(
        _lcm,
        "LatentConsistencyModelPipeline (CLIPTextModel, UNet2DConditionModel with time_cond_proj_dim, "
        "AutoencoderKL)",
        "LCM",
    ),
    "tiny-sd3": TinyPipeline(
        _sd3,
        "StableDiffusion3Pipeline (2 CLIPTextModelWithProjection, T5EncoderModel, SD3Transformer2DModel, "
        "AutoencoderKL)",
        "flow-matching Euler",
    ),
    "tiny-flux": TinyPipeline(
        _flux,
        "FluxPipeline (CLIPTextModel, T5EncoderModel, FluxTransformer2DModel, AutoencoderKL)",
        "flow-matching Euler",
    ),
}

DIFFUSION_CASES: Mapping[str, DiffusionCase] = {
    "sdxl": DiffusionCase("ORTStableDiffusionXLPipeline", "tiny-sdxl", "text-to-image", 3, 5.0),
    "sdxl-img2img": DiffusionCase(
        "ORTStableDiffusionXLImg2ImgPipeline", "tiny-sdxl", "image-to-image", 4, 5.0
    ),
    "sdxl-inpaint": DiffusionCase("ORTStableDiffusionXLInpaintPipeline", "tiny-sdxl", "inpainting", 4, 5.0),
    "lcm": DiffusionCase("ORTLatentConsistencyModelPipeline", "tiny-lcm", "text-to-image", 2, 8.0),
    "lcm-img2img": DiffusionCase(
        "ORTLatentConsistencyModelImg2ImgPipeline", "tiny-lcm", "image-to-image", 4, 8.0
    ),
    "sd3": DiffusionCase("ORTStableDiffusion3Pipeline", "tiny-sd3", "text-to-image", 3, 5.0),
    "sd3-img2img": DiffusionCase("ORTStableDiffusion3Img2ImgPipeline", "tiny-sd3", "image-to-image", 4, 5.0),
    "sd3-inpaint": DiffusionCase("ORTStableDiffusion3InpaintPipeline", "tiny-sd3", "inpainting", 4, 5.0),
    "flux": DiffusionCase("ORTFluxPipeline", "tiny-flux", "text-to-image", 3, 3.5),
}


def diffusion_call(name: str) -> tuple[dict[str, Any], int]:
    """The arguments case ``name`` calls its pipeline with (besides the generator and ``output_type``) and
    the generator's seed: two prompts at ``IMAGE_SIDE`` pixels; image-to-image starts from random images
    at strength 0.75, inpainting repaints the middle half of random images."""
    case = DIFFUSION_CASES[name]
    call: dict[str, Any] = {
        "prompt": list(_PROMPTS),
        "guidance_scale": case.guidance_scale,
        "num_inference_steps": case.steps,
    }
    rng = np.random.default_rng(0)
    images = rng.random((len(_PROMPTS), IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.float32)
    if case.mode == "image-to-image":
        call.update(image=images, strength=0.75)
    else:
        call.update(height=IMAGE_SIDE, width=IMAGE_SIDE)
    if case.mode == "inpainting":
        mask = np.zeros((len(_PROMPTS), IMAGE_SIDE, IMAGE_SIDE, 1), np.float32)
        quarter = IMAGE_SIDE // 4
        mask[:, quarter:-quarter, quarter:-quarter] = 1
        call.update(image=images, mask_image=mask, strength=1.0)
    return call, 0


def build_pipeline(name: str, root: Path) -> Path:
    """Build (or reuse) the tiny pipeline ``PIPELINES[name]`` under ``root``; return its directory."""

    def build(staging: Path) -> None:
        import torch

        torch.manual_seed(seed_for(name, EXPORT_TASK))
        with tempfile.TemporaryDirectory(dir=root) as scratch:
            pipeline = PIPELINES[name].build(Path(scratch))
            pipeline.save_pretrained(staging)

    Path(root).mkdir(parents=True, exist_ok=True)
    return build_once(Path(root) / name, build)


class DiffusionZoo:
    """Builds and exports the ``PIPELINES`` under a directory of a ``ModelZoo``'s root keyed by this file
    (and by tests/class_zoo.py, whose tokenizer they use)."""

    def __init__(self, zoo: ModelZoo) -> None:
        digest = hashlib.sha256()
        for source in (Path(__file__), Path(__file__).with_name("class_zoo.py")):
            digest.update(source.read_bytes())
        self.root = zoo.root / f"diffusion-{digest.hexdigest()[:16]}"

    def model(self, name: str) -> Path:
        return build_pipeline(name, self.root / "models")

    def onnx(self, name: str) -> Path:
        """The export of pipeline ``name``: a folder per component, from the diffusers library."""
        return export_onnx(self.model(name), EXPORT_TASK, self.root / "onnx" / name, library_name="diffusers")
