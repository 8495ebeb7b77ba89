"""Generation with the key/value cache kept on the device (issue 25), on the host emulator: tokens
identical to CPUExecutionProvider for greedy, 4-beam and seeded sampling; one decode executable per
generation besides the prefill; one upload of the cache per generation (beam reorders are an index on the
device, not an upload); two generations interleaved from two threads; a cache edited by the caller; and
the same at the sizes users feed (512 tokens of context, 64 generated; 256 in the release check)."""

from __future__ import annotations

import pytest
from full_matrix import FULL

from integration import kv_cache_checks as checks
from optimum_ipu_backend.compiler import carried_state
from optimum_ipu_backend.runtime import executables


@pytest.fixture(scope="module")
def options(tmp_path_factory):
    return {"device": "emulator", "executable_cache_dir": str(tmp_path_factory.mktemp("kv-cache"))}


def _onnx(zoo, case: str) -> str:
    _, model, task = checks.CASES[case]
    return str(zoo.onnx(model, task))


@pytest.mark.parametrize("case", ["gpt2", "llama", "t5", "whisper"])
def test_tokens_match_cpu_with_one_decode_executable_and_one_upload(zoo, options, case):
    new_tokens = 24
    report = checks.check_modes(case, _onnx(zoo, case), options, context=20, new_tokens=new_tokens)
    for mode, result in report.items():
        assert result["tokens_equal"], f"{case} {mode}: tokens differ from CPU"
        assert result["distinct_tokens"] >= 3, f"{case} {mode}: degenerate generation"
        # every token after the first comes from the one decode executable; the prefill runs once
        assert result["decode_executables"] == [new_tokens - 1], (mode, result)
        assert result["streaming_executables"] == [1], (mode, result)
        assert result["uploads"] == 1, (mode, result)


#: New tokens at the sizes users feed. Each decoding step's new past length runs its own padding proof
#: (0.05 to 0.25 s at a past of 512 to 1,024 positions), which is most of the test's time; 64 steps still
#: carry the past beyond the 512-position bucket (a streamed cache would compile the 1,024 one too).
NEW_TOKENS_AT_USER_SIZES = 256 if FULL else 64


def test_at_the_sizes_users_feed(zoo, options):
    """512 tokens of context and 64 new ones (256 in the release check; GPT-2 with its real 1,024
    positions), greedy and 4 beams."""
    new_tokens = NEW_TOKENS_AT_USER_SIZES
    onnx_dir = _onnx(zoo, "gpt2-long")
    cpu = checks.load("gpt2-long", onnx_dir, None)
    ipu = checks.load("gpt2-long", onnx_dir, options)
    inputs = checks.inputs_for("gpt2-long", onnx_dir, 512)
    for mode in ("greedy", "beam 4"):
        expected = checks.generate(cpu, inputs, mode, new_tokens)
        with checks.counted_uploads() as uploads:
            got = checks.generate(ipu, inputs, mode, new_tokens)
        assert (expected == got).all(), mode
        assert len(uploads) == 1, mode
    decode = [e for e in ipu.model.compiled_executables() if e.get("kv_cache") == "device"]
    # one per batch size: 1 row, 4 beams
    assert [e["calls"] for e in decode] == [new_tokens - 1, new_tokens - 1]
    assert all(e["shapes"]["past_key_values.0.key"][2] == 1024 for e in decode)


def test_two_threads_interleaving_generations_keep_their_own_cache(zoo, options):
    new_tokens = 16
    report = checks.check_interleaved("gpt2", _onnx(zoo, "gpt2"), options, new_tokens)
    assert report["tokens_equal"] == [True, True]
    # in lock step each decoding step finds the other generation's cache on the device and uploads its own
    assert report["uploads"] >= new_tokens


@pytest.mark.parametrize("case", ["gpt2", "llama"])
def test_a_cache_edited_by_the_caller_is_uploaded_and_used(zoo, options, case):
    report = checks.check_edited_past(case, _onnx(zoo, case), options)
    assert report["edit_changes_logits"] > 1e-3  # the edit matters, so using the stale cache would show
    assert report["max_abs_diff"] <= checks.LOGITS_ATOL
    assert report["uploads"] == 1


def test_kv_cache_host_streams_the_cache(zoo, options):
    report = checks.check_modes("gpt2", _onnx(zoo, "gpt2"), {**options, "kv_cache": "host"}, 20, 12)
    for mode, result in report.items():
        assert result["tokens_equal"], mode
        assert result["decode_executables"] == [] and result["uploads"] == 0, (mode, result)


