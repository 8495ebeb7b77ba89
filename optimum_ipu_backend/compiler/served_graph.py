"""The graph the runtime serves: the export after the rewrites every shape needs.

One function, ``served_graph``, used by every path that compiles an export: the session (through
``runtime.graph_source``), ``optimum-ipu compile`` and ``export`` (which open sessions), and ``optimum-ipu
check``. A merged decoder's branch inputs are bound after it (``bind_branches``), once per choice, as the
runtime compiles each choice; ``tests/integration/test_served_graph_identity.py`` holds check and the
session to the same bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import onnx

# The rewrites are imported when a graph is served: a warm session start reads GeneratedMask only.
if TYPE_CHECKING:
    from optimum_ipu_backend.compiler.graph_rewrites.eos_selection import SameTokenCount

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GeneratedMask:
    """An input a rewrite adds and the runtime makes for every call: ones over the real positions of
    ``dim``, zeros over the padding, which goes on ``side`` ("left": a decoder's past; "right": audio
    samples)."""

    input: str
    dim: str
    side: str


@dataclass
class ServedGraph:
    """The graph the runtime serves: the export after the rewrites every shape needs."""

    model: onnx.ModelProto
    notes: list[str]
    generated_masks: list[GeneratedMask] = field(default_factory=list)
    #: Nodes no rewrite can make static: [name, op_type, domain, reason].
    unsupported: list[list[str]] = field(default_factory=list)
    #: What each call's feed must hold for the rewritten graph to equal the export.
    token_counts: list[SameTokenCount] = field(default_factory=list)


def _mask_rewrites(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[GeneratedMask]]:
    """The rewrites that add a generated mask so a dimension can be padded: a decoder's past
    (``past_padding_mask``) and raw audio samples (``audio_frame_mask``). A rewrite that cannot vouch for
    its graph leaves it alone (the dimension is then compiled at the sizes it comes in); whether padding
    is used is the padding proof's decision either way."""
    from optimum_ipu_backend.compiler.graph_rewrites.audio_frame_mask import add_audio_frame_mask
    from optimum_ipu_backend.compiler.graph_rewrites.past_padding_mask import add_past_padding_mask

    masks: list[GeneratedMask] = []
    for what, rewrite_of in (("the decoder's past", add_past_padding_mask), ("audio", add_audio_frame_mask)):
        try:
            rewrite = rewrite_of(model)
        except ValueError as exc:
            _logger.info("%s is compiled per length: %s", what, exc)
            continue
        if rewrite is not None:
            model = rewrite.model
            dim = getattr(rewrite, "past_dim", None) or rewrite.samples_dim
            masks.append(GeneratedMask(rewrite.mask_input, dim, rewrite.padding_side))
    return model, masks


def served_graph(model: onnx.ModelProto) -> ServedGraph:
    """Data-dependent selections made static: end-of-sentence selections (``eos_selection``) and
    mixture-of-experts selections (``dense_experts``) computed densely, or reported; then the generated
    masks."""
    from optimum_ipu_backend.compiler.graph_rewrites.dense_experts import (
        data_dependent_selections,
        densify_experts,
    )
    from optimum_ipu_backend.compiler.graph_rewrites.eos_selection import select_last_eos

    notes: list[str] = []
    unsupported: list[list[str]] = []
    token_counts: list[SameTokenCount] = []
    try:
        eos = select_last_eos(model)
        if eos is not None:
            model = eos.model
            notes.append(eos.note)
            token_counts = eos.preconditions
        dense = densify_experts(model)
    except ValueError as exc:
        dense = None
        unsupported = [[s.node, s.op_type, "", str(exc)] for s in data_dependent_selections(model)]
    if dense is not None:
        model = dense.model
        notes.append(dense.cost)
    model, masks = _mask_rewrites(model)
    return ServedGraph(model, notes, masks, unsupported, token_counts)


def bind_branches(served: onnx.ModelProto, branches: Mapping[str, bool]) -> onnx.ModelProto:
    """The served graph of one choice of a merged decoder's branch inputs (``use_cache_branch``): bound
    after the rewrites, which see both branches, as the runtime compiles each choice."""
    from optimum_ipu_backend.compiler.passes.fold_constants import bind_constant_inputs

    return bind_constant_inputs(served, dict(branches)) if branches else served
