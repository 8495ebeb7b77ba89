"""A padding proof's JSON form gives back the same proof, and the proofs store serves a stored proof only
in the proof's own format (another format is proven again)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from optimum_ipu_backend.compiler.padding import PROOF_FORMAT, PaddingAnalyzer, PaddingProof
from optimum_ipu_backend.runtime.cache_files import read_record, write_record
from optimum_ipu_backend.runtime.padding import PaddingDecisions, padded_inputs

SHAPES = {"x": ("batch_size", "sequence_length"), "attention_mask": ("batch_size", "sequence_length")}
ACTUAL = {"batch_size": 2, "sequence_length": 3}
WANTED = {"sequence_length": 5}


def masked_softmax() -> onnx.ModelProto:
    """softmax(x + (1 - mask) * -10000) over the sequence: a proof with an obligation on the mask."""
    nodes = [
        helper.make_node("Cast", ["attention_mask"], ["mask"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["one", "mask"], ["hidden"]),
        helper.make_node("Mul", ["hidden", "minus"], ["bias"]),
        helper.make_node("Add", ["x", "bias"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["y"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "masked_softmax",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, list(SHAPES["x"])),
            helper.make_tensor_value_info(
                "attention_mask", TensorProto.INT64, list(SHAPES["attention_mask"])
            ),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch_size", "sequence_length"])],
        [
            helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
            helper.make_tensor("minus", TensorProto.FLOAT, [], [-1e4]),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


def _feed(mask: list[list[int]]) -> dict[str, np.ndarray]:
    return {"x": np.zeros((2, 3), np.float32), "attention_mask": np.array(mask, np.int64)}


def test_a_proof_read_back_from_its_json_is_the_same_proof() -> None:
    proof = PaddingAnalyzer(masked_softmax()).prove(padded_inputs(SHAPES, {}, ACTUAL, WANTED))
    assert proof.exact and proof.obligations, "the graph should need a per-call check of its mask"
    back = PaddingProof.from_json(json.loads(json.dumps(proof.to_json())))
    assert (back.exact, back.problems, back.binary_inputs) == (
        proof.exact,
        proof.problems,
        proof.binary_inputs,
    )
    assert back.output_maps.keys() == proof.output_maps.keys()
    for name, maps in proof.output_maps.items():
        for stored, made in zip(back.output_maps[name], maps, strict=True):
            assert (stored is None) == (made is None)
            if made is not None:
                np.testing.assert_array_equal(stored, made)
                assert stored.dtype == np.int64
    for stored, made in zip(back.obligations, proof.obligations, strict=True):
        assert stored.input == made.input
        np.testing.assert_array_equal(stored.unmasked_if_one, made.unmasked_if_one)
        np.testing.assert_array_equal(stored.unmasked_if_zero, made.unmasked_if_zero)
    for mask in ([[1, 1, 0], [1, 0, 0]], [[1, 1, 1], [0, 0, 0]]):
        assert back.holds_for(_feed(mask)) == proof.holds_for(_feed(mask))


def test_the_store_serves_a_proof_only_in_the_proofs_own_format(tmp_path: Path) -> None:
    loads = []

    def decide() -> PaddingDecisions:
        def load_model() -> onnx.ModelProto:
            loads.append(1)  # the model is loaded only to prove
            return masked_softmax()

        decisions = PaddingDecisions(load_model, SHAPES, {}, store=tmp_path)
        decisions.decide(ACTUAL, WANTED, _feed([[1, 1, 0], [1, 0, 0]]), {})
        return decisions

    decide()
    stored = sorted(tmp_path.glob("*.json"))
    assert stored and len(loads) == 1
    decide()
    assert len(loads) == 1, "a stored proof of the proof's format is served"
    for path in stored:
        write_record(
            path, PROOF_FORMAT - 1, read_record(path, PROOF_FORMAT, "padding proof"), "padding proof"
        )
    decide()
    assert len(loads) == 2, "a stored proof of another format is proven again"
