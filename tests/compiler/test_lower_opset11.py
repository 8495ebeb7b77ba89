"""LowerToOpset11 as a whole: subgraphs, the opset/IR it sets, the errors it raises, and real exports.

Real exports (tiny BERT, GPT-2 with past, T5 with its merged decoder, ViT from the test zoo) go through
FixShapes and FoldConstants first, as in the pipeline, and the lowered graph must give the outputs of the
original dynamic export on onnxruntime within atol 1e-5 (the issue's fp32 criterion; the LayerNorm
decomposition differs from the fused kernel by up to ~1e-6 on these models).
"""

from __future__ import annotations

import json
from pathlib import Path

import lowering_testing as lt
import numpy as np
import onnx
import pytest
from graph_testing import BOOL, FLOAT, FLOAT16, INT64, make_model, run_ort, tensor_info
from matrix_testing import merged_export
from onnx import helper, numpy_helper

from optimum_ipu_backend.compiler.errors import LegalizationError
from optimum_ipu_backend.compiler.passes.base import PassContext
from optimum_ipu_backend.compiler.passes.fix_shapes import FixShapes
from optimum_ipu_backend.compiler.passes.fold_constants import FoldConstants
from optimum_ipu_backend.compiler.passes.lower_opset11 import TARGET_IR_VERSION, LowerToOpset11
from optimum_ipu_backend.compiler.passes.rewrites import REWRITES

# --------------------------------------------------------------------------------------------------
# Small graphs
# --------------------------------------------------------------------------------------------------


def _branch(name, axes_name):
    """A branch reading the outer `x` and `axes`: Unsqueeze-13, LayerNormalization-17, Softmax-13."""
    nodes = [
        helper.make_node("Unsqueeze", ["x", axes_name], [f"{name}_u"], name=f"{name}_unsqueeze"),
        helper.make_node(
            "LayerNormalization", [f"{name}_u", "scale"], [f"{name}_n"], name=f"{name}_norm", axis=-1
        ),
        helper.make_node("Softmax", [f"{name}_n"], [f"{name}_out"], name=f"{name}_softmax", axis=1),
    ]
    return helper.make_graph(nodes, name, [], [tensor_info(f"{name}_out", FLOAT, (2, 1, 4))])


def _if_model():
    node = helper.make_node(
        "If",
        ["cond"],
        ["y"],
        name="the_If",
        then_branch=_branch("then", "axes_then"),
        else_branch=_branch("else", "axes_else"),
    )
    return make_model(
        [node],
        [tensor_info("cond", BOOL, ()), tensor_info("x", FLOAT, (2, 4))],
        [tensor_info("y", FLOAT, (2, 1, 4))],
        {
            "axes_then": np.array([1], np.int64),
            "axes_else": np.array([-2], np.int64),
            "scale": np.linspace(0.5, 1.5, 4).astype(np.float32),
        },
    )


def test_subgraphs_are_lowered_with_outer_constants():
    model = _if_model()
    lowered = lt.lower(model)
    lt.assert_lowered(lowered)
    assert not {"LayerNormalization"} & lt.op_types(lowered)
    branches = [a.g for a in lowered.graph.node[0].attribute]
    for branch in branches:
        assert not branch.initializer, "constants made inside a branch are Constant nodes"
        unsqueeze = next(n for n in branch.node if n.op_type == "Unsqueeze")
        assert len(unsqueeze.input) == 1 and helper.get_attribute_value(unsqueeze.attribute[0])
    x = np.random.default_rng(0).uniform(-3, 3, (2, 4)).astype(np.float32)
    for cond in (True, False):
        lt.assert_equivalent(model, lowered, {"cond": np.array(cond), "x": x}, atol=1e-6, rtol=1e-5)
    assert not {"axes_then", "axes_else"} & {i.name for i in lowered.graph.initializer}


