"""The serving plan of ``serving_plan="cost"``: the cost model's choices, background compiles that no call
waits for, and the plan kept in the cache for the next process.

The planners are pure functions, tested on histograms. Through a real session on the emulator, a compile
is made as slow as the test wants with the emulator's ``compile_hook`` (an event the test holds): calls
keep being answered by the executable already compiled, each with what CPU onnxruntime gives.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from emulator_sessions import emulator_session
from subprocess_env import python_json

from optimum_ipu_backend.engines.emulator import HostEmulatorEngine
from optimum_ipu_backend.runtime.cost_model import (
    CostModel,
    PackedGroup,
    layout_cost,
    plan_layouts,
    plan_sizes,
)
from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions, ProviderOptionError

ATOL = 1e-5
SIZES = (8, 16, 32, 64, 128, 256, 512)


def _tokens(size: int) -> int:
    return size


# -- the cost model and its planners ----------------------------------------------------------------------


def test_one_slot_plans_the_smallest_size_that_holds_the_longest_call():
    histogram = {16: 900, 32: 90, 128: 10}
    assert plan_sizes(histogram, SIZES, 1, CostModel(), _tokens) == (128,)


def test_more_slots_add_sizes_only_where_their_saving_pays_their_compile():
    histogram = {16: 900, 32: 90, 128: 10}
    plan = plan_sizes(histogram, SIZES, 4, CostModel(), _tokens)
    assert plan[-1] == 128 and 16 in plan and len(plan) <= 4
    # a short horizon: saving 112 positions on 90% of the calls never pays a 2-minute compile
    short = CostModel(horizon_calls=1000)
    assert plan_sizes(histogram, SIZES, 4, short, _tokens) == (128,)
    # what an extra size saves, priced: horizon x calls' share x positions x seconds per position
    saving = 1e7 * 0.9 * (128 - 16) * 0.5e-6
    assert saving > CostModel().executable_seconds()


def test_cost_model_options_override_the_estimates_and_name_their_source():
    model = CostModel.from_options({"cost_compile_seconds": "600", "cost_token_seconds": 1e-6})
    assert (model.compile_seconds, model.load_seconds, model.token_seconds) == (600.0, 2.0, 1e-6)
    assert model.sources["compile_seconds"] == "option 'cost_compile_seconds'"
    assert "notebook" in model.sources["load_seconds"] or "optimum-graphcore" in model.sources["load_seconds"]
    assert model.price(waited_compiles=1, loads=2, switches=1, computed_tokens=2_000_000) == 600 + 6 + 2
    measured = model.measured(compile_seconds=42.0, load_seconds=None)
    assert measured.compile_seconds == 42.0 and measured.sources["compile_seconds"] == "measured"
    with pytest.raises(ProviderOptionError, match="cost_load_seconds"):
        IPUProviderOptions.parse({"device": "emulator", "cost_load_seconds": "-1"})


def test_packed_layouts_start_with_one_that_serves_every_group():
    def steps(rows: int, micro: int) -> int:
        return -(-rows // micro) * micro

    counts = (1, 2, 4, 8)
    groups = [PackedGroup(100, {64: 2, 128: 1, 512: 1}), PackedGroup(700, {64: None, 128: None, 512: 2})]
    candidates = [(tokens, micro) for tokens in (64, 128, 512) for micro in counts]
    plan = plan_layouts(groups, candidates, 1, CostModel(), counts, steps)
    assert len(plan) == 1
    assert all(layout_cost(group, plan[0], counts, steps) is not None for group in groups)
    assert plan == ((512, 2),)  # 1024 positions for the long group, 1024 for the short one
    more = plan_layouts(groups, candidates, 4, CostModel(), counts, steps)
    assert (512, 2) in more and len(more) == 2  # a third layout would save nothing
    added = next(layout for layout in more if layout != (512, 2))
    assert layout_cost(groups[0], added, counts, steps) == 128  # the short group in 128 positions


# -- through a session on the emulator ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def bert_tokens(zoo) -> Path:
    return zoo.onnx("bert", "token-classification")


def _calls(lengths, vocab: int = 100, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "input_ids": rng.integers(5, vocab, (1, n)),
            "attention_mask": np.ones((1, n), np.int64),
            "token_type_ids": np.zeros((1, n), np.int64),
        }
        for n in lengths
    ]


def _check_cpu(cpu: ort.InferenceSession, session, call) -> None:
    got = session.run(None, call)
    for result, reference in zip(got, cpu.run(None, call), strict=True):
        np.testing.assert_allclose(result, reference, atol=ATOL, rtol=0)


def test_calls_are_served_by_the_compiled_executable_while_the_planned_one_compiles(bert_tokens, tmp_path):
    cpu = ort.InferenceSession(str(bert_tokens / "model.onnx"), providers=["CPUExecutionProvider"])
    release = threading.Event()
    compiles: list[str] = []

    def slow_after_first(graph: Path) -> None:
        compiles.append(str(graph))
        if len(compiles) > 1:  # every compile after the first takes as long as the test says
            assert release.wait(120), "the test never released the compile"

    session = emulator_session(bert_tokens, tmp_path / "cache", serving_plan="cost", ipu_groups="4")
    engine = session.engine
    assert isinstance(engine, HostEmulatorEngine)
    engine.compile_hook = slow_after_first
    try:
        calls = _calls([20, 9, 31, 14, 18, 25, 12, 30, 17, 22, 11, 28])
        for call in calls:  # the first compiles the largest shape; the rest never wait
            _check_cpu(cpu, session, call)
        entries = session.compiled_executables()
        assert [entry["shapes"]["input_ids"] for entry in entries] == [(1, 128)]
        assert entries[0]["background"] is False and entries[0]["calls"] == len(calls)
        assert len(compiles) >= 2, "the planned executable was started in the background"
        release.set()
        assert session.wait_for_compiles(120)
        for call in calls:
            _check_cpu(cpu, session, call)
        entries = session.compiled_executables()
        planned = [entry for entry in entries if entry["background"]]
        assert planned, "the planned executables were swapped in"
        assert all(entry["shapes"]["input_ids"][1] < 128 for entry in planned)
        assert sum(entry["calls"] for entry in planned) == len(calls)  # the second pass: planned only
        plan = session.serving_plan()
        assert plan["groups"][0]["plan"] == sorted(
            [[entry["shapes"]["input_ids"][1]] for entry in planned], key=lambda sizes: sizes[0]
        )
    finally:
        release.set()
        session.close()


_SECOND_PROCESS = """
import json, sys
sys.path[:0] = {paths!r}
import numpy as np
from pathlib import Path
from emulator_sessions import emulator_session
from test_serving_plan_calls import calls
session = emulator_session(Path({onnx!r}), Path({cache!r}), serving_plan="cost", ipu_groups="4")
for call in calls():
    session.run(None, call)
