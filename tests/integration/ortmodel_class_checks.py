"""Run in a fresh interpreter by test_ortmodel_classes.py: each ORTModel class of ``CLASS_CASES``
(tests/class_zoo.py) with provider="ipu" on the host emulator against the same class on
CPUExecutionProvider.
Prints one JSON object of measured figures per case; the test process applies the tolerances.

Nothing here calls ``install()``: the plugin must already be active from the installed package.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime
import optimum.onnxruntime as ort_models
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ortmodel_checks as checks  # noqa: E402
from ortmodel_checks import _flatten, _max_abs, _max_diff, _session_facts, main  # noqa: E402


def _held_sessions(model) -> dict[str, dict]:
    """Every session the model holds, by attribute (``model``, ``session``, ``encoder.session``,
    ``unet.session``, ...): its class, identity, and whether it is an ``onnxruntime.InferenceSession``, as
    optimum-onnx's own tests and user code check."""
    held = {}
    for name, value in vars(model).items():
        for path, candidate in ((name, value), (f"{name}.session", getattr(value, "session", None))):
            if callable(getattr(candidate, "run", None)) and callable(getattr(candidate, "get_inputs", None)):
                held[path] = {
                    "class": type(candidate).__name__,
                    "id": id(candidate),
                    "is_inference_session": isinstance(candidate, onnxruntime.InferenceSession),
                }
    return held


def _inputs(case: dict) -> dict[str, torch.Tensor]:
    with np.load(case["feeds"]) as feeds:
        return {name: torch.from_numpy(feeds[name]) for name in feeds.files}


def forward_case(case: dict) -> dict:
    cls = getattr(ort_models, case["class"])
    cpu = cls.from_pretrained(case["onnx_dir"], **checks.CPU)
    ipu = cls.from_pretrained(case["onnx_dir"], **checks.IPU)
    inputs = _inputs(case)
    with torch.no_grad():
        expected, got = cpu(**inputs), ipu(**inputs)
    tensors = _flatten(expected)
    return {
        "max_abs_diff": _max_diff(expected, got),
        "max_abs_expected": _max_abs(expected),
        # how far the outputs are from constant: a degenerate output would compare equal by accident
        "output_spread": min(float(t.float().max() - t.float().min()) for t in tensors),
        "output_shapes": [list(t.shape) for t in tensors],
        **_session_facts(ipu),
        "held_sessions": _held_sessions(ipu),
    }


def generate_case(case: dict) -> dict:
    cls = getattr(ort_models, case["class"])
    cpu = cls.from_pretrained(case["onnx_dir"], **checks.CPU)
    ipu = cls.from_pretrained(case["onnx_dir"], **checks.IPU)
    inputs = _inputs(case)
    # Each step of a longer past compiles once more where the past cannot be padded (ViT-GPT-2's positions
    # count from the past length), so few steps keep the run short.
    settings = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "num_beams": 1}
    expected = cpu.generate(**inputs, **settings)
    got = ipu.generate(**inputs, **settings)
    modes = checks.other_modes_equal(cpu, ipu, inputs, settings) if case.get("extra_modes") else None
    result = {
        "modes": modes,
        "tokens_equal": bool(torch.equal(expected, got)),
        "expected_tokens": expected.tolist(),
        "distinct_tokens": len(set(expected.flatten().tolist())),
        **_session_facts(ipu),
        "held_sessions": _held_sessions(ipu),
    }
    return result


def diffusion_case(case: dict) -> dict:
    import importlib

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for the zoos
    # the module whose diffusion_call gives the case's arguments: class_zoo (Stable Diffusion 1.x) or
    # diffusion_zoo (the SDXL, LCM, SD3 and Flux pipelines)
    diffusion_call = importlib.import_module(case.get("calls", "class_zoo")).diffusion_call

    cls = getattr(ort_models, case["class"])
    cpu = cls.from_pretrained(case["onnx_dir"], **checks.CPU)
    ipu = cls.from_pretrained(case["onnx_dir"], **checks.IPU)
    call, seed = diffusion_call(case["name"])
    expected, got = (
        pipeline(generator=torch.Generator().manual_seed(seed), output_type="np", **call).images
        for pipeline in (cpu, ipu)
    )
    return {
        "max_abs_diff": float(np.abs(expected - got).max()),
        "max_abs_expected": float(np.abs(expected).max()),
        "image_shape": list(expected.shape),
        "image_std": float(expected.std()),
        **_session_facts(ipu),
        "held_sessions": _held_sessions(ipu),
    }


# The provider options are read from ``checks.IPU`` at call time: the engine matrix
# (tests/engines/ortmodel_matrix.py) sets them to an SDK engine's device.
KINDS = {"forward": forward_case, "generate": generate_case, "diffusion": diffusion_case}

if __name__ == "__main__":
    main(KINDS)
