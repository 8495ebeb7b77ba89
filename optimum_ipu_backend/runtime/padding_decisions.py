"""Which dimensions one call pads, decided by the padding proof, never by input or axis names.

For each call shape the runtime wants to pad (the caller's sizes up to compiled sizes), the padding
proof (``compiler.analysis.padding``) says whether every real output element stays what it would be
without padding, where those elements are, and what it assumed of the caller's data.

Same call, same outcome. Whether a call is served or refused, and what it returns, is a function of the
graph, the session's options and the call alone, never of what earlier calls or the cache stored:

* A dimension's *verdict* (padded, or compiled at exact sizes and why) is the proof of padding that
  dimension alone at fixed canonical sizes (``BucketPlan.canonical_sizes``: its two smallest compiled
  sizes, every other planned dimension at its smallest, unplanned ones at the call's size). A call pads
  only dimensions whose verdict is padded, and only as far as the proof at its own sizes allows; a
  dimension past its plan is refused (``InputTooLargeError`` naming the option) when its verdict is
  padded and served at its exact size otherwise. The batch is filled up with repeated samples only when
  its verdict is padded and the call's own proof keeps it, and outputs are merged along the batch axes
  its canonical proof finds.
* Proofs are cached in memory and, with the executable cache, on disk, keyed by the graph's content
  and the exact sizes they were made at; a stored proof is the proof that would be made again, so the
  cache only saves time. Verdicts are a report (``compiled_executables()``, ``optimum-ipu check``, the
  message of ``ExecutableLimitError``); no stored verdict is read back.

When every symbolic input dimension has compiled sizes, the verdicts are found when the session is
created, and each dimension compiled at exact sizes is reported once at WARNING with the node that
forces it and what it costs on an IPU; otherwise at the first call that needs the verdict.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from optimum_ipu_backend.runtime.dim_expressions import parse_dim
from optimum_ipu_backend.runtime.padding import SymbolicShape, axis_maps, evaluate_shape, inputs_for_dims
from optimum_ipu_backend.runtime.roles import CONTINUE, InputRole, input_role, is_batch_dim

_logger = logging.getLogger(__name__)

PROOFS_DIR = "padding-proofs"
_FORMAT = 2  # 2: comparisons with constants and reverse CumSum in the proof

#: A dimension's verdict once it has been tried: padded (proven) or compiled exactly, with the reason.
PADDED = "padded (proven)"
#: The prefix of every verdict of a dimension compiled at the size it comes in.
EXACT_PREFIX = "exact sizes: "


@dataclass(frozen=True)
class CallPadding:
    """How one call runs: the size every dimension is run at, and how to cut the outputs back."""

    dims: dict[str, int]
    #: Per output, the (axis, indices) that keep its real elements, batch axes excluded.
    cuts: dict[str, tuple[tuple[int, np.ndarray | slice], ...]] = field(default_factory=dict)
    #: Whether the batch may be filled up by repeating samples.
    batch_paddable: bool = True
    #: Per output and axis, where each real element is (every axis, the batch included); see the proof.
    output_maps: dict[str, tuple[np.ndarray | None, ...]] = field(default_factory=dict)


@dataclass
class _Inputs:
    """What the runtime feeds, as the proof needs it described."""

    shapes: dict[str, SymbolicShape]
    fills: dict[str, Any]
    left_padded_dims: tuple[str, ...]
    generated_masks: tuple[tuple[str, str], ...]


def _symbols(shapes: Mapping[str, SymbolicShape]) -> set[str]:
    found: set[str] = set()
    for shape in shapes.values():
        for dim in shape:
            parsed = parse_dim(dim)
            if parsed is not None:
                found |= parsed.symbols
    return found


class PaddingDecisions:
    """Proofs and verdicts for one served graph."""

    def __init__(
        self,
        load_model: Callable[[], Any],
        input_shapes: Mapping[str, SymbolicShape],
        fills: Mapping[str, Any],
        *,
        left_padded_dims: Sequence[str] = (),
        generated_masks: Sequence[tuple[str, str]] = (),
        store: Path | None = None,
        canonical_sizes: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        """``canonical_sizes``: per planned dimension, the (real, padded) sizes its verdict is proven at
        (``BucketPlan.canonical_sizes``); a dimension without them is never padded. None (tools that
        prove single calls): no verdicts, each call's own proof decides, and the batch's axes are proven
        at the call's sizes."""
        self._load_model = load_model
        self._inputs = _Inputs(
            dict(input_shapes), dict(fills), tuple(left_padded_dims), tuple(generated_masks)
        )
        self._store = store
        self._per_call = canonical_sizes is None
        self._canonical = dict(canonical_sizes or {})
        self._symbols = _symbols(self._inputs.shapes)
        self._carriers = inputs_for_dims(self._inputs.shapes)
        self._analyzer_instance: Any = None
        self._proofs: dict[tuple, Any] = {}
        self._verdicts: dict[str, str] = {}
        self._warned: set[str] = set()
        self._lock = threading.RLock()

    # -- what users see ----------------------------------------------------------------------------

    def verdicts(self) -> dict[str, str]:
        """Per dimension tried so far: ``"padded (proven)"`` or ``"exact sizes: <why>"``."""
        return dict(sorted(self._verdicts.items()))

    def is_exact(
        self, dim: str, actual: Mapping[str, int] | None = None, branches: Mapping[str, bool] | None = None
    ) -> bool:
        """Whether ``dim`` is compiled at the sizes it comes in (its verdict, see the module docstring).
        ``actual`` gives the sizes of dimensions without compiled sizes, when the graph has any."""
        return self.verdict(dim, actual or {}, branches or {}) != PADDED

    def verdict(self, dim: str, actual: Mapping[str, int], branches: Mapping[str, bool]) -> str:
        """``dim``'s verdict: the proof of padding it alone at its canonical sizes (cached by key)."""
        if self._per_call:
            return PADDED  # no verdicts: the call's own proof decides
        if dim not in self._canonical:
            return f"{EXACT_PREFIX}it has no compiled sizes"
        point = self._canonical_point(dim, actual)
        if point is None:  # an unplanned dimension's size is unknown: not padded, and nothing to report
            return f"{EXACT_PREFIX}the sizes of its proof are unknown"
        with self._lock:
            proof = self._proof(*point, branches)
        verdict = PADDED if proof.exact else f"{EXACT_PREFIX}{proof.problems[0]}"
        self._record(dim, verdict)
        return verdict

    def settle(self, branches: Mapping[str, bool] | None = None, dims: Iterable[str] | None = None) -> bool:
        """Find the verdicts of ``dims`` (every planned dimension by default) now, when every symbolic
        input dimension has canonical sizes; False (and nothing proven) otherwise."""
        if not self._symbols <= self._canonical.keys():
            return False
        for dim in self._canonical if dims is None else dims:
            if dim in self._symbols:
                self.verdict(dim, {}, branches or {})
        return True

    def _canonical_point(self, dim: str, actual: Mapping[str, int]) -> tuple[dict, dict] | None:
        """The (real, padded) sizes of ``dim``'s verdict: ``dim`` (every batch dimension with a batch)
        padded over its canonical sizes, the other planned dimensions at their smallest canonical size,
        the unplanned ones at the call's size."""
        real: dict[str, int] = {}
        for symbol in sorted(self._symbols):
            if symbol in self._canonical:
                real[symbol] = self._canonical[symbol][0]
            elif symbol in actual:
                real[symbol] = int(actual[symbol])
            else:
                return None
        moved = [d for d in real if is_batch_dim(d) and d in self._canonical] if is_batch_dim(dim) else [dim]
        padded = {**real, **{d: self._canonical[d][1] for d in moved}}
        return real, padded

    def _record(self, dim: str, verdict: str) -> None:
        if self._verdicts.get(dim, PADDED) != PADDED:
            return  # a verdict of exact (under any branch) is what the report keeps
        self._verdicts[dim] = verdict
        if verdict != PADDED and dim not in self._warned:
            self._warned.add(dim)
            _logger.warning(self._exact_warning(dim, verdict.removeprefix(EXACT_PREFIX)))

    def _exact_warning(self, dim: str, why: str) -> str:
        carrier = self._carriers.get(dim)
        where = f"{dim!r}"
        if carrier is not None:
            axis = next(
                a
                for a, d in enumerate(self._inputs.shapes[carrier])
                if (parsed := parse_dim(d)) is not None and parsed.is_single_name and parsed.symbols == {dim}
            )
            where = f"input {carrier!r} axis {axis} ({dim})"
        if is_batch_dim(dim):
            advice = "Call with a few fixed numbers of samples (split or group calls yourself)"
            unit = "number of samples"
        else:
            audio = carrier is not None and input_role(carrier) is InputRole.AUDIO
            advice = "Cut or pad the inputs to a few fixed lengths yourself" + (
                ", as the transformers ASR pipeline's chunk_length_s does for audio" if audio else ""
            )
            unit = "length"
        return (
            f"{where} is compiled at the exact size each call brings, because {why}. On an IPU every "
            f"distinct {unit} compiles its own executable, which takes minutes, so calls of many different "
            f"sizes keep compiling. {advice}, and cap how many executables a session compiles with "
            "provider_options={'max_executables': N}."
        )

    # -- per call ------------------------------------------------------------------------------------

    def decide(
        self,
        actual: Mapping[str, int],
        wanted: Mapping[str, int],
        feed: Mapping[str, np.ndarray],
        branches: Mapping[str, bool],
        shapes: Mapping[str, SymbolicShape] | None = None,
    ) -> CallPadding:
        """The padding this call may use. ``wanted`` holds the compiled size per dimension (batch: the
        micro-batch) and ``actual`` the caller's sizes (batch: the real samples of the fullest
        micro-batch that has padding). ``shapes``: the inputs' shapes for this call when they differ
        from the graph's (labels that disagree in the feed, separated by ``padding.separate_labels``)."""
        with self._lock:
            exact = {dim for dim in wanted if self.is_exact(dim, actual, branches)}
            batch_ok = not any(is_batch_dim(dim) for dim in exact)
            wanted = {dim: size for dim, size in wanted.items() if dim not in exact}
            padded = {dim for dim, size in wanted.items() if size != actual.get(dim, size)}
            if not padded:
                return CallPadding({**actual, **wanted}, batch_paddable=batch_ok)
            proof = self._proof(actual, wanted, branches, shapes)
            if not proof.exact:
                wanted = self._narrowed(actual, wanted, branches, shapes)
                proof = self._proof(actual, wanted, branches, shapes)
            if proof.exact and not proof.holds_for(feed):
                # The caller's masks could mask a whole row: run this call without padding positions.
                wanted = {dim: size for dim, size in wanted.items() if is_batch_dim(dim)}
                proof = self._proof(actual, wanted, branches, shapes)
            if not proof.exact:
                wanted = {}
                proof = None
            batch_axes = self._output_batch_axes(actual, branches) if any(map(is_batch_dim, wanted)) else {}
        dims = {**actual, **wanted}
        # a batch this call needed filled up but whose padding its proof did not keep runs unfilled
        batch_paddable = batch_ok and all(dim in wanted for dim in padded if is_batch_dim(dim))
        if proof is None:
            return CallPadding(dims, {}, batch_paddable)
        return CallPadding(
            dims, output_cuts(proof.output_maps, batch_axes), batch_paddable, proof.output_maps
        )

    def output_batch_axes(
        self, actual: Mapping[str, int], branches: Mapping[str, bool]
    ) -> dict[str, int | None]:
        """Which axis of each output carries the batch (None: none), found by dataflow: by the batch's
        canonical proof."""
        with self._lock:
            return self._output_batch_axes(actual, branches)

    def output_axes(
        self, dim: str, actual: Mapping[str, int], branches: Mapping[str, bool]
    ) -> dict[str, int | None]:
        """Which axis of each output carries ``dim``, found by dataflow: the axes that a proof with ``dim``
        padded by one position at the call's sizes finds padded. Empty when that padding cannot be
        proven."""
        with self._lock:
            return _padded_axes(self._proof(actual, {**actual, dim: actual[dim] + 1}, branches))

    # -- proofs ----------------------------------------------------------------------------------------

    def _narrowed(
        self,
        actual: Mapping[str, int],
        wanted: Mapping[str, int],
        branches: Mapping[str, bool],
        shapes: Mapping[str, SymbolicShape] | None,
    ) -> dict[str, int]:
        """The padded dimensions that this call can pad on their own, each tried alone at its sizes."""
        kept = {}
        for dim, size in wanted.items():
            if size == actual.get(dim, size):
                kept[dim] = size
                continue
            alone = {d: (s if d == dim else actual.get(d, s)) for d, s in wanted.items()}
            proof = self._proof(actual, alone, branches, shapes)
            if proof.exact:
                kept[dim] = size
            else:
                _logger.info("%s runs at the size it comes in for this call: %s", dim, proof.problems[0])
                if self._per_call:  # the only verdicts there are: what single calls found (a report)
                    self._verdicts.setdefault(dim, f"{EXACT_PREFIX}{proof.problems[0]}")
        return kept

    def _output_batch_axes(
        self, actual: Mapping[str, int], branches: Mapping[str, bool]
    ) -> dict[str, int | None]:
        if self._per_call:
            batch_dims = [dim for dim in actual if is_batch_dim(dim)]
            one = {**actual, **dict.fromkeys(batch_dims, 1)}
            two = {**actual, **dict.fromkeys(batch_dims, 2)}
            return _padded_axes(self._proof(one, two, branches)) if batch_dims else {}
        batch_dims = sorted(dim for dim in self._canonical if is_batch_dim(dim) and dim in self._symbols)
        if not batch_dims:
            return {}
        point = self._canonical_point(batch_dims[0], actual)
        if point is None:
            return {}
        return _padded_axes(self._proof(*point, branches))

    def _proof(
        self,
        actual: Mapping[str, int],
        padded: Mapping[str, int],
        branches: Mapping[str, bool],
        shapes: Mapping[str, SymbolicShape] | None = None,
    ):
        dims = {**actual, **padded}
        key: tuple = (_branch_key(branches), tuple(sorted(actual.items())), tuple(sorted(dims.items())))
        if shapes is not None and dict(shapes) != self._inputs.shapes:
            key += (tuple(sorted((name, tuple(map(str, shape))) for name, shape in shapes.items())),)
        proof = self._proofs.get(key)
        if proof is None:
            proof = self._load(key)
        if proof is None:
            inputs = padded_inputs(
                self._inputs.shapes if shapes is None else shapes,
                self._inputs.fills,
                actual,
                dims,
                left_padded_dims=self._inputs.left_padded_dims,
                generated_masks=self._inputs.generated_masks,
                branches=branches,
            )
            proof = self._analyzer().prove(inputs)
            self._save(key, proof)
        self._proofs[key] = proof
        return proof

    def _analyzer(self):
        if self._analyzer_instance is None:
            from optimum_ipu_backend.compiler.analysis.padding import PaddingAnalyzer

            # Branch inputs are fed as constants, so one analyzer serves every branch.
            self._analyzer_instance = PaddingAnalyzer(self._load_model())
        return self._analyzer_instance

    # -- the store ---------------------------------------------------------------------------------

    def _file(self, key: tuple) -> Path | None:
        if self._store is None:
            return None
        return self._store / f"{hashlib.sha256(repr(key).encode()).hexdigest()[:32]}.json"

    def _load(self, key: tuple):
        path = self._file(key)
        if path is None:
            return None
        stored = _read_json(path)
        if stored is None:
            return None
        from optimum_ipu_backend.compiler.analysis.padding import Obligation, PaddingProof

        try:
            return PaddingProof(
                bool(stored["exact"]),
                tuple(stored["problems"]),
                {
                    name: tuple(None if m is None else np.asarray(m, dtype=np.int64) for m in maps)
                    for name, maps in stored["output_maps"].items()
                },
                tuple(
                    Obligation(o["input"], _array(o["ones"], bool), _array(o["zeros"], bool))
                    for o in stored["obligations"]
                ),
                tuple(stored["binary_inputs"]),
            )
        except (KeyError, TypeError, ValueError):
            return None

    def _save(self, key: tuple, proof) -> None:
        path = self._file(key)
        if path is None:
            return
        _write_json(
            path,
            {
                "exact": proof.exact,
                "problems": list(proof.problems),
                "output_maps": {
                    name: [None if m is None else m.tolist() for m in maps]
                    for name, maps in proof.output_maps.items()
                },
                "obligations": [
                    {
                        "input": o.input,
                        "ones": _listed(o.unmasked_if_one),
                        "zeros": _listed(o.unmasked_if_zero),
                    }
                    for o in proof.obligations
                ],
                "binary_inputs": list(proof.binary_inputs),
            },
        )


