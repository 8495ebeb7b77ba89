"""The diffusion pipelines after Stable Diffusion 1.x (``DIFFUSION_CASES`` of tests/diffusion_zoo.py): SDXL
text-to-image, image-to-image and inpainting, latent consistency text-to-image and image-to-image, SD3
text-to-image, image-to-image and inpainting, and Flux, each through its optimum-onnx class with
provider="ipu" on the host emulator against the same class on CPUExecutionProvider: from one seed, with
the same scheduler and steps, at 256x256 pixels (32x32 latents), the images agree within ``IMAGE_ATOL``.

The cases run in one fresh interpreter of the installed environment (ortmodel_class_checks.py, as the
Stable Diffusion 1.x cases of test_ortmodel_classes.py); this process builds and exports the pipelines.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from diffusion_zoo import DIFFUSION_CASES, IMAGE_SIDE, DiffusionZoo, diffusion_call
from full_matrix import Matrix
from subprocess_env import python_json

from integration.test_ortmodel_classes import _case

#: Pixel values are in [0, 1]; the emulator's images differ from CPU's by float32 rounding (a few 1e-6).
IMAGE_ATOL = 1e-4

MATRIX = Matrix(
    "diffusion-pipelines",
    product=DIFFUSION_CASES,
    # one UNet pipeline (SDXL: two text encoders, added time embeddings) and one transformer pipeline
    # (Flux: T5 and rotary positions over packed latents)
    share=("sdxl", "flux"),
    covers={"denoiser": lambda name: "transformer" if name.startswith(("sd3", "flux")) else "UNet"},
    why="each pipeline is a separate export of 5 to 7 ONNX files, 10 to 40 s on two cores, and each "
    "case compiles its denoiser and VAE on the emulator",
)


@pytest.fixture(scope="module")
def results(tmp_path_factory, zoo) -> dict:
    diffusion = DiffusionZoo(zoo)
    cases = {
        name: {
            "name": name,
            "kind": "diffusion",
            "calls": "diffusion_zoo",
            "class": DIFFUSION_CASES[name].ort_class,
            "onnx_dir": str(diffusion.onnx(DIFFUSION_CASES[name].pipeline)),
        }
        for name in MATRIX.cases
    }
    spec = tmp_path_factory.mktemp("diffusion-pipelines") / "cases.json"
    spec.write_text(json.dumps(cases))
    script = Path(__file__).with_name("ortmodel_class_checks.py")
    found = python_json(
        f"import runpy, sys; sys.argv = ['checks', {str(spec)!r}]; "
        f"runpy.run_path({str(script)!r}, run_name='__main__')"
    )
    for name, result in found.items():
        result["onnx_dir"] = cases[name]["onnx_dir"]
    return found


@pytest.mark.parametrize("name", MATRIX.cases)
def test_pipeline_draws_the_cpu_image(results, name):
    """The same seed, scheduler and steps give the same images; every component the mode needs (the text
    encoders, the UNet or transformer, the VAE decoder, and the VAE encoder from an image) ran on the
    emulator; the padding proof followed every component's graph to its verdict."""
    result = _case(results, name)
    assert result["max_abs_diff"] <= IMAGE_ATOL, result["max_abs_diff"]
    call, _ = diffusion_call(name)
    assert result["image_shape"] == [len(call["prompt"]), IMAGE_SIDE, IMAGE_SIDE, 3]
    assert result["image_std"] > 0.01, "a flat image cannot tell providers apart"
    components = {path.name for path in Path(result["onnx_dir"]).iterdir() if (path / "model.onnx").is_file()}
    if DIFFUSION_CASES[name].mode == "text-to-image":
        components.discard("vae_encoder")
    ran = [session for session in result["sessions"] if session["compiled_shapes"]]
    assert len(ran) == len(components), (sorted(components), result["sessions"])
    verdicts = [verdict for session in result["sessions"] for verdict in session["padding"].values()]
    assert not any("could not follow the graph" in verdict for verdict in verdicts), verdicts
    if DIFFUSION_CASES[name].pipeline == "tiny-sd3":
        # SD3's transformer adds its timestep (axis "step") to each row of the batch, so the batch cannot
        # be padded alone: the padding proof refuses it naming the node, not through an error of its own.
        tied = [verdict for verdict in verdicts if "ties a padded axis to one that is not padded" in verdict]
        assert len(tied) == 1 and tied[0].startswith("exact"), verdicts
