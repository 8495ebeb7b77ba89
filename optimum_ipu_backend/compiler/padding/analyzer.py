"""The padding proof: is padding a call to compiled sizes invisible in every real output element?

``PaddingAnalyzer(model).prove(inputs)`` runs the graph abstractly at the padded sizes and at the
caller's sizes together (``values``, ``rules``) and answers for one call shape:

* ``exact``: every output element that exists at the caller's sizes is computed, at the padded sizes,
  exactly as without padding (up to the order of floating-point sums);
* ``output_maps``: where those elements are, per output and axis, so outputs are cut by dataflow and
  never by the names of their axes;
* ``problems``: otherwise, the node that breaks the proof and why, per failing output;
* ``obligations``: conditions on the caller's data the runtime must check before it pads (a softmax
  whose rows the user's attention mask could mask entirely, which would spread attention over the
  padding).

It works on the graph as exported (dynamic shapes, any opset), never changes it, and never reads the
values of large weights.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from optimum_ipu_backend.compiler.graphs import GraphView, index_operand_sources, iter_nodes

from . import classes as C
from .evaluate import EvaluationError, Evaluator
from .rules import Context, ProofAborted, Value, as_data, describe, rule_for, rule_not_followed
from .values import AxisMap, Concrete, Data, Layouts, complete, elem_type_of, inverse, real_positions, to_data

_logger = logging.getLogger(__name__)

#: Concrete tensors larger than this are kept as Data (their exactness, not their values).
CONCRETE_LIMIT = 1 << 20
#: Concrete evaluations of inputs up to this many bytes are remembered (at most this many of them).
_MEMO_BYTES = 4096
_MEMO_ENTRIES = 20000
#: Integer and boolean initializers up to this size are read (position-id buffers, causal masks).
SMALL_INTEGER_INITIALIZER = 1 << 22
#: Float initializers up to this size are read; larger ones are weights, assumed finite.
SMALL_FLOAT_INITIALIZER = 1 << 12
#: The format of a proof's JSON form: a stored proof of another format is never served. Raised whenever
#: the proof can answer differently (2: comparisons with constants and reverse CumSum).
PROOF_FORMAT = 2

# Operators whose rule must run even on concrete operands (their result depends on nothing else, but
# the rule records facts or the result may be huge).
_ALWAYS_RULE = frozenset({"Softmax", "LogSoftmax"})


@dataclass(frozen=True)
class PaddedInput:
    """One graph input of a padded call, as the runtime pads it."""

    shape: tuple[int, ...]  # padded
    real_shape: tuple[int, ...]  # the caller's
    maps: tuple[AxisMap, ...]
    #: Value of padded elements; None when padding continues the real values (position ids).
    fill: float | int | None = 0
    #: Axes padded by repeating real rows (the batch): such elements hold real values.
    repeated_axes: tuple[int, ...] = ()
    #: Both runs' values, for inputs the runtime makes itself (a mask over a padded past).
    values: tuple[np.ndarray, np.ndarray] | None = None


@dataclass(frozen=True)
class Obligation:
    """A condition on one mask input that padding relies on: every real row of a softmax keeps at least
    one real element unmasked. ``unmasked_if_one`` / ``unmasked_if_zero`` say, per (..., key) element in
    the caller's coordinates, whether it is unmasked when the mask holds 1 / 0 there."""

    input: str
    unmasked_if_one: np.ndarray
    unmasked_if_zero: np.ndarray

    def holds(self, mask: np.ndarray) -> bool:
        mask = np.asarray(mask)
        if mask.ndim < 2 or mask.size == 0:
            return False
        if mask.dtype != np.bool_ and not np.all((mask == 0) | (mask == 1)):
            return False
        # Leading axes of the mask are rows (batch, choices), flattened as the graph flattens them.
        ones = mask.reshape(-1, mask.shape[-1]) != 0
        rank = self.unmasked_if_one.ndim
        ones = ones.reshape(ones.shape[0], *([1] * (rank - 2)), ones.shape[1])
        row_ok = np.any((self.unmasked_if_one & ones) | (self.unmasked_if_zero & ~ones), axis=-1)
        return bool(np.all(row_ok))

    def to_json(self) -> dict[str, Any]:
        return {
            "input": self.input,
            "ones": _listed(self.unmasked_if_one),
            "zeros": _listed(self.unmasked_if_zero),
        }

    @staticmethod
    def from_json(stored: Mapping[str, Any]) -> Obligation:
        return Obligation(stored["input"], _array(stored["ones"], bool), _array(stored["zeros"], bool))