def padded_inputs(
    input_shapes: Mapping[str, SymbolicShape],
    fills: Mapping[str, Any],
    actual: Mapping[str, int],
    padded: Mapping[str, int],
    *,
    left_padded_dims: Sequence[str] = (),
    generated_masks: Sequence[tuple[str, str]] = (),
    branches: Mapping[str, bool] | None = None,
) -> dict[str, Any]:
    """Every graph input of a call padded from ``actual`` to ``padded`` sizes, described the way
    ``pad_feed`` pads it, for ``PaddingAnalyzer.prove``."""
    from optimum_ipu_backend.compiler.analysis.padding import PaddedInput

    dims = {**actual, **padded}
    generated = dict(generated_masks)
    inputs = {}
    for name, shape in input_shapes.items():
        real_shape = evaluate_shape(shape, actual)
        padded_shape = evaluate_shape(shape, dims)
        maps = axis_maps(shape, actual, dims, left_padded_dims)
        repeated = tuple(a for a, d in enumerate(shape) if isinstance(d, str) and is_batch_dim(d))
        fill = fills.get(name, 0)
        values = None
        if name in generated:  # ones over the real past, made by the runtime itself
            padded_values = np.zeros(padded_shape, np.int64)
            index = [
                np.arange(s) if m is None else np.nonzero(m >= 0)[0]
                for m, s in zip(maps, padded_shape, strict=True)
            ]
            padded_values[np.ix_(*index)] = 1
            values = (padded_values, np.ones(real_shape, np.int64))
        inputs[name] = PaddedInput(
            padded_shape, real_shape, maps, None if fill == CONTINUE else fill, repeated, values
        )
    for name, value in (branches or {}).items():
        constant = np.array(bool(value))
        inputs[name] = PaddedInput((), (), (), 0, (), (constant, constant))
    return inputs


