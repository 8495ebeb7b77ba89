"""ShardOverIPUs: every node on one IPU of a replica and in one pipeline stage, as PopART reads them.

PopART places an ONNX node on an IPU from its INT attribute ``__ipu_number`` (the virtual graph) and
in a pipeline stage from ``__pipeline_stage``; with ``virtualGraphMode = Manual`` either every op carries
a virtual graph or none does, ops of one stage share one virtual graph, and no tensor may be consumed in
an earlier stage than the one producing it. ONNX checkers and onnxruntime skip ``__``-prefixed
attributes, so the annotated graph is the graph the emulator runs.

Which IPU a node goes to:

* ``layers_per_ipu`` given (optimum-graphcore's field; ``-1`` entries share the remaining layers, the
  remainder on the last of them): a node belongs to the transformer layer its exporter name says
  (``/encoder/layer.3/...``, ``/h.3/...``, ``/layers.3/...``, ``/block.3/...``), and each layer to the
  IPU ``layers_per_ipu`` gives it. Nodes before the first layer (embeddings, mask preparation) start on
  IPU 0; nodes after the last layer (the head) stay with it, where optimum-graphcore sends the head
  back to IPU 0: that would add a pipeline stage and a copy for no memory a head needs.
* otherwise, balanced by the memory estimate: the nodes, in graph order, are cut into ``ipus``
  contiguous runs holding about equal shares of the weights they read (each weight counted at its
  first reader) plus the activations they produce.

Either way a node never goes to an earlier IPU than any of its producers, so IPUs (and the stages
numbered after them, skipping IPUs left empty) never decrease along an edge. Nodes inside a
subgraph (an If branch) take their parent node's place.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import onnx
from onnx import helper

from ..errors import PATTERN_INVALID_GRAPH, LegalizationError, UnsupportedNode
from ..graphs import attribute, iter_graphs, names_read, subgraphs_of, tensor_bytes, value_bytes
from .base import GraphPass, PassContext

VIRTUAL_GRAPH_ATTRIBUTE = "__ipu_number"
PIPELINE_STAGE_ATTRIBUTE = "__pipeline_stage"

# The layer index in an exporter's node name: BERT/RoBERTa "layer.N", GPT-2 "h.N", BART/Llama
# "layers.N", T5 "block.N" (whose "layer.M" names sub-blocks: the first match wins).
_LAYER_PATTERN = re.compile(r"(?:^|/)(?:layer|layers|h|block|blocks)[._](\d+)(?=/|$)")


class ShardingError(LegalizationError):
    """The asked sharding does not fit the model (``layers_per_ipu`` against its layers)."""


@dataclass(frozen=True)
class Sharding:
    """How one replica is spread: over ``ipus`` IPUs, by ``layers_per_ipu`` or balanced by memory."""

    ipus: int
    layers_per_ipu: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.ipus < 1:
            raise ValueError(f"ipus must be positive, got {self.ipus}")


def layer_of(node_name: str) -> int | None:
    """The transformer layer a node's exporter name places it in, or None."""
    match = _LAYER_PATTERN.search(node_name)
    return None if match is None else int(match.group(1))


def _refuse(reason: str) -> ShardingError:
    return ShardingError(
        "The model cannot be sharded as asked.",
        [UnsupportedNode("<graph>", "shard_over_ipus", "", reason, PATTERN_INVALID_GRAPH)],
        hints=[
            "set layers_per_ipu (ipu_config.json or provider option) to one count per IPU that add up to the "
            "model's layers, with -1 for 'the rest', or leave it unset to balance the IPUs by memory"
        ],
    )


def layer_ipus(layers_per_ipu: Sequence[int], ipus: int, layers: int) -> list[int]:
    """The IPU of each of ``layers`` layers, by optimum-graphcore's rules for ``layers_per_ipu``."""
    counts = list(layers_per_ipu)
    if counts and all(count == -1 for count in counts):
        counts = [-1] * ipus
    if len(counts) != ipus:
        raise _refuse(
            f"layers_per_ipu {list(layers_per_ipu)} has {len(counts)} entries for ipus_per_replica={ipus}; "
            "give one count per IPU (-1 shares the remaining layers)"
        )
    wildcards = [index for index, count in enumerate(counts) if count == -1]
    fixed = sum(count for count in counts if count != -1)
    if wildcards:
        rest = layers - fixed
        if rest < 0:
            raise _refuse(
                f"layers_per_ipu {list(layers_per_ipu)} places {fixed} layers and the model has {layers}"
            )
        share = rest // len(wildcards)
        for index in wildcards:
            counts[index] = share
        counts[wildcards[-1]] += rest - share * len(wildcards)
    if sum(counts) != layers:
        raise _refuse(
            f"layers_per_ipu {list(layers_per_ipu)} places {sum(counts)} layers and the model has {layers} "
            "(found from its node names); make the counts add up to it or use -1 for the rest"
        )
    return [ipu for ipu, count in enumerate(counts) for _ in range(count)]


def _node_costs(model: onnx.ModelProto, real_inputs: set[str]) -> list[int]:
    """Bytes each top-level node brings to its IPU: weights read first by it, and what it produces."""
    graph = model.graph
    sizes = {value.name: value_bytes(value) for value in (*graph.value_info, *graph.output)}
    weights = {value.name: value_bytes(value) for value in graph.input if value.name not in real_inputs}
    weights.update({tensor.name: tensor_bytes(tensor) for tensor in graph.initializer})
    seen: set[str] = set()
    costs = []
    for node in graph.node:
        cost = 1  # without shapes or weights, balance by node count
        for sub in subgraphs_of(node):
            for inner in iter_graphs(sub):
                cost += sum(tensor_bytes(tensor) for tensor in inner.initializer)
        for name in _reads(node):
            if name in weights and name not in seen:
                seen.add(name)
                cost += weights[name]
        cost += sum(sizes.get(name, 0) for name in node.output)
        costs.append(cost)
    return costs


