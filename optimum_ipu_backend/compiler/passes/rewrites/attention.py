"""onnxruntime's fused attention (com.microsoft Attention and MultiHeadAttention) as opset-11 operators.

Both follow onnxruntime's CPU kernel (contrib_ops/cpu/bert/attention_cpu_base.h, attention_helper.h),
the reference the lowered graph must equal:

    scores = (scale · Q·Kᵀ + attention_bias) + mask        [batch, heads, sequence, total_sequence]
    output = Softmax(scores) · V, heads joined              [batch, sequence, heads · v_head]

The mask holds 0 for a kept key and ``mask_filter_value`` (default -10000) for a masked one. It is
added, not -inf: a row whose keys are all masked keeps its scores, shifted, and with the -FLT_MAX that
onnxruntime's optimizer writes every score of such a row rounds to -FLT_MAX, so its softmax is uniform;
adding the same float32 values reproduces both. Unidirectional (causal) attention, only when the query
has more than one position, overwrites the keys after ``past + s`` with the lowest float. The scores are
laid out with the key axis last, so Softmax-11's coercion to 2-D around the last axis is row-wise, exact.

A float16 node (an O4-optimized model's) is computed in float32 between Casts, as onnxruntime's session
runs it (``in_float32``). Refused, each with its reason: element types other than float32 and float16,
do_rotary, past_present_share_buffer and past_sequence_length, the 4-D Megatron mask and the
(3·batch + 2) index (the CPU kernel implements neither), MultiHeadAttention's packed QKV and KV forms
(nor these), its query without key, its cache_indirection input and qk output. Static shapes are needed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx

from ...graphs import attribute
from .common import CannotLower, GraphScope, Rewrite, input_at
from .emit import NodeEmitter

_FLOAT = onnx.TensorProto.FLOAT
_INT32 = onnx.TensorProto.INT32
_TO_HEADS = [0, 2, 1, 3]  # [batch, sequence, heads, head] <-> [batch, heads, sequence, head]
_KEYS_TRANSPOSED = [0, 1, 3, 2]
#: onnxruntime's default mask_filter_value.
_DEFAULT_MASK_FILTER = -10000.0
#: What the kernel writes at a key after the query's position: std::numeric_limits<float>::lowest().
_CAUSAL_FILL = np.finfo(np.float32).min
_MS_DOMAIN = "com.microsoft"
#: onnxruntime's CPU kernel joins the past to the keys only while writing the present: without it, it
#: reads the total sequence from the current keys alone, past their end (values with no definition).
_PAST_WITHOUT_PRESENT = (
    "past state without the present output(s) is not lowered: onnxruntime's CPU kernel then reads keys "
    "beyond the current ones, so its result has no definition to match"
)


@dataclass(frozen=True)
class _Sizes:
    batch: int
    sequence: int  # S, the query's
    past: int  # P
    kv_sequence: int  # L, this step's keys
    heads: int

    @property
    def total(self) -> int:  # T = P + L
        return self.past + self.kv_sequence


def in_float32(
    node: onnx.NodeProto,
    scope: GraphScope,
    lower: Callable[[onnx.NodeProto, GraphScope], list[onnx.NodeProto]],
) -> list[onnx.NodeProto]:
    """``lower`` applied to ``node`` with its float16 inputs and outputs in float32.

    onnxruntime's CPU attention kernels are float32 only; its session runs a float16 node (an O4-optimized
    model's) between Casts to float32 and back, so the lowering computes exactly that."""
    half = [
        name
        for name in (*node.input, *node.output)
        if name and scope.elem_type(name) == onnx.TensorProto.FLOAT16
    ]
    if not half:
        return lower(node, scope)
    emit = NodeEmitter(node, scope)
    wide = onnx.NodeProto()
    wide.CopyFrom(node)
    back: list[tuple[str, str]] = []
    for slot, name in enumerate(node.input):
        if name in half:
            wide.input[slot] = emit("Cast", [name], f"input{slot}_to_float32", to=_FLOAT)
            scope.learn_type(wide.input[slot], _float32_like(scope, name))
    for slot, name in enumerate(node.output):
        if name in half:
            wide.output[slot] = scope.names.fresh(f"{emit.hint}/output{slot}_float32")
            scope.learn_type(wide.output[slot], _float32_like(scope, name))
            back.append((wide.output[slot], name))
    nodes = emit.nodes + lower(wide, scope)
    narrow = NodeEmitter(node, scope)
    for wide_name, name in back:
        narrow("Cast", [wide_name], f"{name}_to_float16", name, to=onnx.TensorProto.FLOAT16)
    return nodes + narrow.nodes