def output_cuts(
    output_maps: Mapping[str, Sequence[np.ndarray | None]],
    skip_axes: Mapping[str, int | None] | None = None,
) -> dict[str, tuple[tuple[int, np.ndarray | slice], ...]]:
    """Per output, the (axis, indices) that keep the real elements the proof located (``skip_axes``: an
    axis per output left alone, the batch when device steps already dropped padded samples)."""
    from optimum_ipu_backend.compiler.analysis.padding import inverse

    skip_axes = skip_axes or {}
    cuts = {}
    for name, maps in output_maps.items():
        steps = []
        for axis, axis_map in enumerate(maps):
            if axis_map is None or axis == skip_axes.get(name):
                continue
            index = inverse(axis_map, int((axis_map >= 0).sum()))
            if len(index) and np.array_equal(index, np.arange(index[0], index[0] + len(index))):
                steps.append((axis, slice(int(index[0]), int(index[0]) + len(index))))
            else:
                steps.append((axis, index))
        cuts[name] = tuple(steps)
    return cuts


def cut_output(array: np.ndarray, steps: Sequence[tuple[int, np.ndarray | slice]]) -> np.ndarray:
    """An output with only its real elements (views where the real elements are contiguous)."""
    for axis, index in steps:
        if isinstance(index, slice):
            selector: list[Any] = [slice(None)] * array.ndim
            selector[axis] = index
            array = array[tuple(selector)]
        else:
            array = np.take(array, index, axis=axis)
    return array


