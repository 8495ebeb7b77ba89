"""ReverseSequence (absent from PopART's opset 11) with constant lengths: one Gather at constant positions."""

from __future__ import annotations

import numpy as np
import onnx

from ...graphs import attribute
from .common import CannotLower, GraphScope, Rewrite
from .emit import NodeEmitter


class ReverseSequenceRewrite(Rewrite):
    """Time and batch axes merged into one, gathered at the reversed positions, and split again."""

    op_types = frozenset({"ReverseSequence"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        x, lengths_name = node.input[:2]
        dims = scope.require_static_shape(x, "ReverseSequence merges its time and batch axes")
        lengths = scope.require_constant(
            lengths_name, f"its sequence_lens input '{lengths_name}' must be a constant (positions are fixed)"
        ).reshape(-1)
        time_axis = int(attribute(node, "time_axis", 0))
        batch_axis = int(attribute(node, "batch_axis", 1))
        if {time_axis, batch_axis} != {0, 1}:
            raise CannotLower(f"time_axis={time_axis} and batch_axis={batch_axis} are not 0 and 1")
        steps, batch = dims[time_axis], dims[batch_axis]
        if lengths.shape != (batch,) or np.any(lengths < 0) or np.any(lengths > steps):
            # onnxruntime raises on such lengths; a gather would invent an answer.
            raise CannotLower(f"sequence_lens {lengths.tolist()} are not {batch} lengths in [0, {steps}]")
        t = np.arange(steps)[:, None]
        source_step = np.where(t < lengths[None, :], lengths[None, :] - 1 - t, t)  # [time, batch]
        b = np.arange(batch)[None, :]
        # Where output (step, b) reads from, as a row-major position once the two leading axes are merged.
        if time_axis == 0:
            positions = (source_step * batch + b).reshape(-1)
        else:
            positions = (b * steps + source_step).T.reshape(-1)
        emit = NodeEmitter(node, scope)
        merged = emit("Reshape", [x, emit.shape([steps * batch, *dims[2:]], "merged_shape")], "merged")
        gathered = emit("Gather", [merged, emit.constant(positions, np.int64, "positions")], "gather", axis=0)
        emit("Reshape", [gathered, emit.shape(dims, "shape")], "restored", node.output[0])
        return emit.nodes
