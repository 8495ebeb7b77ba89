"""Optimum's "optimize" step: models from ORTOptimizer (O1 to O4) through their ORTModel classes with
provider="ipu" on the host emulator, against CPU onnxruntime running the same optimized files.

O1 keeps standard operators; O2 and O3 fuse attention, skip layer normalizations and Gelu into
onnxruntime's own operators, which the compiler lowers back into opset 11. O1 to O3: forward outputs within
atol 1e-4, greedy generation gives the same ``NEW_TOKENS`` new tokens. O4 is O3 with float16 weights and
arithmetic: two correct float16 computations differ by their rounding order (onnxruntime sums a fused layer
norm's squares in a loop, ReduceMean does not), so its outputs agree within two float16 ulps of their
scale, and greedy tokens agree up to ties: where a row's tokens first differ, CPU's logits for the two
tokens lie within one float16 ulp of the logits' scale. The checks run in one fresh interpreter of the
installed environment (ortmodel_checks.py), as in test_ortmodels.py.

By default (CI on two cores) each architecture runs at one level that fuses (O2 or O3 and O4, which fuse as
O2 does), and every level runs on an encoder and on a generator (``DEFAULT_LEVELS``); the release check
(``OPTIMUM_IPU_FULL_MATRIX=1``) runs the whole product.

The padding proof has rules for the fused normalizations and activations (SkipLayerNormalization and its
RMS form, SimplifiedLayerNormalization, FastGelu, BiasGelu, QuickGelu: compiler/padding/rules.py), so a
generator fused into those alone (GPT-2 and Llama at O1 to O3, BART and T5 at some levels) serves its
decoding steps from one executable per bucket, as unfused. Fused Attention and RotaryEmbedding (Llama at
O4) have none and stop the proof, and some levels compute a position from the past's size (T5 at O2 and
O3, BART at O4): such a session compiles every decoding step at its own past length, one executable per
new token. The default generates 8 new tokens (7 decoding steps); the release check generates 32.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from full_matrix import FULL, Matrix
from subprocess_env import python

from optimum_ipu_backend.compiler.padding.rules import CONTRIB_RULES

ATOL = 1e-4
#: Each new token of a generator the proof stops compiles its own executable (see above).
NEW_TOKENS = 32 if FULL else 8
LEVELS = ("O1", "O2", "O3", "O4")

FORWARD = {
    "bert": ("ORTModelForSequenceClassification", "text-classification"),
    "roberta": ("ORTModelForSequenceClassification", "text-classification"),
    "vit": ("ORTModelForImageClassification", "image-classification"),
}
GENERATE = {
    "gpt2": ("ORTModelForCausalLM", "text-generation-with-past"),
    # RMSNorm (SimplifiedLayerNormalization), SiLU (QuickGelu) and, at O4, com.microsoft::RotaryEmbedding
    "llama": ("ORTModelForCausalLM", "text-generation-with-past"),
    "t5": ("ORTModelForSeq2SeqLM", "text2text-generation-with-past"),
    "bart": ("ORTModelForSeq2SeqLM", "text2text-generation-with-past"),
}


# The levels each architecture runs at by default, the smallest share that covers the dimensions below:
# every architecture at a level that fuses (O2, or O3 and O4, which fuse as O2 does and add Gelu
# approximation and float16), every level on an encoder and on a generator, and Llama at O4, the only level
# that fuses its rotary embedding (its RMSNorm and SiLU fuse there as at O3; O3 on a generator is BART's).
DEFAULT_LEVELS = {
    "bert": ("O1", "O4"),
    "roberta": ("O2",),
    "vit": ("O3",),
    "gpt2": ("O1", "O2"),
    "llama": ("O4",),
    "t5": ("O2",),
    "bart": ("O3",),
}
FUSING = ("O2", "O3", "O4")

MATRIX = Matrix(
    "optimized-models",
    product=[(model, level) for model in {**FORWARD, **GENERATE} for level in LEVELS],
    share=lambda case: case[1] in DEFAULT_LEVELS[case[0]],
    covers={
        "architecture": lambda case: case[0],
        "architecture at a level that fuses": lambda case: frozenset({case[0]} if case[1] in FUSING else ()),
        "level of an encoder or a generator": lambda case: (case[0] in FORWARD, case[1]),
        "rotary embedding fused (Llama at O4)": lambda case: frozenset(
            {case} if case == ("llama", "O4") else ()
        ),
    },
    why="each case is an ORTOptimizer pass and a CPU and an emulator run; O2 fuses as O3 and O4 do",
)


def _runs(models) -> list[tuple[str, str]]:
    return [(model, level) for model, level in MATRIX.cases if model in models]


@pytest.fixture(scope="module")
def results(tmp_path_factory, zoo) -> dict:
    cases = {}
    for model, level in MATRIX.cases:
        cls, task = {**FORWARD, **GENERATE}[model]
        cases[f"{model}-{level}"] = {
            "kind": "forward" if model in FORWARD else "generate",
            "class": cls,
            "model": model,
            "model_dir": str(zoo.model(model, task)),
            "onnx_dir": str(zoo.optimized(model, task, level)),
            "new_tokens": NEW_TOKENS,
            "scratch": str(tmp_path_factory.mktemp(f"{model}-{level}")),
        }
    spec = tmp_path_factory.mktemp("optimized") / "cases.json"
    spec.write_text(json.dumps(cases))
    script = Path(__file__).with_name("ortmodel_checks.py")
    completed = python(
        f"import runpy, sys; sys.argv = ['checks', {str(spec)!r}]; "
        f"runpy.run_path({str(script)!r}, run_name='__main__')",
        timeout=1500,
    )
    assert completed.returncode == 0, completed.stderr[-5000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _float16_ulp(scale: float) -> float:
    """The spacing of float16 numbers at ``scale``."""
    return float(np.spacing(np.float16(scale)))


def _on_the_emulator(result: dict) -> None:
    assert "error" not in result, result.get("error")
    assert result["provider"] == "IPUExecutionProvider"
    assert result["sessions"] and all(s["options"]["device"] == "emulator" for s in result["sessions"])
    assert result["fallback_warnings"] == []


@pytest.mark.parametrize(("model", "level"), _runs(FORWARD))
def test_an_optimized_encoder_matches_cpu(results, model, level):
    result = results[f"{model}-{level}"]
    _on_the_emulator(result)
    allowed = ATOL if level != "O4" else max(ATOL, 2 * _float16_ulp(result["max_abs_expected"]))
    assert result["max_abs_diff"] <= allowed, result


@pytest.mark.parametrize(("model", "level"), _runs(GENERATE))
def test_an_optimized_generator_gives_cpus_tokens(results, model, level):
    result = results[f"{model}-{level}"]
    _on_the_emulator(result)
    if level == "O4" and not result["tokens_equal"]:
        assert result["divergences"], result["expected_tokens"]
        for divergence in result["divergences"]:
            assert abs(divergence["gap"]) <= _float16_ulp(divergence["logit_scale"]), divergence
    else:
        assert result["tokens_equal"], result["expected_tokens"]
    assert result["distinct_tokens"] >= 3, "degenerate generation cannot tell providers apart"
    assert len(result["expected_tokens"][0]) >= NEW_TOKENS
    # the session of the decoding steps: the one that compiled the most
    steps = max(result["sessions"], key=lambda session: len(session["compiled_shapes"]))
    executables = len(steps["compiled_shapes"])
    exact = [why for why in steps["padding"].values() if why.startswith("exact sizes")]
    # the fused operators with padding rules never stop the proof; Attention and RotaryEmbedding do
    assert not any(f"com.microsoft::{op}," in why for why in exact for op in CONTRIB_RULES), exact
    if exact:  # a dimension the proof keeps exact (a past position computed from sizes): one per step
        assert executables >= NEW_TOKENS - 1, (executables, exact)
    else:  # the decoding steps share their bucket's executable, fused or not
        assert executables <= (NEW_TOKENS - 1) // 2, (executables, steps["padding"])
