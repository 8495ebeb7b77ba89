"""generate() on a fixed set of executables: the key/value cache is padded to past-length buckets, so a
64-token generation compiles one executable per bucket it touches, not one per token, and produces
the same tokens as CPU onnxruntime."""

from __future__ import annotations

import pytest
import torch

from optimum_ipu_backend.conformance.zoo import preprocessed_inputs

NEW_TOKENS = 64
# model -> (class, export task, the session that serves the per-token steps)
CASES = {
    "gpt2": ("ORTModelForCausalLM", "text-generation-with-past", "model"),
    "t5": ("ORTModelForSeq2SeqLM", "text2text-generation-with-past", "decoder_with_past"),
    "bart": ("ORTModelForSeq2SeqLM", "text2text-generation-with-past", "decoder_with_past"),
}


def _sessions(model) -> dict:
    parts = {
        name: getattr(model, name, None) for name in ("model", "encoder", "decoder", "decoder_with_past")
    }
    sessions = {name: getattr(part, "session", part) for name, part in parts.items() if part is not None}
    return {name: s for name, s in sessions.items() if hasattr(s, "compiled_executables")}


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_generation_is_token_identical_with_one_executable_per_bucket(zoo, name):
    import optimum.onnxruntime as ort_models

    cls_name, task, per_token_part = CASES[name]
    model_dir, onnx_dir = zoo.model(name, task), zoo.onnx(name, task)
    cls = getattr(ort_models, cls_name)
    cpu = cls.from_pretrained(onnx_dir, provider="CPUExecutionProvider")
    ipu = cls.from_pretrained(onnx_dir, provider="ipu", provider_options={"device": "emulator"})
    inputs = {
        k: torch.from_numpy(v)
        for k, v in preprocessed_inputs(model_dir, batch=2, seq=8).items()
        if k not in ("decoder_input_ids", "position_ids", "token_type_ids")
    }
    settings = {
        "max_new_tokens": NEW_TOKENS,
        "min_new_tokens": NEW_TOKENS,
        "do_sample": False,
        "num_beams": 1,
    }
    expected = cpu.generate(**inputs, **settings)
    got = ipu.generate(**inputs, **settings)
    assert torch.equal(expected, got)
    assert len(set(expected.flatten().tolist())) >= 3

    sessions = _sessions(ipu)
    assert per_token_part in sessions
    for part, session in sessions.items():
        stats = session.compiled_executables()
        sizes = session.bucket_sizes()
        # every executable ran at compiled sizes, and no more executables exist than distinct
        # shapes of compiled sizes the calls needed
        touched = {tuple(sorted(s["shapes"].items())) + tuple(sorted(s["branches"].items())) for s in stats}
        assert len(stats) == len(touched)
        calls = sum(s["calls"] for s in stats)
        assert len(stats) <= 6, (part, len(stats), sizes)
        if part == per_token_part:
            assert calls >= NEW_TOKENS - 1  # the per-token steps went through these few executables
