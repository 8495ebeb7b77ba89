"""A DeepSeek-V3 mixture-of-experts layer, whose router limits each token to the best expert groups,
served through the ipu provider.

The router (scores -> sum of each group's top 2 -> top-k groups -> other groups masked -> top-k experts)
is TopK, ScatterElements and Where, which PopART runs as they are. The layer then selects each expert's
tokens with a NonZero over its one-hot routing mask laid out ``[tokens, top_k]`` (Mixtral's is
``[top_k, tokens]``), which the runtime computes densely (``compiler/graph_rewrites/dense_experts.py``).
The layer is transformers' own (``DeepseekV3MoE``), exported with the TorchScript exporter; the experts
chosen and the layer's output are compared with onnxruntime CPU on the export, on inputs built with ties:
groups whose scores are equal, experts whose scores are equal, and tokens for which every score is.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from emulator_sessions import cpu_outputs, emulator_session

HIDDEN = 32
EXPERTS = 8  # 4 groups of 2
GROUPS = 4


class GroupLimitedMoE(torch.nn.Module):
    """transformers' DeepseekV3MoE, returning the experts its router chose besides its output."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

        config = DeepseekV3Config(
            hidden_size=HIDDEN,
            moe_intermediate_size=16,
            n_routed_experts=EXPERTS,
            num_experts_per_tok=2,
            n_group=GROUPS,
            topk_group=2,
            n_shared_experts=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        )
        self.layer = DeepseekV3MoE(config)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        indices, weights = self.layer.gate(x)
        flat = x.view(-1, HIDDEN)
        routed = self.layer.moe(flat, indices, weights).view(x.shape)
        return routed + self.layer.shared_experts(x), indices


def _tied_router(module: GroupLimitedMoE) -> None:
    """Router weights with ties: expert 1 scores as expert 0 (a tie inside a group), and group 2 (experts
    4, 5) as group 1 (experts 2, 3), so two groups tie."""
    gate = module.layer.gate
    with torch.no_grad():
        gate.weight.normal_(0.0, 0.5)
        gate.e_score_correction_bias.zero_()
        gate.weight[1] = gate.weight[0]
        gate.weight[4:6] = gate.weight[2:4]


@pytest.fixture(scope="module")
def moe_export(tmp_path_factory):
    torch.manual_seed(0)
    module = GroupLimitedMoE().eval()
    _tied_router(module)
    directory = tmp_path_factory.mktemp("group_limited") / "export"
    directory.mkdir()
    # a trace skips an expert that gets no token of the example (`if token_indices.numel() > 0`): the
    # example is large enough for every expert to get some
    example = torch.randn(2, 64, HIDDEN)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter is deprecated
        torch.onnx.export(
            module,
            (example,),
            str(directory / "model.onnx"),
            input_names=["x"],
            output_names=["hidden_states", "experts"],
            dynamic_axes={"x": {0: "batch_size", 1: "sequence_length"}},
            dynamo=False,
            opset_version=14,
        )
    graph = onnx.load(directory / "model.onnx").graph
    assert sum(node.op_type == "NonZero" for node in graph.node) == EXPERTS, "every expert is in the export"
    assert sum(node.op_type == "TopK" for node in graph.node) == 3, "the group-limited router is exported"
    return directory


def _tied_tokens(rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """Random tokens, every 7th one zero: all its scores are sigmoid(0), a tie across every expert."""
    x = rng.standard_normal((batch, length, HIDDEN), dtype=np.float32)
    x[:, ::7] = 0.0
    return x


def test_group_limited_routing_chooses_the_cpu_experts_and_matches_its_output(moe_export, tmp_path):
    session = emulator_session(moe_export, tmp_path / "cache")
    assert any("computed densely" in note for note in session.graph_notes())
    rng = np.random.default_rng(0)
    for batch, length in ((3, 512), (2, 300)):
        feed = {"x": _tied_tokens(rng, batch, length)}
        hidden, experts = session.run(None, feed)
        expected_hidden, expected_experts = cpu_outputs(moe_export, feed)
        # the ties are there: zero tokens route to the first experts of the first groups, as ONNX's TopK
        # (lower index first on equal values) chooses
        assert sorted(expected_experts[0]) == [0, 1]
        np.testing.assert_array_equal(experts, expected_experts)
        np.testing.assert_allclose(hidden, expected_hidden, rtol=0, atol=1e-6)