def test_opset_and_ir_version_are_set_and_unused_domains_dropped():
    """ORTOptimizer declares domains no node uses (com.microsoft, ai.onnx.ml, ...); PopART refuses any
    import besides ai.onnx, so an unused one is dropped."""
    model = lt.one_node_model("Softmax", [("x", FLOAT, (2, 3))], [("y", FLOAT, (2, 3))], axis=-1)
    model.opset_import.append(helper.make_opsetid("ai.onnx.ml", 3))
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    lowered = lt.lower(model)
    assert {o.domain: o.version for o in lowered.opset_import} == {"": 11}
    assert lowered.ir_version == TARGET_IR_VERSION
    lt.assert_lowered(lowered)


def test_every_offending_node_is_reported_at_once():
    nodes = [
        helper.make_node("Unsqueeze", ["x", "axes"], ["u"], name="runtime_axes"),
        helper.make_node("NonZero", ["x"], ["nz"], name="data_dependent"),
        helper.make_node("Mystery", ["x"], ["g"], name="custom_op", domain="com.example"),
        helper.make_node("Add", ["small", "small"], ["s"], name="int8_add"),
    ]
    model = make_model(
        nodes,
        [tensor_info("x", FLOAT, (2, 3)), tensor_info("axes", INT64, (1,)), tensor_info("small", 3, (2,))],
        [tensor_info(n, t, None) for n, t in (("u", FLOAT), ("nz", INT64), ("g", FLOAT), ("s", 3))],
        extra_opsets={"com.example": 1},
        check=False,
    )
    with pytest.raises(LegalizationError) as raised:
        lt.lower(model)
    reported = {(n.name, n.op_type) for n in raised.value.nodes}
    assert reported == {
        ("runtime_axes", "Unsqueeze"),
        ("data_dependent", "NonZero"),
        ("custom_op", "Mystery"),
        ("int8_add", "Add"),
    }
    message = str(raised.value)
    assert "must be a constant" in message
    assert "not in PopART's opset-11 table" in message
    assert "tensor(int8), which Add-7 (opset 11) does not accept" in message


@pytest.mark.parametrize("ir_version", [3, 8])
def test_initializers_listed_as_inputs_are_constants_only_before_ir_4(ir_version):
    """Before IR 4 every initializer is also listed as an input; from IR 4 on that makes it overridable."""
    model = lt.one_node_model(
        "Unsqueeze", [("x", FLOAT, (2,))], [("y", FLOAT, (1, 2))], {"axes": np.array([0], np.int64)}
    )
    model.graph.input.append(tensor_info("axes", INT64, (1,)))
    model.ir_version = ir_version
    if ir_version < 4:
        lt.assert_lowered(lt.lower(model))
    else:
        lt.assert_refused(model, "axes input 'axes' must be a constant")


def test_a_version_whose_change_was_not_reviewed_is_refused():
    # TopK-24 is newer than the versions the pass knows to mean the same as TopK-11.
    model = lt.one_node_model(
        "TopK",
        [("x", FLOAT, (5,))],
        [("v", FLOAT, (2,)), ("i", INT64, (2,))],
        {"k": np.array([2], np.int64)},
        opset=24,
        check=False,
    )
    lt.assert_refused(model, r"TopK-24 differs from TopK-11")


