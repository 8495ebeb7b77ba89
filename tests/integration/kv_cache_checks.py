"""Checks of generation with the key/value cache kept on the device (``runtime.carried_state``), shared by
the emulator's tests (tests/integration/test_kv_cache_on_device.py, in process) and the engines' tests
against the SDK doubles (tests/engines/test_kv_cache_on_engines.py, in a subprocess with the double on the
path: ``python kv_cache_checks.py SPEC.json...`` prints one JSON line).

Every check compares with CPUExecutionProvider running the same export: generated tokens must be
identical, and a step's logits equal within ``LOGITS_ATOL``.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

#: (ORTModel class, zoo model, export task) of each decoder the device cache serves.
CASES: dict[str, tuple[str, str, str]] = {
    "gpt2": ("ORTModelForCausalLM", "gpt2", "text-generation-with-past"),
    "gpt2-long": ("ORTModelForCausalLM", "gpt2-long", "text-generation-with-past"),
    "gpt2-72-layers": ("ORTModelForCausalLM", "gpt2-72-layers", "text-generation-with-past"),
    "llama": ("ORTModelForCausalLM", "llama", "text-generation-with-past"),
    "t5": ("ORTModelForSeq2SeqLM", "t5", "text2text-generation-with-past"),
    "whisper": ("ORTModelForSpeechSeq2Seq", "whisper", "automatic-speech-recognition-with-past"),
}
MODES: dict[str, dict[str, Any]] = {
    "greedy": {"do_sample": False, "num_beams": 1},
    "beam 4": {"do_sample": False, "num_beams": 4},
    "sampling": {"do_sample": True, "num_beams": 1},
}
LOGITS_ATOL = 1e-4
DECODER_PARTS = ("model", "decoder", "decoder_with_past")


def load(case: str, onnx_dir: str | Path, options: Mapping[str, str] | None) -> Any:
    """The export on CPU (``options`` None) or on the ipu provider with ``options``."""
    import optimum.onnxruntime as ort_models

    cls = getattr(ort_models, CASES[case][0])
    if options is None:
        return cls.from_pretrained(onnx_dir, provider="CPUExecutionProvider")
    return cls.from_pretrained(onnx_dir, provider="ipu", provider_options=dict(options))


def inputs_for(case: str, onnx_dir: str | Path, context: int, seed: int = 0) -> dict[str, Any]:
    """generate() inputs: ``context`` random ordinary tokens (one row), or 30 s of random audio."""
    import torch
    import transformers

    rng = np.random.default_rng(seed)
    config = transformers.AutoConfig.from_pretrained(onnx_dir)
    if CASES[case][0] == "ORTModelForSpeechSeq2Seq":
        extractor = transformers.AutoFeatureExtractor.from_pretrained(onnx_dir)
        wave = (0.1 * rng.standard_normal(extractor.n_samples)).astype(np.float32)
        features = extractor(wave, sampling_rate=extractor.sampling_rate, return_tensors="np")[
            "input_features"
        ]
        return {"input_features": torch.from_numpy(np.asarray(features, dtype=np.float32))}
    low = max(config.pad_token_id or 0, config.eos_token_id or 0, config.bos_token_id or 0) + 1
    ids = torch.from_numpy(rng.integers(low, config.vocab_size, size=(1, context), dtype=np.int64))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def generate(model: Any, inputs: Mapping[str, Any], mode: str, new_tokens: int, seed: int = 0, **extra: Any):
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(
            **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **MODES[mode], **extra
        )


def decoder_sessions(model: Any) -> list[Any]:
    parts = [getattr(model, name, None) for name in DECODER_PARTS]
    sessions = [getattr(part, "session", part) for part in parts if part is not None]
    found = [session for session in sessions if hasattr(session, "compiled_executables")]
    encoder = getattr(getattr(model, "encoder", None), "session", None)
    return [session for session in found if session is not encoder]


@contextlib.contextmanager
def counted_uploads() -> Iterator[list[int]]:
    """Bytes of each state upload (``ExecutableTable.write_state``) while active."""
    from optimum_ipu_backend.runtime.executables import ExecutableTable

    uploads: list[int] = []
    original = ExecutableTable.write_state

    def write_state(table: Any, entry: Any, values: Mapping[str, np.ndarray]) -> None:
        uploads.append(sum(int(np.asarray(value).nbytes) for value in values.values()))
        original(table, entry, values)

    ExecutableTable.write_state = write_state  # type: ignore[method-assign]
    try:
        yield uploads
    finally:
        ExecutableTable.write_state = original  # type: ignore[method-assign]


def check_modes(
    case: str, onnx_dir: str, options: Mapping[str, str], context: int, new_tokens: int
) -> dict[str, Any]:
    """Per mode, on a freshly loaded ipu model: tokens equal to CPU's, state uploads, and the executables
    of the decoder sessions (decode executables keeping the cache on the device, and their calls)."""
    cpu = load(case, onnx_dir, None)
    inputs = inputs_for(case, onnx_dir, context)
    report: dict[str, Any] = {}
    for mode in MODES:
        expected = generate(cpu, inputs, mode, new_tokens)
        ipu = load(case, onnx_dir, options)
        with counted_uploads() as uploads:
            got = generate(ipu, inputs, mode, new_tokens)
        entries = [entry for session in decoder_sessions(ipu) for entry in session.compiled_executables()]
        report[mode] = {
            "tokens_equal": bool(expected.shape == got.shape and (expected == got).all()),
            "distinct_tokens": len(set(expected[0, -new_tokens:].tolist())),
            "uploads": len(uploads),
            "decode_executables": [int(e["calls"]) for e in entries if e.get("kv_cache") == "device"],
            "streaming_executables": [int(e["calls"]) for e in entries if e.get("kv_cache") != "device"],
        }
    return report


class _Lockstep:
    """A logits processor that makes each generation wait for the other at every step, so that two
    threads' decoding steps interleave on the session."""

    def __init__(self, barrier: threading.Barrier) -> None:
        self.barrier = barrier

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.barrier.wait(timeout=120)
        return scores