@dataclass
class PaddingProof:
    exact: bool
    problems: tuple[str, ...] = ()
    output_maps: dict[str, tuple[AxisMap, ...]] = field(default_factory=dict)
    obligations: tuple[Obligation, ...] = ()
    #: Inputs the proof took to hold only 0 and 1 (attention masks); the runtime checks them per call.
    binary_inputs: tuple[str, ...] = ()

    def holds_for(self, feed: Mapping[str, np.ndarray]) -> bool:
        """Whether the caller's own feed meets what the proof assumed of it."""
        for name in self.binary_inputs:
            value = np.asarray(feed[name])
            if value.dtype != np.bool_ and not np.all((value == 0) | (value == 1)):
                return False
        return all(ob.holds(feed[ob.input]) for ob in self.obligations)

    def to_json(self) -> dict[str, Any]:
        """The proof as JSON (``PROOF_FORMAT``), for the proofs store under the cache root."""
        return {
            "exact": self.exact,
            "problems": list(self.problems),
            "output_maps": {
                name: [None if m is None else m.tolist() for m in maps]
                for name, maps in self.output_maps.items()
            },
            "obligations": [obligation.to_json() for obligation in self.obligations],
            "binary_inputs": list(self.binary_inputs),
        }

    @staticmethod
    def from_json(stored: Mapping[str, Any]) -> PaddingProof:
        """The proof ``to_json`` wrote; ``KeyError``, ``TypeError`` or ``ValueError`` if it is malformed."""
        return PaddingProof(
            bool(stored["exact"]),
            tuple(stored["problems"]),
            {
                name: tuple(None if m is None else np.asarray(m, dtype=np.int64) for m in maps)
                for name, maps in stored["output_maps"].items()
            },
            tuple(Obligation.from_json(o) for o in stored["obligations"]),
            tuple(stored["binary_inputs"]),
        )


