"""Run in a fresh interpreter by test_ortmodels.py: every ORTModel class with provider="ipu" on the
host emulator against the same class on CPUExecutionProvider. Prints one JSON object of measured
figures per case; the test process applies the tolerances.

Nothing here calls ``install()``: the plugin must already be active from the installed package.
"""

from __future__ import annotations

import json
import sys
import traceback
import warnings
from pathlib import Path

import numpy as np
import onnxruntime
import optimum.onnxruntime as ort_models
import torch

from optimum_ipu_backend.conformance.zoo import preprocessed_inputs

IPU = {"provider": "ipu", "provider_options": {"device": "emulator"}}
CPU = {"provider": "CPUExecutionProvider"}


def _flatten(value) -> list:
    if value is None:
        return []
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _flatten(item)]
    if hasattr(value, "keys"):
        return [t for key in value.keys() for t in _flatten(value[key])]
    return [value]


def _max_diff(a, b) -> float:
    left, right = _flatten(a), _flatten(b)
    if len(left) != len(right) or not left:
        raise AssertionError(f"outputs differ in structure: {len(left)} vs {len(right)} tensors")
    return max(
        float((x.float() - y.float()).abs().max()) if x.numel() else 0.0
        for x, y in zip(left, right, strict=True)
    )


def _max_abs(value) -> float:
    """The largest magnitude among the outputs: the scale of float32 rounding differences."""
    return max((float(t.float().abs().max()) for t in _flatten(value) if t.numel()), default=0.0)


def _session_facts(model) -> dict:
    # ORTModel parts, then the components of a diffusion pipeline
    names = (
        "model",
        "encoder",
        "decoder",
        "decoder_with_past",
        "text_encoder",
        "text_encoder_2",
        "text_encoder_3",
        "unet",
        "transformer",
        "vae_encoder",
        "vae_decoder",
    )
    parts = [getattr(model, name, None) for name in names]
    sessions = [getattr(part, "session", part) for part in parts if part is not None]
    facts = []
    for session in sessions:
        if not hasattr(session, "get_providers"):
            continue  # whisper's `model` attribute is a torch stand-in, not a session
        facts.append(
            {
                # one session can sit in two parts (a seq2seq model's `model` is its encoder)
                "id": id(session),
                "type": type(session).__name__,
                # what optimum-onnx's own tests and user code check
                "is_inference_session": isinstance(session, onnxruntime.InferenceSession),
                "providers": [str(p) for p in session.get_providers()],
                "options": session.get_provider_options().get("IPUExecutionProvider", {}),
                "padding": session.padding_verdicts(),
                "kv_cache": session.kv_cache_verdict(),
                "device_cache_calls": sum(
                    int(entry["calls"])
                    for entry in session.compiled_executables()
                    if entry.get("kv_cache") == "device"
                ),
                "graph_notes": session.graph_notes(),
                "compiled_shapes": [
                    {name: list(shape) for name, shape in compiled["shapes"].items()}
                    for compiled in session.compiled_executables()
                ],
                "compiled_batches": sorted(
                    {
                        shape[0]
                        for compiled in session.compiled_executables()
                        for shape in compiled["shapes"].values()
                        if shape
                    }
                ),
            }
        )
    return {"provider": model.provider, "sessions": facts}


def _torch_inputs(name: str, model_dir: Path, drop=()) -> dict:
    # Sizes that are not compiled sizes (batch 3 -> 4, 11 tokens -> 12), so every case runs padded.
    inputs = preprocessed_inputs(model_dir, batch=3, seq=11)
    return {k: torch.from_numpy(v) for k, v in inputs.items() if k not in drop}


def forward_case(case: dict) -> dict:
    cls = getattr(ort_models, case["class"])
    cpu = cls.from_pretrained(case["onnx_dir"], **CPU)
    ipu = cls.from_pretrained(case["onnx_dir"], **case.get("ipu_kwargs", IPU))
    inputs = _torch_inputs(case["model"], Path(case["model_dir"]), drop=("decoder_input_ids", "position_ids"))
    with torch.no_grad():
        expected, got = cpu(**inputs), ipu(**inputs)
    result = {
        "max_abs_diff": _max_diff(expected, got),
        "max_abs_expected": _max_abs(expected),
        **_session_facts(ipu),
    }
    if case.get("io_binding"):
        bound = cls.from_pretrained(case["onnx_dir"], use_io_binding=True, **IPU)
        with torch.no_grad():
            result["io_binding_max_abs_diff"] = _max_diff(expected, bound(**inputs))
    if case.get("save_reload"):
        target = Path(case["scratch"]) / "saved"
        ipu.save_pretrained(target)
        reloaded = cls.from_pretrained(target, **IPU)
        with torch.no_grad():
            result["reload_max_abs_diff"] = _max_diff(expected, reloaded(**inputs))
        result["reload_provider"] = reloaded.provider
    return result