def check_interleaved(
    case: str, onnx_dir: str, options: Mapping[str, str], new_tokens: int
) -> dict[str, Any]:
    """Two generations on ONE ipu model from two threads, in lock step: each must equal CPU's alone."""
    from transformers import LogitsProcessorList

    cpu = load(case, onnx_dir, None)
    prompts = [inputs_for(case, onnx_dir, 12, seed) for seed in (1, 2)]
    expected = [generate(cpu, prompt, "greedy", new_tokens) for prompt in prompts]
    ipu = load(case, onnx_dir, options)
    barrier = threading.Barrier(2)
    results: list[Any] = [None, None]
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            processors = LogitsProcessorList([_Lockstep(barrier)])
            results[index] = generate(ipu, prompts[index], "greedy", new_tokens, logits_processor=processors)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)
            barrier.abort()

    with counted_uploads() as uploads:
        threads = [threading.Thread(target=work, args=(index,)) for index in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
    if errors:
        raise errors[0]
    return {
        "tokens_equal": [bool((a == b).all()) for a, b in zip(expected, results, strict=True)],
        "uploads": len(uploads),
    }


def check_edited_past(case: str, onnx_dir: str, options: Mapping[str, str]) -> dict[str, Any]:
    """A decoder-only model stepped by hand: the caller edits the returned cache in place (it is a view of
    the runtime's mirror) and passes it back; the next step must use the edited values."""
    import torch

    cpu = load(case, onnx_dir, None)
    ipu = load(case, onnx_dir, options)
    prompt = inputs_for(case, onnx_dir, 10)

    def step(model: Any, ids: Any, past: Any) -> Any:
        mask = torch.ones(
            (1, ids.shape[1] + (0 if past is None else past[0][0].shape[-2])), dtype=torch.int64
        )
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, past_key_values=past, use_cache=True)

    def clone(past: Any) -> Any:
        return tuple(tuple(t.clone() for t in layer) for layer in past)

    first = step(ipu, prompt["input_ids"], None)
    token = first.logits[:, -1:].argmax(-1)
    second = step(ipu, token, first.past_key_values)  # uploads: the past came from the prefill
    token = second.logits[:, -1:].argmax(-1)
    past = second.past_key_values
    unedited = step(cpu, token, clone(past)).logits
    past[0][0][:, :, 3, :] += 0.75  # in place, into the views the session returned
    past[1][1][:, :, -1, :] *= -1.0
    with counted_uploads() as uploads:
        third = step(ipu, token, past).logits
    expected = step(cpu, token, clone(past)).logits
    return {
        "max_abs_diff": float((third - expected).abs().max()),
        "edit_changes_logits": float((expected - unedited).abs().max()),
        "uploads": len(uploads),
    }


def run_spec(spec_path: str) -> dict[str, Any]:
    """Run the checks a JSON spec lists ({"case", "onnx_dir", "options", "context", "new_tokens",
    "checks": [...]})."""
    spec = json.loads(Path(spec_path).read_text())
    case, onnx_dir, options = spec["case"], spec["onnx_dir"], spec["options"]
    results: dict[str, Any] = {}
    if "modes" in spec["checks"]:
        results["modes"] = check_modes(case, onnx_dir, options, spec["context"], spec["new_tokens"])
    if "interleaved" in spec["checks"]:
        results["interleaved"] = check_interleaved(case, onnx_dir, options, spec["new_tokens"])
    if "edited" in spec["checks"]:
        results["edited"] = check_edited_past(case, onnx_dir, options)
    return results


def main(spec_paths: list[str]) -> None:
    """Run each spec in turn (one interpreter and one SDK worker for them all; every check loads its own
    models) and print their results as one JSON line, a list in the specs' order."""
    print(json.dumps([run_spec(path) for path in spec_paths]))


if __name__ == "__main__":
    main(sys.argv[1:])