class PaddingAnalyzer:
    """Proves padding invisible for one graph; build once per graph, ``prove`` once per call shape."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self._evaluator = Evaluator(model)
        self._initializers = {init.name: init for init in model.graph.initializer}
        self._constants: dict[str, Value] = {}
        self._inputs = {vi.name: vi for vi in model.graph.input if vi.name not in self._initializers}
        # Inputs whose values reach a table's indices (token ids, positions), in any scope.
        every_scope = GraphView.of_model(model, subgraphs=True)
        self._index_inputs = index_operand_sources(every_scope) & set(self._inputs)
        self._cones: dict[tuple, frozenset[str]] = {}
        self._static: set[int] | None = None
        self._static_values: dict[int, list[Value]] = {}
        self._memo: dict[tuple, list[np.ndarray]] = {}

    # -- the proof -----------------------------------------------------------------------------------

    def prove(self, inputs: Mapping[str, PaddedInput]) -> PaddingProof:
        """Prove padding invisible for one call shape. Mask inputs are first taken as arbitrary
        integers; only if that fails, as holding 0 and 1 (which the runtime then checks per call)."""
        first = self._prove(inputs, binary=frozenset())
        candidates = self._mask_candidates(inputs)
        if first.exact or not candidates:
            return first
        second = self._prove(inputs, binary=candidates)
        if not second.exact:
            return first
        second.binary_inputs = tuple(sorted(candidates))
        return second

    def _prove(self, inputs: Mapping[str, PaddedInput], binary: frozenset[str]) -> PaddingProof:
        try:
            env, ctx = self._run(inputs, binary=binary)
            proof = self._verdict(env)
            if proof.exact and ctx.softmax_sites:
                proof = self._with_obligations(proof, inputs, env, ctx, binary)
            return proof
        except ProofAborted as error:
            return PaddingProof(False, (str(error),))
        except Exception as error:  # a defect of the proof must never let padding through
            _logger.warning("the padding proof stopped on an unexpected error; not padding", exc_info=True)
            return PaddingProof(
                False, (f"the padding proof could not follow the graph ({type(error).__name__}: {error})",)
            )

    def _mask_candidates(self, inputs: Mapping[str, PaddedInput]) -> frozenset[str]:
        """Integer or boolean inputs that are not indices and that the runtime does not make itself."""
        return frozenset(
            name
            for name, vi in self._inputs.items()
            if name not in self._index_inputs
            and name in inputs
            and inputs[name].values is None
            and vi.type.tensor_type.elem_type in _MASK_TYPES
        )

    def _run(
        self,
        inputs: Mapping[str, PaddedInput],
        *,
        binary: frozenset[str] = frozenset(),
        mask_variant: tuple[Mapping[str, int], Mapping[str, Value]] | None = None,
        watched: Iterable[str] = (),
    ) -> tuple[dict[str, Value], Context]:
        """One abstract run. ``mask_variant`` = (mask input -> value at every real element, the values of
        a previous run): only what those masks reach before a softmax is computed again."""
        layouts = Layouts()
        for layout in inputs.values():
            for axis, axis_map in enumerate(layout.maps):
                if axis_map is not None:
                    layouts.add(axis_map, layout.real_shape[axis])
        ctx = Context(layouts, self._evaluator, frozenset(watched))
        env: dict[str, Value] = {}
        for name in self._initializers:
            env[name] = self._constant(name)
        for name, value_info in self._inputs.items():
            if name not in inputs:
                raise ProofAborted(f"graph input {name!r} is not fed")
            layout = inputs[name]
            elem_type = value_info.type.tensor_type.elem_type
            if mask_variant is not None and name in mask_variant[0]:
                env[name] = _mask_variant(layout, elem_type, mask_variant[0][name])
            else:
                env[name] = _input_value(name, layout, elem_type, name in binary)
        reuse = None
        if mask_variant is not None:
            reuse = (mask_variant[1], self._reached_before_softmax(frozenset(mask_variant[0])))
        self._run_graph(self.model.graph, env, ctx, reuse)
        return env, ctx

    def _reached_before_softmax(self, sources: frozenset[str]) -> frozenset[str]:
        """Tensors whose values depend on ``sources`` along a path that passes no softmax."""
        key = ("reach", sources)
        cached = self._cones.get(key)
        if cached is None:
            reached = set(sources)
            for node in iter_nodes(self.model.graph):
                if node.op_type not in ("Softmax", "LogSoftmax") and any(i in reached for i in node.input):
                    reached.update(o for o in node.output if o)
            cached = self._cones[key] = frozenset(reached)
        return cached

    def _reached_avoiding_trigonometry(self, source: str) -> frozenset[str]:
        """Tensors whose values depend on ``source`` along a path through no Cos or Sin node.

        An input that reaches a softmax only through Cos or Sin (Llama's ``position_ids``, through its
        rotary embedding) does not decide which positions it hides: a cosine or sine of any finite value is
        finite, bounded data, as a table row an index input selects is, and masking comes only from the
        very negative values a mask path puts in. So it is no mask input of that softmax."""
        key = ("reach-avoiding-trigonometry", source)
        cached = self._cones.get(key)
        if cached is None:
            reached = {source}
            for node in iter_nodes(self.model.graph):
                if node.op_type not in ("Cos", "Sin") and any(i in reached for i in node.input):
                    reached.update(o for o in node.output if o)
            cached = self._cones[key] = frozenset(reached)
        return cached

    def _softmax_input(self, output: str) -> str:
        """The input of the softmax node that writes ``output``."""
        for node in iter_nodes(self.model.graph):
            if output in node.output:
                return node.input[0]
        raise KeyError(output)

    def _static_nodes(self) -> set[int]:
        """Top-level nodes whose every input is a weight, a constant or another such node's output:
        their results are the same in every run, so each is computed once per analyzer."""
        if self._static is None:
            known = set(self._initializers)
            static: set[int] = set()
            for index, node in enumerate(self.model.graph.node):
                if node.op_type == "If" or any(a.type in _GRAPH_ATTRIBUTES for a in node.attribute):
                    continue
                if all(not name or name in known for name in node.input):
                    static.add(index)
                    known.update(o for o in node.output if o)
            self._static = static
        return self._static

    def _run_graph(
        self,
        graph: onnx.GraphProto,
        env: dict[str, Value],
        ctx: Context,
        reuse: tuple[Mapping[str, Value], frozenset[str]] | None = None,
        scope: tuple = (),
    ) -> None:
        """Run ``graph``'s nodes; ``scope`` names the graph stably (the If branches it sits in)."""
        remaining = set(ctx.watched)
        static = self._static_nodes() if not scope else set()
        if reuse is not None:
            # Only what the varied masks reach before a softmax is computed again; the rest is reused.
            previous, reached = reuse
            env.update({name: value for name, value in previous.items() if name not in env})
        for index, node in enumerate(graph.node):
            if reuse is not None:
                if not remaining:
                    return  # every watched softmax has been seen
                # An If reads outer values inside its branches, not through its inputs: always run it.
                if node.op_type not in ("Softmax", "LogSoftmax", "If") and not any(
                    o in reached for o in node.output
                ):
                    continue
                remaining.discard(node.output[0] if node.output else "")
            if index in static:
                cached = self._static_values.get(index)
                if cached is not None:
                    env.update(zip(node.output, cached, strict=False))
                    continue
            values = []
            for name in node.input:
                if not name:
                    values.append(None)
                elif name in env:
                    values.append(env[name])
                else:
                    raise ProofAborted(describe(node, f"reads {name!r}, which nothing computed"))
            if node.op_type == "If":
                outputs = self._inline_if(node, values, env, ctx, (*scope, index))
            elif (
                all(v is None or isinstance(v, Concrete) for v in values) and node.op_type not in _ALWAYS_RULE
            ):
                outputs = self._evaluate(node, (scope, index), values, ctx)
            else:
                outputs = (rule_for(node) or rule_not_followed)(ctx, node, values)
            if index in static:
                self._static_values[index] = list(outputs)
            for name, value in zip(node.output, outputs, strict=False):
                if name:
                    env[name] = value

    def _evaluate(
        self, node: onnx.NodeProto, where: tuple, values: list[Value | None], ctx: Context
    ) -> list[Value]:
        try:
            padded = self._memoized(node, where, [None if v is None else v.padded for v in values])  # type: ignore[union-attr]
            if all(v is None or v.padded is v.unpadded for v in values):  # type: ignore[union-attr]
                unpadded = padded  # the same arrays in both runs: the same results
            else:
                unpadded = self._memoized(node, where, [None if v is None else v.unpadded for v in values])  # type: ignore[union-attr]
        except EvaluationError as error:
            raise ProofAborted(describe(node, f"cannot be evaluated: {error}")) from error
        outputs: list[Value] = []
        for p, u in zip(padded, unpadded, strict=True):
            p = np.asarray(p)
            value = Concrete(p, p if u is p else np.asarray(u))
            outputs.append(to_data(value, ctx.layouts) if value.size > CONCRETE_LIMIT else value)
        return outputs

    def _memoized(
        self, node: onnx.NodeProto, where: tuple, arrays: list[np.ndarray | None]
    ) -> list[np.ndarray]:
        """``Evaluator.run`` remembered for small inputs: successive call shapes (a generation's growing
        past) share most of their shape arithmetic at one padded size."""
        if sum(0 if a is None else a.nbytes for a in arrays) > _MEMO_BYTES:
            return self._evaluator.run(node, arrays)
        key = (where, *((None,) if a is None else (a.dtype.str, a.shape, a.tobytes()) for a in arrays))
        found = self._memo.get(key)
        if found is None:
            if len(self._memo) > _MEMO_ENTRIES:
                self._memo.clear()
            found = self._memo[key] = self._evaluator.run(node, arrays)
        return found

    def _inline_if(
        self,
        node: onnx.NodeProto,
        values: list[Value | None],
        env: dict[str, Value],
        ctx: Context,
        where: tuple,
    ) -> list[Value]:
        condition = values[0]
        if not isinstance(condition, Concrete):
            raise ProofAborted(describe(node, "branches on user data"))
        taken_p = bool(np.asarray(condition.padded).reshape(-1)[0])
        taken_u = bool(np.asarray(condition.unpadded).reshape(-1)[0])
        if taken_p != taken_u:
            raise ProofAborted(describe(node, "takes a different branch at the padded sizes"))
        branch = next(
            attr.g for attr in node.attribute if attr.name == ("then_branch" if taken_p else "else_branch")
        )
        for init in branch.initializer:
            env[init.name] = _constant_value(init)
        self._run_graph(branch, env, ctx, scope=(*where, taken_p))
        return [env[output.name] for output in branch.output]

    def _constant(self, name: str) -> Value:
        value = self._constants.get(name)
        if value is None:
            value = _constant_value(self._initializers[name])
            self._constants[name] = value
        return value

    # -- the answer ----------------------------------------------------------------------------------

    def _verdict(self, env: Mapping[str, Value]) -> PaddingProof:
        problems: list[str] = []
        maps: dict[str, tuple[AxisMap, ...]] = {}
        layouts = Layouts()
        for output in self.model.graph.output:
            value = env.get(output.name)
            if value is None:
                problems.append(f"output {output.name!r} is not computed")
                continue
            data = as_data(value, Context(layouts, self._evaluator)) if isinstance(value, Concrete) else value
            incomplete = [
                axis
                for axis, axis_map in enumerate(data.maps)
                if not complete(axis_map, data.real_shape[axis])
            ]
            if incomplete:
                problems.append(
                    f"output {output.name!r}: axis {incomplete[0]} does not hold every real element "
                    f"({data.blame or 'positions were dropped or reordered'})"
                )
            elif not data.is_exact():
                problems.append(
                    f"output {output.name!r}: {data.blame or 'its real elements depend on padding'}"
                )
            maps[output.name] = data.maps
        return PaddingProof(not problems, tuple(problems), maps)

    def _with_obligations(
        self,
        proof: PaddingProof,
        inputs: Mapping[str, PaddedInput],
        env: Mapping[str, Value],
        ctx: Context,
        binary: frozenset[str],
    ) -> PaddingProof:
        candidates = self._mask_candidates(inputs)
        sites = {}
        for site in ctx.softmax_sites:
            masks = {
                mask
                for mask in site.sources & candidates
                if self._softmax_input(site.output) in self._reached_avoiding_trigonometry(mask)
            }
            if len(masks) != 1:
                return PaddingProof(
                    False,
                    (
                        f"node {site.node!r} (Softmax): a real row could be masked entirely, and "
                        f"{'no single mask input' if not masks else 'more than one mask input'} decides it",
                    ),
                    proof.output_maps,
                )
            sites[site.output] = (next(iter(masks)), site.axis, site.node)
        masks = {mask for mask, _, _ in sites.values()}
        unmasked = {}
        for variant in (1, 0):
            _, variant_ctx = self._run(
                inputs, binary=binary, mask_variant=(dict.fromkeys(masks, variant), env), watched=sites
            )
            unmasked[variant] = variant_ctx.recorded
        obligations: dict[tuple, Obligation] = {}
        for output, (mask, axis, node) in sites.items():
            real_mask = inputs[mask].real_shape
            ones = _real_unmasked(unmasked[1].get(output), axis)
            zeros = _real_unmasked(unmasked[0].get(output), axis)
            rows = int(np.prod(real_mask[:-1])) if len(real_mask) >= 2 else -1
            if ones is None or zeros is None or rows < 0 or ones.ndim < 2:
                return PaddingProof(
                    False,
                    (f"node {node!r} (Softmax): its masking cannot be checked per call",),
                    proof.output_maps,
                )
            ones, zeros = np.broadcast_arrays(ones, zeros)
            ones, zeros = _compact(ones), _compact(zeros)
            if ones.shape[0] not in (1, rows) or ones.shape[-1] not in (1, real_mask[-1]):
                return PaddingProof(
                    False,
                    (f"node {node!r} (Softmax): its key axis does not line up with the mask input {mask!r}",),
                    proof.output_maps,
                )
            key = (mask, ones.shape, ones.tobytes(), zeros.shape, zeros.tobytes())
            obligations.setdefault(key, Obligation(mask, ones, zeros))
        return PaddingProof(True, (), proof.output_maps, tuple(obligations.values()))


