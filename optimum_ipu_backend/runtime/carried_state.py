"""Generation steps served with the key/value cache kept on the device.

A decoder step fed one new token and a past of ``P`` positions runs on ONE decode executable: the graph
compiled with the past at its largest planned size ``M`` and rewritten so that the cache is device state
(``compiler.carried_state``). Only the new token's keys and values come back; they are
written into a host *mirror*, and the caller gets views of it as ``present_*`` (optimum's loop then runs
unchanged, handing the same buffers back as the next ``past_*``).

Whether the device holds the past a call brings is decided from its content, never from how the caller
behaves:

* the past is the views returned last time (same buffer, shape and strides) and its rows still hash to
  what was returned: nothing is uploaded;
* its rows hash to rows of what the device holds, in another order (beam search reorders hypotheses by
  ``index_select``): the device reorders (the graph's ``rows`` input), nothing is uploaded;
* anything else (an edited cache, another generation interleaved on the session, the device lost its
  state): the past is padded as a streamed step would pad it and uploaded whole.

Masks over the past (GPT-2's ``attention_mask``, the runtime's own past mask) are kept on the device too:
a call sends only their new position, after the part the device holds is checked equal to the call's.
Steps of one decode executable hold its lock from the check to the mirror's update, so threads that
interleave generations each get their own cache, re-uploaded when the other ran in between.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import xxhash

from optimum_ipu_backend.compiler.carried_state import (
    FLOAT32_EXACT_INTEGERS,
    LENGTH_INPUT,
    ROWS_INPUT,
    CarriedStatePlan,
    CarriedStateRefused,
    CarryRequest,
    StateSpec,
)
from optimum_ipu_backend.errors import DeviceError
from optimum_ipu_backend.runtime.boundary import to_device_dtype, to_host_dtype
from optimum_ipu_backend.runtime.dim_expressions import DimExpression
from optimum_ipu_backend.runtime.padding import SymbolicShape, cut_output
from optimum_ipu_backend.runtime.roles import (
    InputRole,
    generation_step_dims,
    input_role,
    is_batch_dim,
    is_past_dim,
)

if TYPE_CHECKING:
    from optimum_ipu_backend.runtime.buckets import BucketPlan
    from optimum_ipu_backend.runtime.executables import CompiledEntry, ExecutableTable
    from optimum_ipu_backend.runtime.padding import PaddingDecisions


class StepRunner(Protocol):
    """What carried steps use of the runner that serves every other call (``serving.StaticShapeRunner``):
    its shapes, plan, padding decisions and executables, and the way it pads a feed."""

    input_shapes: Mapping[str, SymbolicShape]
    output_dtypes: Mapping[str, np.dtype]
    config: Any  # serving.ServingConfig
    plan: BucketPlan
    decisions: PaddingDecisions
    executables: ExecutableTable

    def call_dims(
        self, feed: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, SymbolicShape], dict[str, int]]: ...

    def compiled_sizes(self, actual: Mapping[str, int], branches: Mapping[str, bool]) -> dict[str, int]: ...

    def padded(
        self,
        feed: Mapping[str, np.ndarray],
        shapes: Mapping[str, SymbolicShape],
        targets: Mapping[str, int],
        actual: Mapping[str, int],
    ) -> dict[str, np.ndarray]: ...

    def generated_masks(
        self, shapes: Mapping[str, SymbolicShape], actual: Mapping[str, int], targets: Mapping[str, int]
    ) -> dict[str, np.ndarray]: ...

    def check_limit(self, shapes: Mapping[str, tuple[int, ...]], branches: Mapping[str, bool]) -> None: ...


_logger = logging.getLogger(__name__)


@dataclass
class _Resident:
    """What the device holds for one decode executable, and the host mirror of it."""

    epoch: int
    length: int  # real past positions the device holds
    mirrors: dict[str, np.ndarray]  # growing state -> [.., M, ..] host copy, real positions first
    row_digests: dict[str, list[bytes]]  # state input -> digest of each row as last returned or uploaded
    masks: dict[str, np.ndarray] = field(default_factory=dict)  # appended input -> real values held


def _row_digests(array: np.ndarray, batch_axis: int) -> list[bytes]:
    """A 128-bit digest of each row: equal digests are taken as equal rows (a collision is ~2^-64 even for
    billions of rows). A row is hashed in C order straight from memory, block by contiguous block (a view
    of the mirror is contiguous along each head), never copied."""
    digests = []
    for row in range(array.shape[batch_axis]):
        hasher = xxhash.xxh3_128()
        _hash_c_order(hasher, array[(slice(None),) * batch_axis + (row,)])
        digests.append(hasher.digest())
    return digests


def _hash_c_order(hasher: xxhash.xxh3_128, array: np.ndarray) -> None:
    if array.flags.c_contiguous:
        hasher.update(array.data)
    elif array.ndim == 1:
        hasher.update(np.ascontiguousarray(array).data)
    else:
        for part in array:
            _hash_c_order(hasher, part)


def _positions(axis: int, start: int, stop: int, rank: int) -> tuple[slice, ...]:
    selector = [slice(None)] * rank
    selector[axis] = slice(start, stop)
    return tuple(selector)


class CarriedState:
    """Decides which calls a decode executable with device state serves, and serves them."""

    def __init__(self, runner: StepRunner, request: CarryRequest, past_dim: str) -> None:
        self._runner = runner
        self.request = request
        runner.executables.carry_request = request  # a signature with ROWS_INPUT compiles with it
        self._past_dim = past_dim
        self._step_dims = generation_step_dims(runner.input_shapes)
        # Where a call's new tokens are counted, read straight off the feed: most calls a decoder session
        # serves that are no decoding step (the prompt) leave here before any dimension is inferred.
        self._step_axes = [
            (name, axis)
            for name, shape in runner.input_shapes.items()
            for axis, dim in enumerate(shape)
            if dim in self._step_dims
        ]
        self._refused: str | None = None
        self._streamed_why: str | None = None  # why the last decoding step that was streamed was
        self.served_steps = 0  # decoding steps served with the cache on the device
        self._lock = threading.Lock()
        self._resident: dict[int, _Resident] = {}  # id(entry) -> what its device holds
        self._signatures: dict[int, tuple[dict[str, tuple[int, ...]], dict[str, bool]]] = {}

    @classmethod
    def for_runner(cls, runner: StepRunner) -> CarriedState | None:
        """The carried state of a decoder with a bucketed past, or None for other graphs."""
        shapes = runner.input_shapes
        config = runner.config
        past = [name for name in shapes if input_role(name) is InputRole.PAST]
        if not past or config.device_iterations != 1 or config.replicas != 1:
            return None
        past_dims = {
            str(dim) for name in past for dim in shapes[name] if isinstance(dim, str) and is_past_dim(dim)
        }
        if len(past_dims) != 1:
            return None
        past_dim = past_dims.pop()
        if past_dim not in runner.plan.sizes:
            return None
        batch_axes = {}
        for name in past:
            axis = _batch_axis(shapes[name])
            if axis is None:
                return None
            batch_axes[name] = axis
        appended = {}
        generated = dict(config.generated_masks)
        for name, shape in shapes.items():
            if input_role(name) is not InputRole.ATTENTION_MASK and generated.get(name) != past_dim:
                continue
            for axis, dim in enumerate(shape):
                if isinstance(dim, str) and past_dim in DimExpression.parse(dim).symbols:
                    batch_axis = _batch_axis(shape)
                    if batch_axis is None:
                        return None
                    appended[name] = (batch_axis, axis)
        side = "left" if past_dim in config.left_padded_dims else "right"
        integer_state = runner.executables.engine_integer_state
        return cls(runner, CarryRequest(batch_axes, appended, side, integer_state), past_dim)

    @property
    def verdict(self) -> str:
        """Why decoding steps are (not) served with the cache on the device."""
        if self._refused is not None:
            return f"the key/value cache is streamed: {self._refused}"
        if self.served_steps == 0 and self._streamed_why is not None:
            return f"the key/value cache is streamed: {self._streamed_why}"
        kept = (
            ""
            if self.request.integer_state or not self.request.appended_inputs
            else f"; masks kept as float32, exact up to {FLOAT32_EXACT_INTEGERS} (steps holding larger "
            "values are streamed)"
        )
        return (
            "the key/value cache stays on the device (one decode executable at "
            f"{self._past_dim}={self.capacity}){kept}"
        )

    def _streamed(self, why: str) -> None:
        """A decoding step this executable does not serve: it is streamed, and the verdict says why until
        a step is served with the cache on the device."""
        if why != self._streamed_why:
            _logger.info("a decoding step is streamed: %s", why)
        self._streamed_why = why
        return None

    @property
    def capacity(self) -> int:
        return self._runner.plan.largest(self._past_dim)

    @property
    def padded_dims(self) -> frozenset[str]:
        """What serving steps and prompts on one executable pads: a step's new tokens, a prompt's past."""
        return frozenset({*self._step_dims, self._past_dim})

    def is_step(self, actual: Mapping[str, int]) -> bool:
        """Whether a call of these dimension sizes is a decoding step: one new token after a past."""
        return all(actual.get(dim) == 1 for dim in self._step_dims) and actual.get(self._past_dim, 0) > 0

    def release(self) -> None:
        """Close the decode executables (their cache is forgotten), so that their IPUs go to the executables
        that serve the steps instead (the serving plan's SHARED arrangement)."""
        if not self._signatures:
            return
        with self._lock:
            signatures = list(self._signatures.values())
            self._signatures.clear()
            self._resident.clear()
        for signature, branches in signatures:
            self._runner.executables.release(signature, branches)

    def run(self, feed: Mapping[str, np.ndarray], output_names: Sequence[str]) -> list[np.ndarray] | None:
        """The outputs of a decoding step served with the cache on the device, or None when this call is
        not such a step (it is then streamed, as every call was before)."""
        if self._refused is not None:
            return None
        if any(np.shape(feed[name])[axis] != 1 for name, axis in self._step_axes if name in feed):
            return None
        runner = self._runner
        table = runner.executables
        branches = {name: bool(np.asarray(feed[name]).reshape(-1)[0]) for name in table.branch_inputs}
        if not all(branches.values()):
            return None
        feed = {name: array for name, array in feed.items() if name not in branches}
        shapes, actual = runner.call_dims(feed)
        if shapes is not runner.input_shapes or any(actual.get(dim) != 1 for dim in self._step_dims):
            return None
        length, capacity = actual[self._past_dim], self.capacity
        if length + 1 > capacity:
            # the device state holds at most ``capacity`` positions: stream the last steps
            return self._streamed(f"a past of {length} positions fills the {capacity} the device holds")
        batch_dim = next((dim for dim in actual if is_batch_dim(dim)), None)
        if batch_dim is None or actual[batch_dim] not in runner.plan.sizes.get(batch_dim, ()):
            rows = "an unknown number of" if batch_dim is None else actual[batch_dim]
            return self._streamed(f"a batch of {rows} rows would be padded or split into steps")
        wanted = runner.compiled_sizes(actual, branches)
        wanted[self._past_dim] = capacity
        wanted[batch_dim] = actual[batch_dim]
        call = runner.decisions.decide(actual, wanted, feed, branches, shapes)
        if call.dims.get(self._past_dim) != capacity:  # compiled per length instead
            return self._streamed("padding the past is not proven invisible for these calls")
        targets = {dim: size for dim, size in call.dims.items() if not is_batch_dim(dim)}

        def padded(names: Sequence[str]) -> dict[str, np.ndarray]:
            """The inputs ``names`` of this call padded as a streamed step pads them."""
            return runner.padded({name: feed[name] for name in names}, shapes, targets, actual)

        past = self.request.past_inputs
        step_feed = padded([name for name in feed if name not in past])
        step_feed.update(runner.generated_masks(shapes, actual, targets))
        sizes = {**actual, **call.dims}
        signature = {name: _evaluated(shapes[name], sizes) for name in past}
        signature.update({name: tuple(array.shape) for name, array in step_feed.items()})
        signature[ROWS_INPUT] = (actual[batch_dim],)
        runner.check_limit(signature, branches)  # max_executables counts the decode executable too
        try:
            entry = table.entry_for(signature, branches)
        except CarriedStateRefused as exc:
            self._refused = str(exc)
            _logger.warning("%s", self.verdict)
            return None
        self._signatures[id(entry)] = (signature, dict(branches))
        plan = entry.carried
        assert plan is not None
        inexact = _inexact_mask(plan, feed)
        if inexact is not None:
            return self._streamed(inexact)
        with self._lock:
            self.served_steps += 1
            outputs = self._step(
                entry, plan, feed, step_feed, lambda: padded(list(past)), length, branches, signature
            )
        return [
            outputs[name]
            if name in outputs
            else to_host_dtype(
                np.asarray(cut_output(outputs["::device"][name], call.cuts.get(name, ())), order="C"),
                runner.output_dtypes[name],
            )
            for name in output_names
        ]

    # -- one step, under the lock -----------------------------------------------------------------

    def _step(
        self,
        entry: CompiledEntry,
        plan: CarriedStatePlan,
        feed: Mapping[str, np.ndarray],
        padded: Mapping[str, np.ndarray],
        padded_past: Callable[[], dict[str, np.ndarray]],
        length: int,
        branches: Mapping[str, bool],
        signature: Mapping[str, tuple[int, ...]],
    ) -> dict[str, Any]:
        """``padded``: the call's other inputs as a streamed step has them; ``padded_past``: its past so."""
        executable = entry.executable
        resident = self._resident.get(id(entry))
        rows = None
        if resident is not None and resident.epoch == executable.state_epoch and resident.length == length:
            rows = self._held_rows(plan, resident, feed)
        batch = signature[ROWS_INPUT][0]
        if rows is None:
            resident = self._upload(entry, plan, feed, {**padded, **padded_past()}, length)
            rows = np.arange(batch, dtype=np.int32)
        assert resident is not None
        device_dtypes = entry.device_input_dtypes
        step_feed: dict[str, np.ndarray] = {}
        for name, array in padded.items():
            if name in device_dtypes:
                step_feed[name] = array
        for spec in plan.states:
            if spec.kind == "appended":
                step_feed[spec.input] = self._new_position(spec, padded)
        step_feed[ROWS_INPUT] = rows
        if LENGTH_INPUT in device_dtypes:
            step_feed[LENGTH_INPUT] = np.array(length, dtype=np.int32)
        device_feed = {name: np.asarray(array)[None, None] for name, array in step_feed.items()}
        result = self._runner.executables.run_step(signature, branches, device_feed)
        if executable.state_epoch != resident.epoch:
            # The run itself reloaded the executable (an engine switch, a reset): the state it read may not
            # be the one uploaded. Upload and run again; a second loss is an error, never a guess.
            resident = self._upload(entry, plan, feed, {**padded, **padded_past()}, length)
            device_feed[ROWS_INPUT] = np.arange(batch, dtype=np.int32)[None, None]
            rows = device_feed[ROWS_INPUT][0, 0]
            result = self._runner.executables.run_step(signature, branches, device_feed)
            if executable.state_epoch != resident.epoch:
                raise DeviceError(
                    "the device lost the key/value cache of a decoding step twice in a row (the executable "
                    "was reloaded during both runs); run the session alone on its IPUs, or serve it with "
                    "provider_options={'kv_cache': 'host'}"
                )
        device_outputs = {name: array[0, 0] for name, array in result.items()}
        return self._advance(plan, resident, rows, device_outputs, feed, length)

    def _held_rows(
        self, plan: CarriedStatePlan, resident: _Resident, feed: Mapping[str, np.ndarray]
    ) -> np.ndarray | None:
        """For each row of the call's past, a row of the device state that equals it in every state
        tensor; None when some row is not held (then the past is uploaded). Rows that are equal in a tensor
        are interchangeable there (the beams of one input share its cross-attention cache)."""
        candidates: list[set[int]] | None = None
        for spec in plan.states:
            if spec.kind == "appended":
                if spec.input not in feed:
                    continue  # made by the runtime from the length, which the past's rows already check
                held = resident.masks[spec.input]
                sent = np.asarray(feed[spec.input])
                sent = sent[_positions(spec.axis, 0, held.shape[spec.axis], sent.ndim)]
                if sent.shape != held.shape:
                    return None
                digests = _row_digests(sent, spec.batch_axis)
                held_digests = _row_digests(held, spec.batch_axis)
            else:
                # Even the very views returned last step are hashed again: the caller may have written
                # into them since.
                digests = _row_digests(np.asarray(feed[spec.input]), spec.batch_axis)
                held_digests = resident.row_digests[spec.input]
            rows_of: dict[bytes, set[int]] = {}
            for row, digest in enumerate(held_digests):
                rows_of.setdefault(digest, set()).add(row)
            these = [rows_of.get(digest, set()) for digest in digests]
            candidates = (
                these if candidates is None else [a & b for a, b in zip(candidates, these, strict=True)]
            )
            if not all(candidates):
                return None
        if candidates is None:
            return None
        return np.array([min(rows) for rows in candidates], dtype=np.int32)

    def _upload(
        self,
        entry: CompiledEntry,
        plan: CarriedStatePlan,
        feed: Mapping[str, np.ndarray],
        padded: Mapping[str, np.ndarray],
        length: int,
    ) -> _Resident:
        """Upload the call's past, padded as a streamed step pads it, and make new mirrors of it."""
        executable = entry.executable
        state_dtypes = {spec.name: spec.dtype for spec in executable.state}
        values = {}
        mirrors, digests, masks = {}, {}, {}
        for spec in plan.states:
            if spec.kind == "appended":
                array = np.asarray(padded[spec.input])
                size = array.shape[spec.axis] - (1 if spec.spans_new else 0)
                value = array[_positions(spec.axis, 0, size, array.ndim)]
                if spec.input in feed:
                    sent = np.asarray(feed[spec.input])
                    masks[spec.input] = np.array(sent[_positions(spec.axis, 0, length, sent.ndim)])
            else:
                value = np.asarray(padded[spec.input])
                array = np.asarray(feed[spec.input])
                digests[spec.input] = _row_digests(array, spec.batch_axis)
                if spec.kind == "grows":
                    mirror = np.zeros(value.shape, dtype=self._runner.output_dtypes[spec.output])
                    mirror[_positions(spec.axis, 0, length, mirror.ndim)] = array
                    mirrors[spec.input] = mirror
            values[spec.state] = to_device_dtype(
                spec.state, np.ascontiguousarray(value), state_dtypes[spec.state]
            )
        self._runner.executables.write_state(entry, values)
        resident = _Resident(executable.state_epoch, length, mirrors, digests, masks=masks)
        self._resident[id(entry)] = resident
        return resident

    @staticmethod
    def _new_position(spec: StateSpec, padded: Mapping[str, np.ndarray]) -> np.ndarray:
        """The one position of an appended input the step sends: the mask's last column where it covers
        the new token, else 1 (the new token joins the past as a real position)."""
        array = np.asarray(padded[spec.input])
        if spec.spans_new:
            return np.ascontiguousarray(
                array[_positions(spec.axis, array.shape[spec.axis] - 1, None, array.ndim)]
            )
        shape = list(array.shape)
        shape[spec.axis] = 1
        return np.ones(shape, dtype=array.dtype)

    def _advance(
        self,
        plan: CarriedStatePlan,
        resident: _Resident,
        rows: np.ndarray,
        device_outputs: dict[str, np.ndarray],
        feed: Mapping[str, np.ndarray],
        length: int,
    ) -> dict[str, Any]:
        """Write the new positions into the mirrors (reordered first when the rows moved) and give the
        caller views of them."""
        moved = not np.array_equal(rows, np.arange(len(rows)))
        returned: dict[str, Any] = {"::device": device_outputs}
        for spec in plan.states:
            if spec.kind == "appended":
                if spec.input in feed:
                    sent = np.asarray(feed[spec.input])
                    resident.masks[spec.input] = np.array(
                        sent[_positions(spec.axis, 0, length + 1, sent.ndim)]
                    )
                continue
            digests = resident.row_digests[spec.input]
            if spec.kind == "constant":
                if moved:
                    resident.row_digests[spec.input] = [digests[row] for row in rows]
                continue
            mirror = resident.mirrors[spec.input]
            if moved:
                mirror = np.take(mirror, rows, axis=spec.batch_axis)
                resident.mirrors[spec.input] = mirror
            new = device_outputs[spec.output]
            mirror[_positions(spec.axis, length, length + 1, mirror.ndim)] = to_host_dtype(new, mirror.dtype)
            view = mirror[_positions(spec.axis, 0, length + 1, mirror.ndim)]
            resident.row_digests[spec.input] = _row_digests(view, spec.batch_axis)
            returned[spec.output] = view
        resident.length = length + 1
        return returned


def _inexact_mask(plan: CarriedStatePlan, feed: Mapping[str, np.ndarray]) -> str | None:
    """Why the call's masks cannot enter a state kept as float32 exactly (``StateSpec.exact_within``), or
    None when they can. Masks the runtime makes itself hold 0 and 1."""
    for spec in plan.states:
        if spec.exact_within is None or spec.input not in feed:
            continue
        values = np.asarray(feed[spec.input])
        if values.size and int(np.abs(values).max()) > spec.exact_within:
            return (
                f"input {spec.input!r} holds {int(np.abs(values).max())}, beyond the {spec.exact_within} "
                "up to which the device state keeps it exactly (as float32)"
            )
    return None


def _evaluated(shape: SymbolicShape, sizes: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(dim if isinstance(dim, int) else DimExpression.parse(dim).evaluate(sizes) for dim in shape)


def _batch_axis(shape: SymbolicShape) -> int | None:
    for axis, dim in enumerate(shape):
        if isinstance(dim, str) and is_batch_dim(dim):
            return axis
    return None