def generate_case(case: dict) -> dict:
    cls = getattr(ort_models, case["class"])
    kwargs = dict(case.get("load_kwargs", {}))
    cpu = cls.from_pretrained(case["onnx_dir"], **CPU, **kwargs)
    ipu = cls.from_pretrained(case["onnx_dir"], **IPU, **kwargs)
    inputs = _torch_inputs(case["model"], Path(case["model_dir"]), drop=("decoder_input_ids", "position_ids"))
    inputs.pop("token_type_ids", None)
    generate = {
        "max_new_tokens": case.get("new_tokens", 16),
        "do_sample": False,
        "num_beams": 1,
        "min_new_tokens": case.get("new_tokens", 16),
    }
    generate.update(case.get("generate_kwargs", {}))
    expected = cpu.generate(**inputs, **generate)
    got = ipu.generate(**inputs, **generate)
    modes = other_modes_equal(cpu, ipu, inputs, generate) if case.get("extra_modes") else None
    result = {
        "modes": modes,
        "tokens_equal": bool(torch.equal(expected, got)),
        "expected_tokens": expected.tolist(),
        "got_tokens": got.tolist(),
        "distinct_tokens": len(set(expected.flatten().tolist())),
        **_session_facts(ipu),
    }
    if case.get("io_binding"):
        bound = cls.from_pretrained(case["onnx_dir"], use_io_binding=True, **IPU, **kwargs)
        result["io_binding_tokens_equal"] = bool(torch.equal(expected, bound.generate(**inputs, **generate)))
    if not result["tokens_equal"] and expected.shape == got.shape:
        result["divergences"] = _divergences(cpu, inputs, generate, expected, got)
    return result


#: The generation modes a case with "extra_modes" also compares, on its first row (a batch the plan holds,
#: so that decoding steps keep the cache on the device), each seeded the same on both providers.
OTHER_MODES = {
    "greedy": {"do_sample": False, "num_beams": 1},
    "beam 4": {"do_sample": False, "num_beams": 4},
    "sampling": {"do_sample": True, "num_beams": 1},
}


def other_modes_equal(cpu, ipu, inputs: dict, settings: dict) -> dict[str, bool]:
    """For each of ``OTHER_MODES``: whether ``ipu`` generates CPU's tokens from the first row of
    ``inputs`` with ``settings`` otherwise."""
    row = {name: value[:1] for name, value in inputs.items()}
    equal = {}
    for mode, overrides in OTHER_MODES.items():
        tokens = []
        for model in (cpu, ipu):
            torch.manual_seed(0)
            with torch.no_grad():
                tokens.append(model.generate(**row, **{**settings, **overrides}))
        equal[mode] = bool(tokens[0].shape == tokens[1].shape and torch.equal(*tokens))
    return equal


def _divergences(cpu, inputs: dict, generate: dict, expected, got) -> list[dict]:
    """Where each row's tokens first differ: CPU's logit for its own token and for the other provider's,
    at that step, after the same prefix. A gap within the logits' rounding is a tie either side may break."""
    scored = cpu.generate(**inputs, **generate, output_scores=True, return_dict_in_generate=True)
    first_new = expected.shape[1] - len(scored.scores)
    found = []
    for row in range(expected.shape[0]):
        differing = torch.nonzero(expected[row] != got[row]).flatten().tolist()
        if not differing:
            continue
        step = differing[0] - first_new
        logits = scored.scores[step][row].float()
        finite = logits[torch.isfinite(logits)]
        found.append(
            {
                "row": row,
                "step": step,
                "gap": float(logits[expected[row, differing[0]]] - logits[got[row, differing[0]]]),
                "logit_scale": float(finite.abs().max()),
            }
        )
    return found


def pipeline_case(case: dict) -> dict:
    import transformers
    from optimum.pipelines import pipeline as optimum_pipeline

    cls = getattr(ort_models, case["class"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(case["model_dir"])
    cpu = cls.from_pretrained(case["onnx_dir"], **CPU)
    ipu = cls.from_pretrained(case["onnx_dir"], **IPU)
    texts = ["the cat sat on the mat", "a quick brown fox jumps over the lazy dog today"]
    expected = transformers.pipeline(case["task"], model=cpu, tokenizer=tokenizer, top_k=None)(texts)
    via_transformers = transformers.pipeline(case["task"], model=ipu, tokenizer=tokenizer, top_k=None)(texts)
    optimum_pipe = optimum_pipeline(
        case["task"], model=ipu, tokenizer=tokenizer, accelerator="ort", top_k=None
    )
    via_optimum = optimum_pipe(texts)

    def scores(out):
        return np.array([[d["score"] for d in sorted(row, key=lambda d: d["label"])] for row in out])

    return {
        "transformers_max_abs_diff": float(np.abs(scores(expected) - scores(via_transformers)).max()),
        "optimum_max_abs_diff": float(np.abs(scores(expected) - scores(via_optimum)).max()),
        "optimum_pipeline_model_provider": optimum_pipe.model.provider,
    }


KINDS = {"forward": forward_case, "generate": generate_case, "pipeline": pipeline_case}


def main(kinds=KINDS) -> None:
    """Run every case of the spec file named on the command line with its kind's check in ``kinds``."""
    cases = json.loads(Path(sys.argv[1]).read_text())
    results = {}
    for name, case in cases.items():
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                results[name] = kinds[case["kind"]](case)
            results[name]["fallback_warnings"] = [
                str(w.message) for w in caught if "Falling back" in str(w.message)
            ]
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
