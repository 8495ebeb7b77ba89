"""`optimum-ipu check --verify-padding`: each graph run padded and at exact sizes on the emulator, with each
dimension's verdict; and graphs checked as the runtime serves them (top-k experts computed densely)."""

from __future__ import annotations

import json

import numpy as np

from optimum_ipu_backend.cli.check import main
from optimum_ipu_backend.session import IPUInferenceSession


def _document(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


def test_a_sequence_convolution_is_verified_with_its_verdicts(zoo, capsys):
    """ConvBERT: the batch is padded (proven), the sequence compiled exactly because of the layer-0
    span convolution's attention; padded and unpadded real outputs agree."""
    status = main([str(zoo.onnx("convbert", "token-classification")), "--verify-padding", "--json"])
    document = _document(capsys)
    assert status == 0 and document["ready"] is True
    (check,) = document["padding_checks"]
    assert check["ok"] and check["max_abs_diff"] <= check["atol"]
    assert check["call_dims"] == {"batch_size": 3, "sequence_length": 13}
    assert check["padding"]["batch_size"] == "padded (proven)"
    sequence = check["padding"]["sequence_length"]
    assert sequence.startswith("exact sizes:") and "/convbert/encoder/layer.0/" in sequence
    assert check["compiled_shapes"] == [
        {"input_ids": [4, 13], "attention_mask": [4, 13], "token_type_ids": [4, 13]}
    ]
    # dynamic_batching would not pack it: the verdict names the convolution that reads its neighbours
    assert check["packing"].startswith("not packed: node ") and "(Conv)" in check["packing"]


def test_a_padded_run_that_differs_fails_the_check(zoo, capsys, monkeypatch):
    """The check can fail: a padded run that is off by 1e-3 is reported and the status is 1."""
    original = IPUInferenceSession.run
    sessions: list[IPUInferenceSession] = []

    def perturbed(self, output_names, input_feed, run_options=None):
        outputs = original(self, output_names, input_feed, run_options)
        if not sessions or sessions[0] is self:  # the first session is the padded one
            sessions.append(self)
            return [o + np.float32(1e-3) if np.issubdtype(o.dtype, np.floating) else o for o in outputs]
        return outputs

    monkeypatch.setattr(IPUInferenceSession, "run", perturbed)
    status = main([str(zoo.onnx("bert", "text-classification")), "--verify-padding"])
    text = capsys.readouterr().out
    assert status == 1
    assert "padded vs unpadded real outputs: DIFFERENT (max abs diff 0.001" in text
    assert "padding verified on 0 of 1" in text
    assert "packing: packed rows (proven): logits" in text  # BERT's classification packs


def test_top_k_experts_are_checked_densely_with_their_cost(zoo, capsys):
    status = main([str(zoo.onnx("qwen3_moe", "text-generation-with-past")), "--json"])
    document = _document(capsys)
    assert status == 0, document
    (result,) = document["files"]
    (note,) = result["graph_notes"]
    assert "computed densely" in note and "2x the expert compute of top-2 routing" in note