print(json.dumps([
    {{"shape": list(e["shapes"]["input_ids"]), "source": e["source"], "calls": e["calls"]}}
    for e in session.compiled_executables()
]))
"""


def test_the_plan_in_the_cache_brings_a_second_process_to_the_steady_state_without_compiling(
    bert_tokens, tmp_path
):
    lengths = [20, 9, 31, 14, 18, 25, 12, 30, 17, 22, 11, 28, 70, 16]
    (tmp_path / "test_serving_plan_calls.py").write_text(
        "import numpy as np\n"
        f"LENGTHS = {lengths!r}\n"
        "def calls():\n"
        "    rng = np.random.default_rng(0)\n"
        "    return [{'input_ids': rng.integers(5, 100, (1, n)), 'attention_mask': np.ones((1, n), np.int64),"
        " 'token_type_ids': np.zeros((1, n), np.int64)} for n in LENGTHS]\n"
    )
    cache = tmp_path / "cache"
    session = emulator_session(bert_tokens, cache, serving_plan="cost", ipu_groups="4")
    try:
        for call in _calls(lengths):
            session.run(None, call)
        assert session.wait_for_compiles(300)
        plan = session.serving_plan()["groups"][0]["plan"]
    finally:
        session.close()
    stored = list((cache / "serving-plans").rglob("*.json"))
    assert len(stored) == 1 and json.loads(stored[0].read_text())["body"]["groups"][0]["plan"] == plan
    code = _SECOND_PROCESS.format(
        paths=[str(Path(__file__).resolve().parents[1]), str(tmp_path)],
        onnx=str(bert_tokens),
        cache=str(cache),
    )
    second = python_json(code, cwd=tmp_path)
    assert all(entry["source"] == "cache" for entry in second), second  # 0 compiles
    assert sorted([entry["shape"][1]] for entry in second) == sorted(plan)  # only the planned ones
    assert sum(entry["calls"] for entry in second) == len(lengths)


def test_a_corrupt_plan_is_ignored_and_planned_again(bert_tokens, tmp_path):
    cache = tmp_path / "cache"
    session = emulator_session(bert_tokens, cache, serving_plan="cost")
    try:
        for call in _calls([10, 40]):
            session.run(None, call)
    finally:
        session.close()
    (stored,) = (cache / "serving-plans").rglob("*.json")
    record = json.loads(stored.read_text())
    record["body"]["groups"][0]["plan"] = [[8]]  # a plan that holds none of the calls, hash unchanged
    stored.write_text(json.dumps(record))
    cpu = ort.InferenceSession(str(bert_tokens / "model.onnx"), providers=["CPUExecutionProvider"])
    again = emulator_session(bert_tokens, cache, serving_plan="cost")
    try:
        assert again.serving_plan()["groups"] == []  # the record failed its hash: never served
        for call in _calls([10, 40]):
            _check_cpu(cpu, again, call)
    finally:
        again.close()