def _listed(array: np.ndarray) -> dict[str, Any]:
    return {"shape": list(array.shape), "values": array.reshape(-1).astype(int).tolist()}


def _array(stored: Mapping[str, Any], dtype: type) -> np.ndarray:
    return np.asarray(stored["values"], dtype=dtype).reshape(stored["shape"])


def _compact(array: np.ndarray) -> np.ndarray:
    """``array`` with every axis along which it does not vary cut to size 1."""
    for axis in range(array.ndim):
        if array.shape[axis] > 1 and np.all(array == np.take(array, [0], axis=axis)):
            array = np.take(array, [0], axis=axis)
    return np.ascontiguousarray(array)


_GRAPH_ATTRIBUTES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)

_MASK_TYPES = frozenset(
    {
        onnx.TensorProto.INT64,
        onnx.TensorProto.INT32,
        onnx.TensorProto.BOOL,
        onnx.TensorProto.INT8,
        onnx.TensorProto.UINT8,
    }
)


def _real_unmasked(data: Data | None, axis: int) -> np.ndarray | None:
    """Whether each real element of a recorded softmax input is unmasked, in the caller's coordinates,
    with the softmax axis last."""
    if data is None:
        return None
    unmasked = C.IS_UNMASKED[data.classes]
    for a, axis_map in enumerate(data.maps):
        if unmasked.shape[a] == 1:
            continue
        if not complete(axis_map, data.real_shape[a]):
            return None
        unmasked = np.take(unmasked, inverse(axis_map, data.real_shape[a]), axis=a)
    return np.moveaxis(unmasked, axis, -1)


