"""The key/value cache kept on the device (issue 25) on the PopART and PopTorch engines against the SDK
doubles: the emulator's checks (tests/integration/kv_cache_checks.py) run unchanged in a fresh interpreter
with the double on the path. Tokens identical to CPU for greedy, 4-beam and seeded sampling with one
decode executable and one upload per generation; two generations interleaved from two threads; a cache
edited by the caller. PopTorch keeps the cache in module buffers updated in place, PopART in variables
written by CopyVarUpdate (see engines/poptorch.py and engines/popart.py for what each costs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from full_matrix import Matrix
from integration import kv_cache_checks as checks
from sdk_testing import sdk_environment
from subprocess_env import python

NEW_TOKENS = 8
# Every check on GPT-2; the modes on the other decoders (Llama: rotary positions and grouped-query
# attention; T5 and Whisper: a cross-attention cache kept unchanged, the past padded on the left). By
# default every check runs on both engines and each decoder on one or both (PopTorch: GPT-2, Llama, T5;
# PopART, whose state the same graph form carries: GPT-2, Whisper); the release check runs them all on both.
PLAN = {"gpt2": ["modes", "interleaved", "edited"], "llama": ["modes"], "t5": ["modes"], "whisper": ["modes"]}
ENGINES = ("popart", "poptorch")
MATRIX = Matrix(
    "kv-cache-on-engines",
    product=[(engine, case) for engine in ENGINES for case in PLAN],
    share=[
        ("popart", "gpt2"),
        ("popart", "whisper"),
        ("poptorch", "gpt2"),
        ("poptorch", "llama"),
        ("poptorch", "t5"),
    ],
    covers={
        "engine": lambda run: run[0],
        "decoder": lambda run: run[1],
        "check on each engine": lambda run: frozenset((run[0], check) for check in PLAN[run[1]]),
    },
    why="each decoder on each engine is a fresh interpreter, a worker and a generation per mode",
)


def _run(tmp_path: Path, zoo, engine: str) -> dict:
    """Every decoder of ``engine`` in the share, in one fresh interpreter with the double on the path."""
    environment = sdk_environment(tmp_path, ipus=4)
    script = Path(checks.__file__)
    cases = [case for run_engine, case in MATRIX.cases if run_engine == engine]
    specs = []
    for case in cases:
        _, model, task = checks.CASES[case]
        spec = tmp_path / f"{case}.json"
        options = {"device": "ipu-model", "engine": engine, "executable_cache_dir": str(tmp_path / "cache")}
        spec.write_text(
            json.dumps(
                {
                    "case": case,
                    "onnx_dir": str(zoo.onnx(model, task)),
                    "options": options,
                    "context": 12,
                    "new_tokens": NEW_TOKENS,
                    "checks": PLAN[case],
                }
            )
        )
        specs.append(str(spec))
    completed = python(
        f"import runpy, sys; sys.argv = ['checks', *{specs!r}]; "
        f"runpy.run_path({str(script)!r}, run_name='__main__')",
        timeout=1200 * len(specs),
        env={**environment, "OPTIMUM_IPU_WORKER_IDLE_SECONDS": "60"},
    )
    assert completed.returncode == 0, completed.stderr[-5000:]
    return dict(zip(cases, json.loads(completed.stdout.strip().splitlines()[-1]), strict=True))


@pytest.mark.parametrize("engine", ENGINES)
def test_the_cache_stays_on_the_device_on_the_sdk_engines(tmp_path, zoo, engine):
    results = _run(tmp_path, zoo, engine)
    for case, report in results.items():
        for mode, result in report["modes"].items():
            assert result["tokens_equal"], f"{engine} {case} {mode}: tokens differ from CPU"
            assert result["decode_executables"] == [NEW_TOKENS - 1], (engine, case, mode, result)
            assert result["uploads"] == 1, (engine, case, mode, result)
    assert results["gpt2"]["interleaved"]["tokens_equal"] == [True, True]
    assert results["gpt2"]["interleaved"]["uploads"] >= NEW_TOKENS
    edited = results["gpt2"]["edited"]
    assert edited["edit_changes_logits"] > 1e-3 and edited["uploads"] == 1
    assert edited["max_abs_diff"] <= checks.LOGITS_ATOL
