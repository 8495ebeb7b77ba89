"""GRU/LSTM/RNN-14+ with layout=1 (batch first): the opset-11 (sequence-first) op between Transposes."""

from __future__ import annotations

import onnx

from ...graphs import attribute
from .attribute_adapters import without_attributes
from .common import GraphScope, Rewrite, copy_attributes, input_at

#: Batch-first operands: X [batch, seq, input], initial_h and LSTM's initial_c [batch, dirs, hidden].
#: Swapping the two leading axes gives the sequence-first layout (the same swap turns Y_h, Y_c back).
_BATCH_FIRST_INPUTS = (0, 5, 6)
_SWAP_LEADING = [1, 0, 2]
#: Y from [seq, dirs, batch, hidden] to [batch, seq, dirs, hidden].
_Y_TO_BATCH_FIRST = [2, 0, 1, 3]


class RecurrentLayoutRewrite(Rewrite):
    """layout=1: X, initial_h, initial_c transposed to layout 0, the op without layout, and Y, Y_h, Y_c
    (those that exist) transposed back. layout=0 is dropped."""

    op_types = frozenset({"GRU", "LSTM", "RNN"})

    def lower(
        self, node: onnx.NodeProto, since_version: int, scope: GraphScope
    ) -> list[onnx.NodeProto] | None:
        layout = attribute(node, "layout")
        if since_version < 14 or layout is None:
            return None
        if not layout:
            return [without_attributes(node, {"layout"}, scope)]
        hint = node.name or node.op_type
        before: list[onnx.NodeProto] = []
        inputs = list(node.input)
        for index in _BATCH_FIRST_INPUTS:
            if input_at(node, index):
                swap = scope.make_node(
                    "Transpose", [inputs[index]], 1, f"{hint}/input{index}_sequence_first", perm=_SWAP_LEADING
                )
                before.append(swap)
                inputs[index] = swap.output[0]
        after: list[onnx.NodeProto] = []
        outputs = []
        for index, name in enumerate(node.output):
            if not name:
                outputs.append("")
                continue
            sequence_first = scope.names.fresh(f"{name}_sequence_first")
            outputs.append(sequence_first)
            perm = _Y_TO_BATCH_FIRST if index == 0 else _SWAP_LEADING
            after.append(
                scope.make_node(
                    "Transpose", [sequence_first], [name], f"{hint}/output{index}_batch_first", perm=perm
                )
            )
        recurrent = scope.make_node(
            node.op_type, inputs, outputs, hint, **copy_attributes(node, drop={"layout"})
        )
        return [*before, recurrent, *after]