def _opset_28_cases():
    """One node each of the opset-28 versions that only changed element types, with inputs for it."""
    x = np.arange(48, dtype=np.float32).reshape(1, 8, 2, 3) / 7 - 3
    one_hot_values = {"depth": np.array(4, np.int64), "values": np.array([-1, 2], np.float32)}
    return {
        "Cast": (("Cast", [("x", FLOAT, x.shape)], [("y", FLOAT16, x.shape)], {}, {"to": FLOAT16}), {"x": x}),
        "DepthToSpace": (
            (
                "DepthToSpace",
                [("x", FLOAT, x.shape)],
                [("y", FLOAT, None)],
                {},
                {"blocksize": 2, "mode": "CRD"},
            ),
            {"x": x},
        ),
        "OneHot": (
            ("OneHot", [("i", INT64, (3,))], [("y", FLOAT, None)], one_hot_values, {"axis": 0}),
            {"i": np.array([0, 3, -1], np.int64)},
        ),
        "ReduceLogSumExp": (
            (
                "ReduceLogSumExp",
                [("x", FLOAT, x.shape)],
                [("y", FLOAT, None)],
                {"axes": np.array([1, -1])},
                {},
            ),
            {"x": x},
        ),
        "ReduceLogSum": (
            ("ReduceLogSum", [("x", FLOAT, x.shape)], [("y", FLOAT, None)], {}, {"keepdims": 0}),
            {"x": np.abs(x) + 0.5},
        ),
    }


@pytest.mark.parametrize("op_type", sorted(_opset_28_cases()))
def test_opset_28_versions_that_only_changed_types_lower(op_type):
    (op, inputs, outputs, initializers, attributes), feeds = _opset_28_cases()[op_type]
    model = lt.one_node_model(op, inputs, outputs, initializers, opset=28, **attributes)
    assert onnx.defs.get_schema(op_type, 28, "").since_version == 28
    lt.lower_and_compare(model, feeds, atol=1e-5)


def test_older_opsets_are_converted_up():
    model = lt.one_node_model("Softmax", [("x", FLOAT, (2, 3))], [("y", FLOAT, (2, 3))], opset=9, axis=1)
    lowered = lt.lower(model)
    lt.assert_lowered(lowered)
    lt.assert_equivalent(model, lowered, {"x": np.arange(6, dtype=np.float32).reshape(2, 3)})


def test_rewrites_claim_distinct_ops_and_state_their_guarantee():
    claimed = [(rewrite.domain, op) for rewrite in REWRITES for op in rewrite.op_types]
    assert len(claimed) == len(set(claimed))
    for rewrite in REWRITES:
        doc = type(rewrite).__doc__ or ""
        assert doc.strip(), type(rewrite).__name__


def test_notes_count_rewritten_nodes():
    model = lt.one_node_model(
        "Unsqueeze", [("x", FLOAT, (2,))], [("y", FLOAT, (1, 2))], {"axes": np.array([0], np.int64)}
    )
    lowering = LowerToOpset11()
    lowering.run(model, PassContext(input_shapes={}))
    assert lowering.rewritten == {"Unsqueeze": 1}
    assert lowering.notes == ["rewrote 1 Unsqueeze"]


# --------------------------------------------------------------------------------------------------
# Real exports
# --------------------------------------------------------------------------------------------------

_DIMS = {
    "batch_size": 2,
    "sequence_length": 7,
    "past_sequence_length": 5,
    "encoder_sequence_length": 7,
    "decoder_sequence_length": 4,
    "past_decoder_sequence_length": 5,
    "num_channels": 3,
    "height": 32,
    "width": 32,
}


def _size(dim: onnx.TensorShapeProto.Dimension, with_past: bool) -> int:
    if dim.HasField("dim_value"):
        return dim.dim_value
    # Dims such as "past_sequence_length + sequence_length" are sums of the named ones.
    total = 0
    for name in dim.dim_param.split("+"):
        name = name.strip()
        total += 1 if (with_past and name == "decoder_sequence_length") else _DIMS[name]
    return total