def _input_value(name: str, layout: PaddedInput, elem_type: int, binary: bool = False) -> Value:
    if layout.values is not None:
        return Concrete(np.asarray(layout.values[0]), np.asarray(layout.values[1]))
    rank = len(layout.shape)
    if elem_type == onnx.TensorProto.BOOL:
        real_class = C.BOOL
    else:
        real_class = C.Z01 if binary else C.SMALL
    if layout.fill is None:
        fill_class = C.SMALL
    else:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type) if elem_type else np.float32
        fill_class = int(C.classify(np.asarray(layout.fill, dtype=dtype)).reshape(-1)[0])
    padded = np.zeros((1,) * rank, bool)
    for axis, axis_map in enumerate(layout.maps):
        if axis_map is not None and axis not in layout.repeated_axes:
            view = [1] * rank
            view[axis] = layout.shape[axis]
            padded = padded | (axis_map < 0).reshape(view)
    classes = np.where(padded, fill_class, real_class).astype(np.int8)
    return Data(
        tuple(layout.shape),
        tuple(layout.real_shape),
        tuple(layout.maps),
        np.ones((1,) * rank, bool),
        classes,
        elem_type,
        frozenset({name}),
    )


def _mask_variant(layout: PaddedInput, elem_type: int, value: int) -> Concrete:
    """A mask input as a concrete tensor holding ``value`` at every real element (fill elsewhere)."""
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
    unpadded = np.full(layout.real_shape, value, dtype=dtype)
    padded = np.full(layout.shape, 0 if layout.fill is None else layout.fill, dtype=dtype)
    padded[real_positions(layout.maps, layout.shape)] = value
    return Concrete(padded, unpadded)


def _constant_value(init: onnx.TensorProto) -> Value:
    count = int(np.prod(init.dims)) if init.dims else 1
    integer = init.data_type in _MASK_TYPES or init.data_type in (
        onnx.TensorProto.INT16,
        onnx.TensorProto.UINT16,
        onnx.TensorProto.UINT32,
        onnx.TensorProto.UINT64,
    )
    limit = SMALL_INTEGER_INITIALIZER if integer else SMALL_FLOAT_INITIALIZER
    external = init.data_location == onnx.TensorProto.EXTERNAL
    if count <= limit and not external:
        array = numpy_helper.to_array(init)
        return Concrete(array, array)
    shape = tuple(int(d) for d in init.dims)
    return Data(
        shape,
        shape,
        (None,) * len(shape),
        np.ones((1,) * len(shape), bool),
        np.full((1,) * len(shape), C.SMALL, np.int8),  # weights are finite
        init.data_type,
    )


__all__ = ["PROOF_FORMAT", "Obligation", "PaddedInput", "PaddingAnalyzer", "PaddingProof", "elem_type_of"]
