"""A first-order estimate of a static graph's IPU memory: weights plus the largest live activation set.

It ignores what Poplar adds (code, exchange buffers, temporaries inside ops, tile imbalance), so a
graph that fits here may still not fit on the device; one that does not fit here will not.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import onnx

from .graphs import attribute, infer_shapes, iter_graphs, node_reads, subgraphs_of, tensor_bytes, value_bytes
from .passes.shard_over_ipus import VIRTUAL_GRAPH_ATTRIBUTE

IPU_MEMORY_BYTES = 900_000_000  # in-processor memory of one Mk2/Bow IPU
TILES_PER_IPU = 1472


@dataclass(frozen=True)
class MemoryEstimate:
    weights_bytes: int
    peak_activation_bytes: int
    total_bytes: int
    ipus_needed: int
    ipu_memory_bytes: int = IPU_MEMORY_BYTES
    tiles_per_ipu: int = TILES_PER_IPU

    @classmethod
    def of(cls, weights: int, peak: int, ipu_memory_bytes: int, tiles_per_ipu: int) -> MemoryEstimate:
        """The estimate for ``weights`` plus a ``peak`` of live activations on IPUs of that memory."""
        total = weights + peak
        return cls(
            weights_bytes=weights,
            peak_activation_bytes=peak,
            total_bytes=total,
            ipus_needed=max(1, math.ceil(total / ipu_memory_bytes)),
            ipu_memory_bytes=ipu_memory_bytes,
            tiles_per_ipu=tiles_per_ipu,
        )


def _constant_node_bytes(nodes: Iterable[onnx.NodeProto]) -> int:
    return sum(
        tensor_bytes(attr.t)
        for node in nodes
        if node.op_type == "Constant"
        for attr in node.attribute
        if attr.type == onnx.AttributeProto.TENSOR
    )


def _constant_bytes(graph: onnx.GraphProto) -> int:
    return sum(tensor_bytes(init) for init in graph.initializer) + _constant_node_bytes(graph.node)


def _peak_activations(
    graph: onnx.GraphProto, sizes: dict[str, int], constants: set[str], counted: set[str] | None = None
) -> int:
    """Largest sum of live activations while the nodes run in graph order (a topological order); only
    the tensors in ``counted`` when given (those one IPU of a sharded graph holds)."""
    if counted is not None:
        sizes = {name: size for name, size in sizes.items() if name in counted}
    last_use: dict[str, int] = {}
    for index, node in enumerate(graph.node):
        for name in node.input:
            last_use[name] = index
    end = len(graph.node)
    for output in graph.output:
        last_use[output.name] = end
    live: dict[str, int] = {}
    for graph_input in graph.input:
        if graph_input.name not in constants:
            live[graph_input.name] = sizes.get(graph_input.name, 0)
    peak = sum(live.values())
    for index, node in enumerate(graph.node):
        subgraph_peak = 0
        for branch in subgraphs_of(node):
            subgraph_peak = max(subgraph_peak, _peak_activations(branch, sizes, constants, counted))
        for name in node.output:
            if name and name not in constants:
                live[name] = sizes.get(name, 0)
        peak = max(peak, sum(live.values()) + subgraph_peak)
        for name in list(live):
            if last_use.get(name, -1) <= index:
                del live[name]
    return peak


def _with_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    if not any(graph.value_info for graph in iter_graphs(model.graph)):
        model = infer_shapes(model)
    return model


def estimate_memory_per_ipu(
    model: onnx.ModelProto, ipu_memory_bytes: int = IPU_MEMORY_BYTES, tiles_per_ipu: int = TILES_PER_IPU
) -> list[MemoryEstimate]:
    """``estimate_memory`` for each IPU of a graph sharded by the compiler (its nodes' ``__ipu_number``):
    the weights its nodes read (a weight read on two IPUs counts on both) and the peak of the activations
    its nodes produce or receive. A graph without placements is one IPU. ``ipus_needed`` above 1 says
    that IPU overflows."""
    model = _with_shapes(model)
    graph = model.graph
    placed = [(node, attribute(node, VIRTUAL_GRAPH_ATTRIBUTE)) for node in graph.node]
    if all(ipu is None for _, ipu in placed):
        return [estimate_memory(model, ipu_memory_bytes, tiles_per_ipu)]
    initializers = {init.name: tensor_bytes(init) for init in graph.initializer}
    sizes = {vi.name: value_bytes(vi) for vi in (*graph.input, *graph.value_info, *graph.output)}
    estimates = []
    for ipu in range(max(ipu or 0 for _, ipu in placed) + 1):
        nodes = [node for node, node_ipu in placed if (node_ipu or 0) == ipu]
        reads = set().union(*map(node_reads, nodes))
        weights = sum(size for name, size in initializers.items() if name in reads)
        weights += sum(_constant_bytes(sub) for node in nodes for sub in subgraphs_of(node))
        weights += _constant_node_bytes(nodes)
        held = reads | {name for node in nodes for name in node.output}
        peak = _peak_activations(graph, sizes, set(initializers), held)
        estimates.append(MemoryEstimate.of(weights, peak, ipu_memory_bytes, tiles_per_ipu))
    return estimates


def estimate_memory(
    model: onnx.ModelProto, ipu_memory_bytes: int = IPU_MEMORY_BYTES, tiles_per_ipu: int = TILES_PER_IPU
) -> MemoryEstimate:
    """Weights (initializers and Constant values) plus the peak of live activations, against IPU memory."""
    model = _with_shapes(model)
    weights = 0
    constants: set[str] = set()
    sizes: dict[str, int] = {}
    for graph in iter_graphs(model.graph):
        weights += _constant_bytes(graph)
        constants.update(init.name for init in graph.initializer)
        for value_info in list(graph.input) + list(graph.value_info) + list(graph.output):
            sizes[value_info.name] = value_bytes(value_info)
    peak = _peak_activations(model.graph, sizes, constants)
    return MemoryEstimate.of(weights, peak, ipu_memory_bytes, tiles_per_ipu)