def _reads(node: onnx.NodeProto) -> list[str]:
    """The tensors ``node`` reads, its subgraphs' outer-scope reads included; omitted inputs ("") are none."""
    return [name for name in node.input if name] + [
        name for sub in subgraphs_of(node) for name in names_read(sub)
    ]


def assign_ipus(model: onnx.ModelProto, sharding: Sharding, real_inputs: set[str]) -> list[int]:
    """The IPU of each top-level node, in graph order (see module doc)."""
    graph = model.graph
    if sharding.layers_per_ipu is not None:
        layers = [layer_of(node.name) for node in graph.node]
        known = [layer for layer in layers if layer is not None]
        if not known:
            raise _refuse(
                "layers_per_ipu needs the model's layers, and no node name says which layer it belongs to "
                "(like '/encoder/layer.0/...'); leave layers_per_ipu unset to balance the IPUs by memory"
            )
        per_layer = layer_ipus(sharding.layers_per_ipu, sharding.ipus, max(known) + 1)
        wanted = [0 if layer is None else per_layer[layer] for layer in layers]
    else:
        costs = _node_costs(model, real_inputs)
        total = sum(costs)
        wanted, before = [], 0
        for cost in costs:
            wanted.append(min(sharding.ipus - 1, int(sharding.ipus * (before + cost / 2) / total)))
            before += cost
    producer_ipu: dict[str, int] = {}
    assigned = []
    for node, ipu in zip(graph.node, wanted, strict=True):
        ipu = max([ipu, *(producer_ipu.get(name, 0) for name in _reads(node))])
        for name in node.output:
            if name:  # an omitted optional output is no tensor a later node could read
                producer_ipu[name] = ipu
        assigned.append(ipu)
    return assigned


def _set_int(node: onnx.NodeProto, name: str, value: int) -> None:
    kept = [attr for attr in node.attribute if attr.name != name]
    del node.attribute[:]
    node.attribute.extend(kept)
    node.attribute.append(helper.make_attribute(name, value))


def annotate(model: onnx.ModelProto, ipus: Sequence[int]) -> int:
    """Write each top-level node's IPU and stage (and its subgraphs' nodes'); returns the stage count."""
    stage_of = {ipu: stage for stage, ipu in enumerate(sorted(set(ipus)))}
    for node, ipu in zip(model.graph.node, ipus, strict=True):
        for target in [
            node,
            *(inner for sub in subgraphs_of(node) for g in iter_graphs(sub) for inner in g.node),
        ]:
            _set_int(target, VIRTUAL_GRAPH_ATTRIBUTE, ipu)
            _set_int(target, PIPELINE_STAGE_ATTRIBUTE, stage_of[ipu])
    return len(stage_of)


def placement_problems(model: onnx.ModelProto, ipus: int) -> list[str]:
    """What breaks PopART's rules for a manual, pipelined placement (as the SDK documents them)."""
    problems = []
    producer: dict[str, tuple[str, int, int]] = {}
    stage_ipu: dict[int, int] = {}
    for graph in iter_graphs(model.graph):
        for node in graph.node:
            label = node.name or node.output[0]
            ipu = attribute(node, VIRTUAL_GRAPH_ATTRIBUTE)
            stage = attribute(node, PIPELINE_STAGE_ATTRIBUTE)
            if ipu is None or stage is None:
                problems.append(f"{label} has no IPU or no pipeline stage")
                continue
            if not 0 <= ipu < ipus:
                problems.append(f"{label} is on IPU {ipu}, outside 0..{ipus - 1}")
            if stage_ipu.setdefault(stage, ipu) != ipu:
                problems.append(f"stage {stage} spans IPUs {stage_ipu[stage]} and {ipu} ({label})")
            for name in node.input:
                source = producer.get(name)
                if source is not None and source[2] > stage:
                    problems.append(
                        f"{label} (stage {stage}) reads {name!r} from {source[0]} (stage {source[2]})"
                    )
            for name in node.output:
                producer[name] = (label, ipu, stage)
    stages = sorted(stage_ipu)
    if stages and stages != list(range(len(stages))):
        problems.append(f"pipeline stages {stages} are not 0..{len(stages) - 1}")
    return problems


class ShardOverIPUs(GraphPass):
    name = "shard_over_ipus"
    guarantee = "every node carries one IPU and one pipeline stage, never decreasing along an edge"

    def __init__(self, sharding: Sharding) -> None:
        super().__init__()
        self.sharding = sharding

    def run(self, model: onnx.ModelProto, ctx: PassContext) -> onnx.ModelProto:
        self.notes = []
        ipus = assign_ipus(model, self.sharding, set(ctx.input_shapes))
        stages = annotate(model, ipus)
        counts = {ipu: ipus.count(ipu) for ipu in sorted(set(ipus))}
        how = "by layers_per_ipu" if self.sharding.layers_per_ipu is not None else "balanced by memory"
        per_ipu = ", ".join(f"IPU {ipu}: {count}" for ipu, count in counts.items())
        self.notes.append(
            f"{len(ipus)} nodes over {self.sharding.ipus} IPUs {how} ({per_ipu}); {stages} pipeline stage(s)"
        )
        problems = placement_problems(model, self.sharding.ipus)
        if problems:  # the assignment above cannot produce these; a graph out of order can
            raise _refuse("; ".join(problems[:5]))
        return model
