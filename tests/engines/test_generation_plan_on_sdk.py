"""Generation under ``serving_plan="cost"`` on the SDK double with one IPU: the prompt's executable and
the decode executable cannot both stay resident, so every generation would switch twice; the plan serves
the prompts and the decoding steps from one executable of the graph with a past instead (a step's new
token padded along the new tokens, a prompt's empty past along the past), with CPU onnxruntime's tokens
and scores. The choice itself, and the decode executable kept where the IPU groups hold both, are tested
on the planner alone (tests/runtime/test_serving_plan.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sdk_testing import configure

from optimum_ipu_backend.runtime.serving_plan import SHARED

NEW_TOKENS = 4
SCORES_ATOL = 1e-4


@pytest.fixture(scope="module")
def gpt2(zoo):
    return zoo.onnx("gpt2", "text-generation-with-past")


def _generate(model, prompts):
    results = []
    for prompt in prompts:
        ids = torch.from_numpy(prompt[None, :])
        results.append(
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
        )
    return results


def _counts(session) -> tuple[int, int, dict]:
    entries = session.compiled_executables()
    return (
        sum(int(entry["switches"]) for entry in entries),
        len(entries),
        {str(entry["shapes"]["input_ids"]): int(entry["calls"]) for entry in entries},
    )


def test_one_ipu_serves_prompts_and_steps_from_one_executable_without_switches(double, gpt2, tmp_path):
    from optimum.onnxruntime import ORTModelForCausalLM

    configure(double, ipus=1)
    rng = np.random.default_rng(0)
    # mixed prompt lengths up to most of the model's 128 positions (a tiny model: real sizes for it)
    lengths = [37, 9, 70, 21, 52]
    prompts = [rng.integers(5, 90, n, dtype=np.int64) for n in lengths]
    cpu = ORTModelForCausalLM.from_pretrained(gpt2, provider="CPUExecutionProvider")
    options = {
        "device": "ipu",
        "engine": "popart",
        "serving_plan": "cost",
        "ipu_groups": "1",
        "cost_measured": "0",
        "executable_cache_dir": str(tmp_path / "cache"),
        "progress": "0",
    }
    model = ORTModelForCausalLM.from_pretrained(gpt2, provider="ipu", provider_options=options)
    session = model.session
    try:
        _generate(model, prompts)  # the first pass plans, compiles in the background and swaps in
        assert session.wait_for_compiles(300)
        switches, executables, calls = _counts(session)
        got = _generate(model, prompts)  # the steady state
        after, executables_after, calls_after = _counts(session)
        assert session.serving_plan()["decode"]["arrangement"] == SHARED
        assert after == switches, "no switch in the steady state"
        assert executables_after == executables, "nothing compiled in the steady state"
        ran = {shape: calls_after[shape] - calls.get(shape, 0) for shape in calls_after}
        ran = {shape: count for shape, count in ran.items() if count}
        assert len(ran) == 1 and sum(ran.values()) == len(prompts) * NEW_TOKENS, ran  # one executable
    finally:
        session.close()
    want = _generate(cpu, prompts)
    for ours, theirs in zip(got, want, strict=True):
        assert torch.equal(ours.sequences, theirs.sequences)
        for a, b in zip(ours.scores, theirs.scores, strict=True):
            np.testing.assert_allclose(a.numpy(), b.numpy(), atol=SCORES_ATOL, rtol=0)