def _padded_axes(proof) -> dict[str, int | None]:
    """Per output, the first axis a proof found padded (None: none); empty when the proof failed."""
    if not proof.exact:
        return {}
    found: dict[str, int | None] = {}
    for name, maps in proof.output_maps.items():
        axes = [axis for axis, axis_map in enumerate(maps) if axis_map is not None]
        found[name] = axes[0] if axes else None
    return found


def _branch_key(branches: Mapping[str, bool]) -> tuple:
    return tuple(sorted((name, bool(value)) for name, value in branches.items()))


def _listed(array: np.ndarray) -> dict[str, Any]:
    return {"shape": list(array.shape), "values": array.reshape(-1).astype(int).tolist()}


def _array(stored: Mapping[str, Any], dtype) -> np.ndarray:
    return np.asarray(stored["values"], dtype=dtype).reshape(stored["shape"])


def _read_json(path: Path) -> Any:
    """A stored, self-checked JSON body, or None if it is missing, unreadable or corrupt."""
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        body = stored["body"]
        if stored.get("format") != _FORMAT:
            return None
        if hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest() != stored["sha256"]:
            raise ValueError("hash mismatch")
        return body
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        _logger.warning("ignoring the corrupt padding proof %s (%s); proving again", path, exc)
        return None


def _write_json(path: Path, body: Any) -> None:
    """Atomic: a reader sees the old file, no file, or the whole new one; failures cost only time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(
            {
                "format": _FORMAT,
                "body": body,
                "sha256": hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest(),
            }
        )
        temporary = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
    except OSError as exc:
        _logger.info("could not store the padding proof %s: %s", path, exc)
