"""The padding property over the whole model matrix: a call padded where the padding proof allows it
returns exactly what the unpadded call returns.

Every graph of every zoo model is fed what its ORTModel class really feeds it (forward calls and
``generate()`` steps on CPUExecutionProvider, with random batch sizes and lengths from a fixed seed). Each
recorded call then goes through the runtime's own decisions (``PaddingDecisions``: bucket sizes, the
proof, the per-call conditions), is padded with ``pad_feed``, runs on onnxruntime, and is cut where the
proof located the real elements; the result must equal the recorded unpadded outputs. Dimensions whose
proof fails are run at their own size, as the runtime does, and must still match.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from optimum_ipu_backend.compiler.external_data import save_graph
from optimum_ipu_backend.conformance.zoo import PATTERN_TASKS, TASKS, preprocessed_inputs
from optimum_ipu_backend.runtime.buckets import BucketPlan
from optimum_ipu_backend.runtime.graph_source import GraphSource
from optimum_ipu_backend.runtime.open import dynamic_dims
from optimum_ipu_backend.runtime.padding import (
    PaddingDecisions,
    cut_output,
    infer_dims,
    output_cuts,
    pad_feed,
)
from optimum_ipu_backend.runtime.roles import fill_value, generation_step_dims, is_batch_dim

SEED = 20261130
CALLS_PER_MODEL = 2
ATOL = 1e-5


def _record_calls(cls_name: str, model: str, task: str, zoo, rng: np.random.Generator) -> dict[Path, list]:
    """The feeds each ONNX file of ``model`` receives from its ORTModel class on CPU."""
    import optimum.onnxruntime as ort_models

    onnx_dir = zoo.onnx(model, task)
    model_dir = zoo.model(model, task)
    ort_model = getattr(ort_models, cls_name).from_pretrained(onnx_dir, provider="CPUExecutionProvider")
    recorded: dict[Path, list] = defaultdict(list)
    for part in ("model", "encoder", "decoder", "decoder_with_past"):
        component = getattr(ort_model, part, None)
        session = getattr(component, "session", component)
        if session is None or not hasattr(session, "run") or not hasattr(session, "_model_path"):
            continue
        original = session.run

        def spy(output_names, feed, *args, _path=Path(session._model_path), _run=original, **kwargs):
            recorded[_path].append({name: np.array(value) for name, value in feed.items()})
            return _run(output_names, feed, *args, **kwargs)

        session.run = spy
    generating = task.startswith(("text-generation", "text2text", "automatic-speech"))
    for call in range(CALLS_PER_MODEL):
        # The first call's 3 samples are never a compiled batch size, so every model sees padding tried.
        batch, seq = 3 if call == 0 else int(rng.integers(1, 4)), int(rng.integers(8, 16))
        inputs = {
            key: torch.from_numpy(value) for key, value in preprocessed_inputs(model_dir, batch, seq).items()
        }
        with torch.no_grad():
            if generating:
                inputs.pop("decoder_input_ids", None)
                inputs.pop("position_ids", None)
                inputs.pop("token_type_ids", None)
                new_tokens = int(rng.integers(2, 6))
                ort_model.generate(
                    **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
                )
            else:
                ort_model(**inputs)
    return recorded


def _cases():
    cases = []
    for tasks in (TASKS, PATTERN_TASKS):
        for cls_name, zoo_cases in tasks.items():
            for case in zoo_cases:
                cases.append(pytest.param(cls_name, case.model, case.task, id=f"{case.model}-{case.task}"))
    return cases


@pytest.mark.parametrize(("cls_name", "model", "task"), _cases())
def test_padded_calls_return_the_unpadded_outputs(tmp_path_factory, zoo, cls_name, model, task):
    rng = np.random.default_rng(SEED + sum(map(ord, model + task)))
    recorded = _record_calls(cls_name, model, task, zoo, rng)
    assert recorded, "no ONNX file was called"
    config = json.loads((zoo.onnx(model, task) / "config.json").read_text())
    padded_calls = 0
    verdicts: dict[str, str] = {}
    for path, feeds in recorded.items():
        source = GraphSource(path)
        description = source.description
        shapes = {name: tuple(dims) for name, dims in description.served_inputs.items()}
        plan = BucketPlan.for_dims(config, dynamic_dims(shapes), step_dims=generation_step_dims(shapes))
        fills = {name: fill_value(name, config.get("pad_token_id")) for name in shapes}
        generated = tuple((mask.input, mask.dim) for mask in description.masks())
        left_padded = tuple(mask.dim for mask in description.masks() if mask.side == "left")
        decisions = PaddingDecisions(
            source.served_model,
            shapes,
            fills,
            left_padded_dims=left_padded,
            generated_masks=generated,
        )
        original = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        # The served graph keeps large weights as references into the export's files
        # (compiler.external_data): a copy written out (save_graph rewrites what it saves) finds them.
        served_copy = onnx.ModelProto()
        served_copy.CopyFrom(source.served_model())
        served_path = save_graph(served_copy, tmp_path_factory.mktemp("served") / "served.onnx", path.parent)
        served = ort.InferenceSession(str(served_path), providers=["CPUExecutionProvider"])
        for feed in feeds:
            expected = dict(
                zip([o.name for o in original.get_outputs()], original.run(None, feed), strict=True)
            )
            branches = {name: bool(feed[name].reshape(-1)[0]) for name in description.branch_inputs}
            call_feed = {name: value for name, value in feed.items() if name not in branches}
            actual = infer_dims(call_feed, shapes)
            batch = next((size for d, size in actual.items() if is_batch_dim(d)), 1)
            for mask, dim in generated:
                call_feed[mask] = np.ones((batch, actual[dim]), np.int64)
            wanted = {dim: plan.choose(dim, size) for dim, size in actual.items() if dim in plan.sizes}
            call = decisions.decide(actual, wanted, call_feed, branches)
            padded = pad_feed(
                call_feed,
                shapes,
                call.dims,
                actual_dims=actual,
                fill_values=fills,
                left_padded_dims=left_padded,
            )
            run_feed = {**padded.feed, **{name: feed[name] for name in branches}}
            got = dict(zip([o.name for o in served.get_outputs()], served.run(None, run_feed), strict=True))
            cuts = output_cuts(call.output_maps)
            padded_calls += any(call.dims[d] != actual[d] for d in actual)
            for name, value in expected.items():
                if value.size == 0:
                    continue  # a merged decoder's unused placeholder
                real = cut_output(got[name], cuts.get(name, ()))
                assert real.shape == value.shape, (path.name, name, call.dims, actual)
                np.testing.assert_allclose(
                    real, value, atol=ATOL, rtol=1e-5, err_msg=f"{path.name} {name} {actual}->{call.dims}"
                )
        verdicts.update(decisions.verdicts())
    # Not vacuous: calls were padded, or padding was tried and refused with a reason.
    assert padded_calls > 0 or any(v.startswith("exact") for v in verdicts.values()), verdicts