def test_a_graph_the_rewrite_refuses_is_streamed_with_its_verdict(zoo, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise carried_state.CarriedStateRefused("output 'present.0.key' is not a Concat of the past")

    monkeypatch.setattr(carried_state, "carry_state", refuse)
    monkeypatch.setattr(executables, "_legalized_files", {})  # no graph legalized by an earlier test
    onnx_dir = _onnx(zoo, "gpt2")
    ipu = checks.load("gpt2", onnx_dir, {"device": "emulator", "executable_cache_dir": str(tmp_path)})
    cpu = checks.load("gpt2", onnx_dir, None)
    inputs = checks.inputs_for("gpt2", onnx_dir, 20)
    assert (checks.generate(cpu, inputs, "greedy", 12) == checks.generate(ipu, inputs, "greedy", 12)).all()
    verdict = ipu.model.kv_cache_verdict()
    assert verdict.startswith("the key/value cache is streamed: output 'present.0.key'"), verdict
    assert not any(e.get("kv_cache") for e in ipu.model.compiled_executables())


def test_a_whole_generation_fits_in_two_executables(zoo, tmp_path):
    """max_executables=2: the prefill and the decode executable serve 40 tokens with the cache on the
    device; streaming the cache needs one executable per past bucket and hits the cap."""
    from optimum_ipu_backend.runtime.serving import ExecutableLimitError

    onnx_dir = _onnx(zoo, "gpt2")
    inputs = checks.inputs_for("gpt2", onnx_dir, 20)
    options = {"device": "emulator", "executable_cache_dir": str(tmp_path), "max_executables": "2"}
    expected = checks.generate(checks.load("gpt2", onnx_dir, None), inputs, "greedy", 40)
    device = checks.load("gpt2", onnx_dir, options)
    assert (checks.generate(device, inputs, "greedy", 40) == expected).all()
    assert len(device.model.compiled_executables()) == 2
    host = checks.load("gpt2", onnx_dir, {**options, "kv_cache": "host"})
    with pytest.raises(ExecutableLimitError, match="max_executables=2"):
        checks.generate(host, inputs, "greedy", 40)


@pytest.mark.parametrize("case", ["gpt2", "t5"])
def test_masks_kept_as_float32_where_the_engine_keeps_no_integer_state(zoo, tmp_path, monkeypatch, case):
    """An engine without integer state (PopTorch) gets GPT-2's attention mask and T5's past mask as
    float32 state (issue 36), which the emulator runs here in its place: the same tokens as CPU, one
    upload, and the verdict says how the masks are kept."""
    from optimum_ipu_backend.engines.emulator import HostEmulatorEngine

    monkeypatch.setattr(HostEmulatorEngine, "integer_state", False)
    options = {"device": "emulator", "executable_cache_dir": str(tmp_path / "cache")}
    report = checks.check_modes(case, _onnx(zoo, case), options, context=12, new_tokens=8)
    for mode, result in report.items():
        assert result["tokens_equal"], f"{case} {mode}: tokens differ from CPU"
        assert result["decode_executables"] == [7] and result["uploads"] == 1, (mode, result)
    ipu = checks.load(case, _onnx(zoo, case), options)
    checks.generate(ipu, checks.inputs_for(case, _onnx(zoo, case), 12), "greedy", 4)
    (session,) = [s for s in checks.decoder_sessions(ipu) if s.kv_cache_verdict() is not None]
    assert "masks kept as float32, exact up to 16777216" in session.kv_cache_verdict()
    decode = [e for e in session.compiled_executables() if e.get("kv_cache") == "device"]
    assert decode and all(e["calls"] == 3 for e in decode)


def test_a_mask_value_beyond_what_float32_state_holds_is_streamed(zoo, tmp_path, monkeypatch):
    """A step whose mask holds a value float32 state would not keep exactly is streamed, with CPU's
    logits; the steps around it keep the cache on the device. The bound is lowered to 1 here so that a
    mask value of 2 stands for one above 2**24 (which GPT-2's arithmetic would turn into infinities)."""
    import torch

    from optimum_ipu_backend.engines.emulator import HostEmulatorEngine

    monkeypatch.setattr(HostEmulatorEngine, "integer_state", False)
    monkeypatch.setattr(carried_state, "FLOAT32_EXACT_INTEGERS", 1)
    monkeypatch.setattr(executables, "_legalized_files", {})  # no graph rewritten with the real bound
    onnx_dir = _onnx(zoo, "gpt2")
    options = {"device": "emulator", "executable_cache_dir": str(tmp_path / "cache")}
    cpu, ipu = checks.load("gpt2", onnx_dir, None), checks.load("gpt2", onnx_dir, options)
    ids = checks.inputs_for("gpt2", onnx_dir, 10)["input_ids"]

    def step(model, ids, past, mask):
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, past_key_values=past, use_cache=True)

    first = step(ipu, ids, None, torch.ones((1, 10), dtype=torch.int64))
    token = first.logits[:, -1:].argmax(-1)
    second = step(ipu, token, first.past_key_values, torch.ones((1, 11), dtype=torch.int64))
    doubled = torch.ones((1, 12), dtype=torch.int64)
    doubled[0, 3] = 2
    past = tuple(tuple(t.clone() for t in layer) for layer in second.past_key_values)
    token = second.logits[:, -1:].argmax(-1)
    got = step(ipu, token, second.past_key_values, doubled).logits
    expected = step(cpu, token, past, doubled).logits
    assert float((got - expected).abs().max()) <= checks.LOGITS_ATOL
    decode = [e for e in ipu.model.compiled_executables() if e.get("kv_cache") == "device"]
    assert [e["calls"] for e in decode] == [1]  # the second step only; the third was streamed