def _float32_like(scope: GraphScope, name: str) -> onnx.TypeProto:
    found = onnx.TypeProto()
    known = scope.type_of(name)
    if known is not None:
        found.CopyFrom(known)
    found.tensor_type.elem_type = _FLOAT
    return found


def _require_float(scope: GraphScope, node: onnx.NodeProto, *names: str) -> None:
    for name in names:
        if name and scope.require_elem_type(name) != _FLOAT:
            found = onnx.TensorProto.DataType.Name(scope.require_elem_type(name))
            raise CannotLower(
                f"input '{name}' is {found}; only float32 is lowered (onnxruntime's CPU {node.op_type} "
                "kernel, the reference, is float32 only)"
            )


def _scale(node: onnx.NodeProto, head_size: int) -> np.float32:
    """The kernel's scale: the attribute, or 1.0f / sqrtf(head_size) when it is absent or 0."""
    scale = float(attribute(node, "scale", 0.0))
    return np.float32(scale) if scale != 0.0 else np.float32(1.0) / np.sqrt(np.float32(head_size))


def _to_heads(emit: NodeEmitter, x: str, sizes: tuple[int, int, int, int], what: str) -> str:
    """[batch, sequence, heads · head] as [batch, heads, sequence, head]."""
    split = emit("Reshape", [x, emit.shape(sizes, f"{what}_heads_shape")], f"{what}_split_heads")
    return emit("Transpose", [split], f"{what}_heads", perm=_TO_HEADS)


def _split(emit: NodeEmitter, x: str, axis: int, split: list[int], what: str) -> list[str]:
    """Split-11 (sizes as an attribute) of ``x``: one fresh output per part."""
    node = emit.scope.make_node("Split", [x], len(split), f"{emit.hint}/{what}", axis=axis, split=split)
    emit.nodes.append(node)
    return list(node.output)


def _mask(
    emit: NodeEmitter,
    scope: GraphScope,
    node: onnx.NodeProto,
    mask: str,
    sizes: _Sizes,
    index_lengths: dict[int, str],
) -> str | None:
    """The kernel's mask as float32 broadcastable to [batch, 1, sequence, total]: 0 or mask_filter_value
    per key, and the lowest float after each query position when causal; None when there is neither.

    ``index_lengths`` maps the 1-D index lengths the operator accepts to their names (for messages).
    """
    batch, sequence, total = sizes.batch, sizes.sequence, sizes.total
    fill = np.float32(attribute(node, "mask_filter_value", _DEFAULT_MASK_FILTER))
    padding = None
    if mask:
        if scope.require_elem_type(mask) != _INT32:
            raise CannotLower(f"mask '{mask}' is not int32, the only mask type the operator defines")
        dims = tuple(scope.require_static_shape(mask, "decides the mask's form"))
        if len(dims) == 1 and dims[0] in index_lengths:
            # Keys at or after end[b] are masked; with a [2·batch] index also those before start[b].
            key_position = emit.constant(np.arange(total).reshape(1, 1, 1, total), np.int32, "key_position")
            rows = dims[0] // batch
            index = emit("Reshape", [mask, emit.shape([rows, batch, 1, 1, 1], "index_shape")], "index_rows")
            parts = _split(emit, index, 0, [1] * rows, "index_parts") if rows > 1 else [index]
            end = emit("Squeeze", [parts[0]], "end", axes=[0])
            keep = emit("Less", [key_position, end], "before_end")
            if rows == 2:
                start = emit("Squeeze", [parts[1]], "start", axes=[0])
                not_before = emit("Not", [emit("Less", [key_position, start], "before_start")], "from_start")
                keep = emit("And", [keep, not_before], "in_window")
        elif dims == (batch, total) or dims == (batch, sequence, total):
            raw = emit("Reshape", [mask, emit.shape([batch, 1, -1, total], "raw_shape")], "raw_mask")
            keep = emit("Greater", [raw, emit.constant(0, np.int32, "zero")], "kept")
        else:
            accepted = ", ".join(f"[{n}] ({what})" for n, what in index_lengths.items())
            raise CannotLower(
                f"mask '{mask}' of shape {list(dims)} is none of the forms lowered: {accepted}, "
                f"[{batch}, {total}] or [{batch}, {sequence}, {total}] (raw 0/1 masks over the total "
                "sequence); onnxruntime's CPU kernel implements neither the 4-D Megatron mask nor the "
                "(3·batch + 2) index"
            )
        kept_value = emit.constant(0.0, np.float32, "kept_value")
        padding = emit("Where", [keep, kept_value, emit.constant(fill, np.float32, "mask_filter")], "padding")
    if int(attribute(node, "unidirectional", 0)) and sequence > 1:
        # The kernel applies its causal mask only to a query of several positions.
        after = np.arange(total)[None, :] > sizes.past + np.arange(sequence)[:, None]
        future = emit.constant(after.reshape(1, 1, sequence, total), np.bool_, "future_keys")
        below = padding if padding is not None else emit.constant(0.0, np.float32, "no_padding")
        return emit("Where", [future, emit.constant(_CAUSAL_FILL, np.float32, "causal_fill"), below], "mask")
    return padding