def _feeds(model: onnx.ModelProto, vocab_size: int, with_past: bool, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for graph_input in model.graph.input:
        tensor_type = graph_input.type.tensor_type
        shape = [_size(d, with_past) for d in tensor_type.shape.dim]
        name = graph_input.name
        if tensor_type.elem_type == BOOL:
            feeds[name] = np.full(shape, with_past)
        elif "mask" in name:
            mask = np.ones(shape, np.int64)
            mask[-1, : shape[-1] // 2] = 0  # left padding on the last row
            feeds[name] = mask
        elif name == "position_ids":
            start = _DIMS["past_sequence_length"] if with_past else 0
            feeds[name] = np.broadcast_to(np.arange(start, start + shape[-1]), shape).astype(np.int64)
        elif name == "token_type_ids":
            feeds[name] = rng.integers(0, 2, shape).astype(np.int64)
        elif tensor_type.elem_type == INT64:
            feeds[name] = rng.integers(0, vocab_size, shape).astype(np.int64)
        else:
            feeds[name] = (0.5 * rng.standard_normal(shape)).astype(np.float32)
    return feeds


def _legalize(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> onnx.ModelProto:
    context = PassContext(input_shapes={name: value.shape for name, value in feeds.items()})
    model = FoldConstants().run(FixShapes().run(model, context), context)
    return LowerToOpset11().run(model, context)


def _export_cases(zoo):
    yield "bert", zoo.onnx("bert", "text-classification")
    yield "vit", zoo.onnx("vit", "image-classification")
    yield "gpt2", zoo.onnx("gpt2", "text-generation-with-past")
    task = "text2text-generation-with-past"
    # Post-processing adds the merged decoder (an If over the two decoders) to the separate files.
    yield "t5", merged_export(zoo, "t5", task)


def test_real_exports_lower_and_keep_their_outputs(zoo):
    seen_files = []
    for name, export_dir in _export_cases(zoo):
        vocab_size = json.loads((Path(export_dir) / "config.json").read_text()).get("vocab_size", 2)
        for path in sorted(Path(export_dir).glob("*.onnx")):
            with_past = "with_past" in path.name or "merged" in path.name or name == "gpt2"
            original = onnx.load(str(path))
            feeds = _feeds(original, vocab_size, with_past, seed=len(seen_files))
            lowered = _legalize(onnx.load(str(path)), feeds)
            lt.assert_lowered(lowered)
            # A merged decoder is checked on both of its branches (use_cache_branch true and false).
            flips = [{}] + [{n: ~v} for n, v in feeds.items() if v.dtype == np.bool_]
            for flip in flips:
                expected = run_ort(original, {**feeds, **flip})
                actual = run_ort(lowered, {**feeds, **flip})
                for output_name, want in expected.items():
                    label = f"{path.name}:{output_name}:{flip}"
                    np.testing.assert_allclose(actual[output_name], want, atol=1e-5, err_msg=label)
            seen_files.append(f"{name}/{path.name}")
    assert "t5/decoder_model_merged.onnx" in seen_files and len(seen_files) == 7, seen_files


def test_unfolded_export_fails_clearly_on_runtime_range(zoo):
    """Without folding, GPT-2's position Range reads a runtime Shape: the error names it and the fix."""
    path = Path(zoo.onnx("gpt2", "text-generation-with-past")) / "model.onnx"
    model = onnx.load(str(path))
    feeds = _feeds(model, 10, True, seed=0)
    fixed = FixShapes().run(model, PassContext(input_shapes={n: v.shape for n, v in feeds.items()}))
    with pytest.raises(LegalizationError, match=r"\(Range\): its inputs are not constants") as raised:
        LowerToOpset11().run(fixed, PassContext(input_shapes={}))
    assert any("fold constants" in hint for hint in raised.value.hints)


def test_int64_constants_read_from_initializers_survive_a_round_trip():
    """A rewrite's constants are ordinary initializers: saving and loading the model keeps them."""
    model = lt.one_node_model("Trilu", [("x", FLOAT, (3, 3))], [("y", FLOAT, (3, 3))], upper=1)
    lowered = onnx.load_from_string(lt.lower(model).SerializeToString())
    masks = [
        numpy_helper.to_array(i) for i in lowered.graph.initializer if i.data_type == onnx.TensorProto.BOOL
    ]
    assert len(masks) == 1 and masks[0].tolist() == np.triu(np.ones((3, 3), bool)).tolist()
