"""Keep a decoder's key/value cache on the device: its carried state becomes PopART variables.

A decoding step of an exported decoder reads the past keys and values (``past_*``), appends the new
token's to them and returns the result (``present_*``), which the caller feeds back as the next past.
Streamed, that moves the whole cache over the host link twice per token. This rewrite turns the
legalized decode graph (static shapes: the past at its planned maximum ``M``, one new token) into one that
keeps the cache as device state, in PopART's own form (``engines.base.state_updates``: an initializer
that an ``ai.graphcore`` CopyVarUpdate overwrites at the end of each run, every reader seeing the value
from before the run):

* a **growing** state is a past input ``X`` whose present output is ``Concat(X, new)`` along the past
  axis with one new position: the graph returns only ``new`` (under the present's name), and writes it
  into ``X`` the way the runtime pads the past: after the real positions when the past is padded on the
  right (at the slot ``LENGTH_INPUT`` names: ``Where(slot == length, new, X)``), or shifting the past
  left by one when it is padded on the left (real positions last, which keeps relative positions exact);
* a **constant** state is a past input that no present extends (the cross-attention cache); it is kept
  as it is;
* an **appended** input is a mask over the past positions (and the new one): the caller's value each
  step is the last one plus one position, so the graph keeps the past part as state and takes only the
  new position (``[batch, 1]`` under the input's own name), written in as a growing state's is.

An engine that keeps no integer state (PopTorch turns integer buffers into constants) gets an integer
appended input's state as float32, read through a Cast back to the input's type and written through a Cast
to float32. That is exact: the state only ever holds zeros, what the runtime uploads and the new positions
the caller feeds (the update is a ``Where`` or a shift of those), and the runtime checks that every such
value is an integer of magnitude at most ``StateSpec.exact_within`` (2**24, where float32 still holds every
integer) before it is sent; a call that holds another value is streamed. A past of integer type on such an
engine is refused: the graph computes its new positions, and no bound on them is known.

Every state is read through ``Gather(state, rows)`` on its batch axis, ``ROWS_INPUT`` giving for each row
the row of the kept state it continues: beam search reorders its hypotheses every step, and the
reorder then costs an index, not a re-upload. The new state is the reordered one, updated.

What the graph must look like is checked from dataflow (the Concat feeding the output, its axis and
sizes); a graph that does not match raises ``CarriedStateRefused`` naming what did not, and the runtime
streams that model's cache instead. ``carried_state_plan`` reads back, from the rewritten graph's
metadata, what the runtime needs to feed it and rebuild the caller's ``present_*``.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from optimum_ipu_backend.engines.base import STATE_UPDATE_DOMAIN, STATE_UPDATE_OP

ROWS_INPUT = "ipu_state_rows"
LENGTH_INPUT = "ipu_state_length"
#: Prefix of the state that keeps an appended input's past positions.
APPENDED_STATE_PREFIX = "ipu_carried::"
PLAN_METADATA_KEY = "ipu_carried_state"
#: Every integer of magnitude up to 2**24 is a float32 (24 significant bits).
FLOAT32_EXACT_INTEGERS = 2**24


class CarriedStateRefused(Exception):
    """The decode graph does not have the form whose cache can stay on the device. Internal: the runtime
    streams the cache instead and reports why (``kv_cache_verdict``); no user sees it raised."""


@dataclass(frozen=True)
class CarryRequest:
    """What the rewrite is told of the served graph (the runtime finds it from the inputs' roles and
    shapes): each past input with its batch axis, each mask over the past with its batch and positions
    axes, and the side the runtime pads the past on ("left" or "right")."""

    past_inputs: dict[str, int]
    appended_inputs: dict[str, tuple[int, int]]
    padding_side: str
    #: Whether the engine keeps integer variables (``engines.base.Engine.integer_state``).
    integer_state: bool = True


@dataclass(frozen=True)
class StateSpec:
    """One tensor kept on the device. ``kind``: ``"grows"`` (a past the present extends by one position),
    ``"constant"`` (a past nothing extends) or ``"appended"`` (a mask input the caller extends).
    ``input``: the graph input it replaces; ``state``: the variable's name; ``output``: the present output
    that returns the new position (grows); ``axis``: the positions axis; ``batch_axis``: where rows go;
    ``spans_new``: an appended input also covers the new position (GPT-2's ``attention_mask``);
    ``exact_within``: set when an integer input is kept as float32, the largest magnitude it holds exactly
    (values fed or uploaded beyond it must not reach the state)."""

    kind: str
    input: str
    state: str
    axis: int | None = None
    batch_axis: int = 0
    output: str | None = None
    spans_new: bool = False
    exact_within: int | None = None


@dataclass(frozen=True)
class CarriedStatePlan:
    states: tuple[StateSpec, ...]
    #: "left" (real positions last, the past shifts) or "right" (real positions first, written at a slot).
    padding_side: str

    def to_json(self) -> str:
        return json.dumps({"padding_side": self.padding_side, "states": [asdict(s) for s in self.states]})

    @classmethod
    def from_json(cls, text: str) -> CarriedStatePlan:
        data = json.loads(text)
        return cls(tuple(StateSpec(**s) for s in data["states"]), data["padding_side"])


def carried_state_plan(model: onnx.ModelProto) -> CarriedStatePlan | None:
    """The plan ``carry_state`` stored in a rewritten graph, or None for any other graph."""
    for entry in model.metadata_props:
        if entry.key == PLAN_METADATA_KEY:
            return CarriedStatePlan.from_json(entry.value)
    return None


def carry_state(model: onnx.ModelProto, request: CarryRequest) -> tuple[onnx.ModelProto, CarriedStatePlan]:
    """Rewrite the legalized decode graph ``model`` (changed in place and returned) so that its cache stays
    on the device, as ``request`` says."""
    past_inputs, appended_inputs = request.past_inputs, request.appended_inputs
    padding_side = request.padding_side
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side is 'left' or 'right', not {padding_side!r}")
    graph = model.graph
    inputs = {value.name: value for value in graph.input}
    outputs = {value.name: value for value in graph.output}
    producers = {output: node for node in graph.node for output in node.output}
    missing = sorted(name for name in [*past_inputs, *appended_inputs] if name not in inputs)
    if missing:
        raise CarriedStateRefused(f"the decode graph has no input(s) {missing}")
    new_nodes: list[onnx.NodeProto] = []
    updates: list[onnx.NodeProto] = []
    states: list[StateSpec] = []
    touched: set[str] = set()
    rows: dict[str, int] = {}  # rows of each state, which must agree
    uses_length = False

    def dims_of(value: onnx.ValueInfoProto) -> list[int]:
        return [dim.dim_value for dim in value.type.tensor_type.shape.dim]

    def rename_uses(old: str, new: str) -> None:
        for node in graph.node:
            node.input[:] = [new if name == old else name for name in node.input]

    def constant(name: str, values: np.ndarray) -> str:
        graph.initializer.append(numpy_helper.from_array(values, name))
        return name

    def slice_(source: str, target: str, start: int, end: int, axis: int) -> None:
        bounds = [
            constant(f"{target}::{label}", np.array([value], np.int64))
            for label, value in (("start", start), ("end", end), ("axis", axis))
        ]
        new_nodes.append(helper.make_node("Slice", [source, *bounds], [target]))

    def written(state: str, value: str, dims: list[int], axis: int) -> str:
        """``state`` (``dims``) with ``value`` (one position on ``axis``) written in as the runtime pads."""
        nonlocal uses_length
        size, target = dims[axis], f"{state}::next"
        if padding_side == "left":  # real positions last: shift the past left, the new one at the end
            slice_(state, f"{state}::kept", 1, size, axis)
            new_nodes.append(helper.make_node("Concat", [f"{state}::kept", value], [target], axis=axis))
            return target
        uses_length = True  # real positions first: the new one at the slot after them
        slots = constant(
            f"{state}::slots",
            np.arange(size, dtype=np.int32).reshape([size if d == axis else 1 for d in range(len(dims))]),
        )
        new_nodes.append(helper.make_node("Equal", [slots, LENGTH_INPUT], [f"{state}::at"]))
        new_nodes.append(helper.make_node("Where", [f"{state}::at", value, state], [target]))
        return target

    def read_rows(variable: str, dims: list[int], batch_axis: int) -> str:
        rows[variable] = dims[batch_axis]
        read = f"{variable}::rows"
        new_nodes.append(helper.make_node("Gather", [variable, ROWS_INPUT], [read], axis=batch_axis))
        return read

    def is_integer(value: onnx.ValueInfoProto) -> bool:
        dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        return not np.issubdtype(dtype, np.floating)

    past_positions = None
    for name, batch_axis in past_inputs.items():
        if not request.integer_state and is_integer(inputs[name]):
            raise CarriedStateRefused(
                f"past {name!r} is not floating point and the engine keeps only floating-point state; its "
                "new positions are computed on the device, so no bound says float32 would hold them exactly"
            )
        dims = dims_of(inputs[name])
        read = f"{name}::rows"
        rename_uses(name, read)
        read_rows(name, dims, batch_axis)
        grows = _growing_output(producers, outputs, read, dims)
        if grows is None:
            updates.append(_update(name, read))
            states.append(StateSpec("constant", name, name, batch_axis=batch_axis))
            continue
        output, concat, axis = grows
        if past_positions not in (None, dims[axis]):
            raise CarriedStateRefused(f"past {name!r} has {dims[axis]} positions, another {past_positions}")
        past_positions = dims[axis]
        full = f"{output}::full"
        concat.output[0] = full
        rename_uses(output, full)
        slice_(full, output, dims[axis], dims[axis] + 1, axis)
        updates.append(_update(name, written(read, output, dims, axis)))
        states.append(StateSpec("grows", name, name, axis, batch_axis, output))
        outputs[output].type.tensor_type.shape.dim[axis].dim_value = 1
        touched.add(output)

    for name, (batch_axis, axis) in appended_inputs.items():
        value = inputs[name]
        dims = dims_of(value)
        if past_positions is None or dims[axis] not in (past_positions, past_positions + 1):
            raise CarriedStateRefused(
                f"input {name!r} has {dims[axis]} positions on axis {axis}; a mask kept on the device covers "
                f"the {past_positions} positions of a growing past, or those and the new one"
            )
        spans_new = dims[axis] == past_positions + 1
        state = APPENDED_STATE_PREFIX + name
        state_dims = list(dims)
        state_dims[axis] = past_positions
        elem_type = value.type.tensor_type.elem_type
        as_float = not request.integer_state and is_integer(value)
        graph.initializer.append(_zeros(state, state_dims, TensorProto.FLOAT if as_float else elem_type))
        full = f"{state}::full"
        rename_uses(name, full)
        read = read_rows(state, state_dims, batch_axis)
        if as_float:  # read back as the input's type; exact for the values the runtime lets in
            new_nodes.append(helper.make_node("Cast", [read], [f"{read}::int"], to=elem_type))
            read = f"{read}::int"
        if spans_new:
            new_nodes.append(helper.make_node("Concat", [read, name], [full], axis=axis))
        else:
            new_nodes.append(helper.make_node("Identity", [read], [full]))
        next_value = written(read, name, state_dims, axis)
        if as_float:
            as_stored = f"{state}::float"
            new_nodes.append(helper.make_node("Cast", [next_value], [as_stored], to=TensorProto.FLOAT))
            next_value = as_stored
        updates.append(_update(state, next_value))
        one = list(dims)
        one[axis] = 1
        value.type.tensor_type.shape.CopyFrom(helper.make_tensor_type_proto(elem_type, one).tensor_type.shape)
        exact = FLOAT32_EXACT_INTEGERS if as_float else None
        states.append(
            StateSpec("appended", name, state, axis, batch_axis, spans_new=spans_new, exact_within=exact)
        )
        touched.add(name)

    if not states:
        raise CarriedStateRefused("the decode graph has no past inputs to keep on the device")
    returned = sorted(name for name in outputs if name in past_inputs)
    if returned:  # a variable cannot also be a graph output: the past would be streamed back whole
        raise CarriedStateRefused(f"the decode graph returns its past input(s) {returned} unchanged")
    if len(set(rows.values())) > 1:
        raise CarriedStateRefused(f"the state has different row counts: {rows}")
    for name in past_inputs:  # the past inputs become variables of the same shape and type
        value = inputs[name]
        graph.initializer.append(_zeros(name, dims_of(value), value.type.tensor_type.elem_type))
        graph.input.remove(value)
        touched.add(name)
    graph.input.append(
        helper.make_tensor_value_info(ROWS_INPUT, TensorProto.INT32, [next(iter(rows.values()))])
    )
    if uses_length:
        graph.input.append(helper.make_tensor_value_info(LENGTH_INPUT, TensorProto.INT32, []))
    kept_info = [info for info in graph.value_info if info.name not in touched]
    del graph.value_info[:]
    graph.value_info.extend(kept_info)
    nodes = _topological(
        [*new_nodes, *graph.node, *updates],
        {value.name for value in graph.input} | {tensor.name for tensor in graph.initializer},
    )
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(entry.domain == STATE_UPDATE_DOMAIN for entry in model.opset_import):
        model.opset_import.append(helper.make_opsetid(STATE_UPDATE_DOMAIN, 1))
    plan = CarriedStatePlan(tuple(states), padding_side)
    metadata = {entry.key: entry.value for entry in model.metadata_props}
    helper.set_model_props(model, {**metadata, PLAN_METADATA_KEY: plan.to_json()})
    return model, plan


def _growing_output(
    producers: Mapping[str, onnx.NodeProto],
    outputs: Mapping[str, onnx.ValueInfoProto],
    read: str,
    dims: list[int],
) -> tuple[str, onnx.NodeProto, int] | None:
    """(output, its Concat, positions axis) when a graph output is ``Concat(read, new)`` with one new
    position and otherwise ``read``'s shape; None when no output extends it."""
    for name, value in outputs.items():
        node = producers.get(name)
        if node is None or node.op_type != "Concat" or read not in node.input:
            continue
        if len(node.input) != 2 or node.input[0] != read:
            raise CarriedStateRefused(
                f"output {name!r} concatenates the past with {len(node.input) - 1} other tensor(s), not "
                "the past first and then the new positions"
            )
        axis = next(a.i for a in node.attribute if a.name == "axis")
        axis = axis + len(dims) if axis < 0 else axis
        out_dims = [dim.dim_value for dim in value.type.tensor_type.shape.dim]
        expected = list(dims)
        expected[axis] += 1
        if out_dims != expected:
            raise CarriedStateRefused(
                f"output {name!r} concatenates the past {dims} into {out_dims}, not one more position on "
                f"axis {axis}"
            )
        return name, node, axis
    return None


def _update(variable: str, updater: str) -> onnx.NodeProto:
    return helper.make_node(
        STATE_UPDATE_OP, [variable, updater], [f"{variable}::updated"], domain=STATE_UPDATE_DOMAIN
    )


def _zeros(name: str, dims: list[int], elem_type: int) -> onnx.TensorProto:
    dtype = helper.tensor_dtype_to_np_dtype(elem_type)
    return numpy_helper.from_array(np.zeros(dims, dtype), name)


def _topological(nodes: list[onnx.NodeProto], available: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` in an order where each reads only what is available before it (Kahn's algorithm, stable)."""
    producer = {output: index for index, node in enumerate(nodes) for output in node.output}
    waiting = [0] * len(nodes)
    readers: dict[int, list[int]] = {}
    for index, node in enumerate(nodes):
        for name in node.input:
            if name and name not in available:
                if name not in producer:
                    raise CarriedStateRefused(
                        f"node {node.name or node.op_type!r} reads {name!r}, which nothing makes"
                    )
                waiting[index] += 1
                readers.setdefault(producer[name], []).append(index)

    ready = [index for index, count in enumerate(waiting) if count == 0]
    heapq.heapify(ready)
    ordered = []
    while ready:
        index = heapq.heappop(ready)
        ordered.append(nodes[index])
        for reader in readers.get(index, ()):
            waiting[reader] -= 1
            if waiting[reader] == 0:
                heapq.heappush(ready, reader)
    if len(ordered) != len(nodes):
        raise CarriedStateRefused("the rewritten decode graph has a cycle")
    return ordered