def _checked_bias(scope: GraphScope, node: onnx.NodeProto, bias: str, sizes: _Sizes) -> str:
    """attention_bias, once its shape is known to be (batch or 1, heads or 1, sequence, total)."""
    if not bias:
        return bias
    _require_float(scope, node, bias)
    dims = tuple(scope.require_static_shape(bias, "must be (batch or 1, heads or 1, sequence, total)"))
    if (
        len(dims) != 4
        or dims[0] not in (1, sizes.batch)
        or dims[1] not in (1, sizes.heads)
        or dims[2:] != (sizes.sequence, sizes.total)
    ):
        raise CannotLower(
            f"attention_bias '{bias}' of shape {list(dims)} is not ({sizes.batch} or 1, {sizes.heads} or 1, "
            f"{sizes.sequence}, {sizes.total})"
        )
    return bias


def _attend(
    emit: NodeEmitter,
    node: onnx.NodeProto,
    qkv: tuple[str, str, str],
    bias: str,
    mask: str | None,
    scale: np.float32,
    output_shape: list[int],
) -> None:
    """Softmax((scale · Q·Kᵀ + bias) + mask) · V into the node's first output, [batch, sequence, hidden_v].

    The order of the additions is onnxruntime's (measured: it matters where a row's keys are all masked
    with -10000, whose float32 sums round to a grid of 2^-10).
    """
    q, k, v = qkv
    scores = emit("MatMul", [q, emit("Transpose", [k], "keys_t", perm=_KEYS_TRANSPOSED)], "qk")
    scores = emit("Mul", [scores, emit.constant(scale, np.float32, "scale")], "scaled_qk")
    if bias:
        scores = emit("Add", [scores, bias], "biased_qk")
    if mask is not None:
        scores = emit("Add", [scores, mask], "masked_qk")
    probs = emit("Softmax", [scores], "probs", axis=-1)
    context = emit("Transpose", [emit("MatMul", [probs, v], "context")], "context_bsnh", perm=_TO_HEADS)
    emit("Reshape", [context, emit.shape(output_shape, "output_shape")], "output", node.output[0])


def _output(node: onnx.NodeProto, index: int) -> str:
    return node.output[index] if index < len(node.output) else ""


class AttentionRewrite(Rewrite):
    """com.microsoft Attention: the packed Q/K/V projection, past state, mask and attention bias."""

    op_types = frozenset({"Attention"})
    domain = _MS_DOMAIN

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        return in_float32(node, scope, self._lower_float32)

    def _lower_float32(self, node: onnx.NodeProto, scope: GraphScope) -> list[onnx.NodeProto]:
        x, weights = node.input[0], node.input[1]
        bias, mask, past = input_at(node, 2), input_at(node, 3), input_at(node, 4)
        attention_bias, past_length = input_at(node, 5), input_at(node, 6)
        if int(attribute(node, "do_rotary", 0)):
            raise CannotLower("do_rotary=1 (rotary embedding inside Attention) is not lowered")
        if int(attribute(node, "past_present_share_buffer", 0)):
            raise CannotLower("past_present_share_buffer=1 (a preallocated KV cache) is not lowered")
        if past_length:
            raise CannotLower(
                "input past_sequence_length (meant for past_present_share_buffer) is not lowered"
            )
        if past and attention_bias:
            raise CannotLower("past with attention_bias is not a valid Attention (onnxruntime rejects it)")
        _require_float(scope, node, x, weights, bias, past)
        heads = int(attribute(node, "num_heads", 0))
        x_dims = scope.require_static_shape(x, "is split into heads")
        w_dims = scope.require_static_shape(weights, "gives the Q, K and V widths")
        if len(x_dims) != 3 or len(w_dims) != 2 or w_dims[0] != x_dims[2]:
            raise CannotLower(
                f"input {list(x_dims)} and weights {list(w_dims)} are not (B, S, D) and (D, widths)"
            )
        widths = [int(w) for w in attribute(node, "qkv_hidden_sizes", [])] or [w_dims[1] // 3] * 3
        if (
            heads <= 0
            or len(widths) != 3
            or sum(widths) != w_dims[1]
            or widths[0] != widths[1]
            or any(w % heads for w in widths)
        ):
            raise CannotLower(
                f"qkv_hidden_sizes {widths} with num_heads={heads} do not split weights of width {w_dims[1]} "
                "into Q and K of one width and V, each a multiple of num_heads"
            )
        batch, sequence = x_dims[0], x_dims[1]
        head, v_head = widths[0] // heads, widths[2] // heads
        present = _output(node, 1)
        past_sequence = 0
        if past:
            past_dims = scope.require_static_shape(past, "gives the past sequence length")
            if len(past_dims) != 5 or tuple(past_dims[:3]) != (2, batch, heads) or past_dims[4] != head:
                raise CannotLower(
                    f"past {list(past_dims)} is not (2, {batch}, {heads}, past_sequence, {head})"
                )
            past_sequence = past_dims[3]
        if past and not present:
            raise CannotLower(_PAST_WITHOUT_PRESENT)
        if (past or present) and head != v_head:
            raise CannotLower("past and present state need equal Q, K and V widths (qkv_hidden_sizes)")
        sizes = _Sizes(batch, sequence, past_sequence, sequence, heads)
        emit = NodeEmitter(node, scope)
        projected = emit("MatMul", [x, weights], "qkv")
        if bias:
            projected = emit("Add", [projected, bias], "qkv_biased")
        q_part, k_part, v_part = _split(emit, projected, 2, widths, "split_qkv")
        q = _to_heads(emit, q_part, (batch, sequence, heads, head), "q")
        k = _to_heads(emit, k_part, (batch, sequence, heads, head), "k")
        v = _to_heads(emit, v_part, (batch, sequence, heads, v_head), "v")
        if past:
            past_k, past_v = (
                emit("Squeeze", [half], f"past_{what}", axes=[0])
                for half, what in zip(_split(emit, past, 0, [1, 1], "split_past"), "kv", strict=True)
            )
            k = emit("Concat", [past_k, k], "all_k", axis=2)
            v = emit("Concat", [past_v, v], "all_v", axis=2)
        if present:
            stacked = [
                emit("Unsqueeze", [t], f"present_{what}", axes=[0]) for t, what in ((k, "k"), (v, "v"))
            ]
            emit("Concat", stacked, "present", present, axis=0)
        index_lengths = {batch: "end positions", 2 * batch: "end then start positions"}
        padding = _mask(emit, scope, node, mask, sizes, index_lengths)
        bias_qk = _checked_bias(scope, node, attention_bias, sizes)
        _attend(emit, node, (q, k, v), bias_qk, padding, _scale(node, head), [batch, sequence, widths[2]])
        return emit.nodes


class MultiHeadAttentionRewrite(Rewrite):
    """com.microsoft MultiHeadAttention: separate query, key and value (3-D, or key/value in heads)."""

    op_types = frozenset({"MultiHeadAttention"})
    domain = _MS_DOMAIN

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        return in_float32(node, scope, self._lower_float32)

    def _lower_float32(self, node: onnx.NodeProto, scope: GraphScope) -> list[onnx.NodeProto]:
        query, key, value = node.input[0], input_at(node, 1), input_at(node, 2)
        bias, mask, attention_bias = input_at(node, 3), input_at(node, 4), input_at(node, 5)
        past_key, past_value = input_at(node, 6), input_at(node, 7)
        for index, what in ((8, "past_sequence_length"), (9, "cache_indirection")):
            if input_at(node, index):
                raise CannotLower(f"input {what} (decoder-masked attention's buffer sharing) is not lowered")
        if _output(node, 3):
            raise CannotLower("output qk is not lowered")
        if not key or not value:
            raise CannotLower(
                "a MultiHeadAttention without both key and value (packed QKV or KV) is not lowered: "
                "onnxruntime's CPU kernel implements no packed form"
            )
        if bool(past_key) != bool(past_value):
            raise CannotLower("past_key and past_value must be given together")
        if past_key and not (_output(node, 1) and _output(node, 2)):
            raise CannotLower(_PAST_WITHOUT_PRESENT)
        _require_float(scope, node, query, key, value, bias, past_key, past_value)
        heads = int(attribute(node, "num_heads", 0))
        q_dims = scope.require_static_shape(query, "is split into heads")
        k_dims = scope.require_static_shape(key, "is split into heads")
        v_dims = scope.require_static_shape(value, "is split into heads")
        if len(q_dims) != 3 or heads <= 0 or q_dims[2] % heads:
            raise CannotLower(
                f"query {list(q_dims)} is not (batch, sequence, num_heads · head) with num_heads={heads}; "
                "the packed 5-D QKV form is not implemented by onnxruntime's CPU kernel"
            )
        batch, sequence, hidden = q_dims
        head = hidden // heads
        emit = NodeEmitter(node, scope)
        if len(k_dims) == 3 and len(v_dims) == 3:
            if k_dims[0] != batch or k_dims[2] != hidden or v_dims[:2] != k_dims[:2] or v_dims[2] % heads:
                raise CannotLower(
                    f"key {list(k_dims)} and value {list(v_dims)} do not match query {list(q_dims)}"
                )
            kv_sequence, v_hidden = k_dims[1], v_dims[2]
            parts = [query, key, value]
            if bias:
                bias_dims = scope.require_static_shape(bias, "is split into Q, K and V biases")
                if tuple(bias_dims) != (2 * hidden + v_hidden,):
                    raise CannotLower(f"bias {list(bias_dims)} is not ({2 * hidden + v_hidden},)")
                biases = _split(emit, bias, 0, [hidden, hidden, v_hidden], "split_bias")
                parts = [
                    emit("Add", [x, b], f"{w}_biased") for x, b, w in zip(parts, biases, "qkv", strict=True)
                ]
            q = _to_heads(emit, parts[0], (batch, sequence, heads, head), "q")
            k = _to_heads(emit, parts[1], (batch, kv_sequence, heads, head), "k")
            v = _to_heads(emit, parts[2], (batch, kv_sequence, heads, v_hidden // heads), "v")
        elif len(k_dims) == 4 and len(v_dims) == 4:
            # Cross attention whose key and value are already [batch, heads, kv_sequence, head].
            if bias or past_key:
                raise CannotLower("key and value in heads (4-D) take neither bias nor past_key/past_value")
            if tuple(k_dims) != (batch, heads, k_dims[2], head) or tuple(v_dims) != tuple(k_dims):
                raise CannotLower(
                    f"key {list(k_dims)} and value {list(v_dims)} are not both (batch, num_heads, "
                    "kv_sequence, head) (onnxruntime requires the same shape)"
                )
            kv_sequence, v_hidden = k_dims[2], heads * v_dims[3]
            q = _to_heads(emit, query, (batch, sequence, heads, head), "q")
            k, v = key, value
        else:
            raise CannotLower(
                f"key {list(k_dims)} and value {list(v_dims)} are neither both 3-D nor both 4-D; the packed "
                "5-D KV form is not implemented by onnxruntime's CPU kernel"
            )
        v_head = v_hidden // heads
        past_sequence = 0
        if past_key:
            pk_dims = scope.require_static_shape(past_key, "gives the past sequence length")
            pv_dims = scope.require_static_shape(past_value, "gives the past sequence length")
            if (
                len(pk_dims) != 4
                or tuple(pk_dims[:2]) != (batch, heads)
                or pk_dims[3] != head
                or tuple(pv_dims) != tuple(pk_dims)
                or v_head != head
            ):
                raise CannotLower(
                    f"past_key {list(pk_dims)} and past_value {list(pv_dims)} are not both (batch, "
                    f"num_heads, past_sequence, {head}) with value heads of {head} (onnxruntime requires it)"
                )
            past_sequence = pk_dims[2]
            k = emit("Concat", [past_key, k], "all_k", axis=2)
            v = emit("Concat", [past_value, v], "all_v", axis=2)
        for index, state, what in ((1, k, "key"), (2, v, "value")):
            if _output(node, index):
                emit("Identity", [state], f"present_{what}", _output(node, index))
        if int(attribute(node, "unidirectional", 0)) and sequence > 1 and kv_sequence != sequence:
            # Measured on onnxruntime 1.32: it then masks as if the rows were past + sequence keys long
            # (row 0 loses every key after the past, later rows none), not "each query attends to the
            # keys up to past + its position"; that layout has no definition worth reproducing.
            raise CannotLower(
                f"unidirectional attention of {sequence} queries over {kv_sequence} new keys is not lowered: "
                "onnxruntime's CPU kernel defines causal masking only for as many keys as queries"
            )
        sizes = _Sizes(batch, sequence, past_sequence, kv_sequence, heads)
        padding = _mask(emit, scope, node, mask, sizes, {batch: "key sequence lengths"})
        bias_qk = _checked_bias(scope, node, attention_bias, sizes)
        _attend(emit, node, (q, k, v), bias_qk, padding, _scale(node, head), [batch, sequence, v_hidden])
        return emit.nodes
