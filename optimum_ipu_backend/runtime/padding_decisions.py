"""Which dimensions one call pads, decided by the padding proof, never by input or axis names.

For each call shape the runtime wants to pad (the caller's sizes up to compiled sizes), the padding
proof (``compiler.analysis.padding``) says whether every real output element stays what it would be
without padding, where those elements are, and what it assumed of the caller's data. A dimension whose
proof fails is compiled at the size it comes in from then on; the reason (the node that breaks the
proof) is kept as that dimension's verdict and reported by ``compiled_executables()`` and
``optimum-ipu check``. Proofs are cached in memory and, with the executable cache, on disk, keyed by the
graph's content, so a new process proves nothing twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from optimum_ipu_backend.runtime.padding import SymbolicShape, axis_maps, evaluate_shape
from optimum_ipu_backend.runtime.roles import CONTINUE, is_batch_dim

_logger = logging.getLogger(__name__)

PROOFS_DIR = "padding-proofs"
_FORMAT = 1

#: A dimension's verdict once it has been tried: padded (proven) or compiled exactly, with the reason.
PADDED = "padded (proven)"


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
    ) -> None:
        self._load_model = load_model
        self._inputs = _Inputs(
            dict(input_shapes), dict(fills), tuple(left_padded_dims), tuple(generated_masks)
        )
        self._store = store
        self._analyzer_instance: Any = None
        self._proofs: dict[tuple, Any] = {}
        self._verdicts: dict[str, str] = {}
        self._axes: dict[tuple, dict[str, int | None]] = {}
        self._lock = threading.Lock()
        if store is not None:
            self._verdicts.update(_read_json(store / "verdicts.json") or {})

    # -- what users see ----------------------------------------------------------------------------

    def verdicts(self) -> dict[str, str]:
        """Per dimension tried so far: ``"padded (proven)"`` or ``"exact sizes: <why>"``."""
        return dict(sorted(self._verdicts.items()))

    def is_exact(self, dim: str) -> bool:
        return self._verdicts.get(dim, PADDED) != PADDED

    # -- per call ------------------------------------------------------------------------------------

    def _batch_paddable(self, actual: Mapping[str, int]) -> bool:
        """A batch dimension already found exact is never filled up with repeated samples."""
        return not any(is_batch_dim(dim) and self.is_exact(dim) for dim in actual)

    def decide(
        self,
        actual: Mapping[str, int],
        wanted: Mapping[str, int],
        feed: Mapping[str, np.ndarray],
        branches: Mapping[str, bool],
    ) -> CallPadding:
        """The padding this call may use. ``wanted`` holds the compiled size per dimension (batch: the
        micro-batch) and ``actual`` the caller's sizes (batch: the real samples of the fullest
        micro-batch that has padding)."""
        wanted = {dim: size for dim, size in wanted.items() if not self.is_exact(dim)}
        padded = {dim for dim, size in wanted.items() if size != actual.get(dim, size)}
        batch_paddable = self._batch_paddable(actual)
        if not padded:
            return CallPadding({**actual, **wanted}, batch_paddable=batch_paddable)
        with self._lock:
            proof = self._proof(actual, wanted, branches)
            if not proof.exact:
                wanted = self._narrowed(actual, wanted, branches)
                proof = self._proof(actual, wanted, branches)
            if proof.exact and not proof.holds_for(feed):
                # The caller's masks could mask a whole row: run this call without padding positions.
                wanted = {dim: size for dim, size in wanted.items() if is_batch_dim(dim)}
                proof = self._proof(actual, wanted, branches)
            if not proof.exact:
                wanted = {}
                proof = None
            else:
                for dim in padded & set(wanted):
                    if wanted[dim] != actual.get(dim, wanted[dim]):
                        self._set_verdict(dim, PADDED)
            batch_axes = self._output_batch_axes(actual, branches) if any(map(is_batch_dim, wanted)) else {}
        dims = {**actual, **wanted}
        batch_paddable = self._batch_paddable(actual)  # again: the proof may have found the batch exact
        if proof is None:
            return CallPadding(dims, {}, batch_paddable)
        return CallPadding(
            dims, output_cuts(proof.output_maps, batch_axes), batch_paddable, proof.output_maps
        )

    def output_batch_axes(
        self, actual: Mapping[str, int], branches: Mapping[str, bool]
    ) -> dict[str, int | None]:
        """Which axis of each output carries the batch (None: none), found by dataflow."""
        with self._lock:
            return self._output_batch_axes(actual, branches)

    def output_axes(
        self, dim: str, actual: Mapping[str, int], branches: Mapping[str, bool]
    ) -> dict[str, int | None]:
        """Which axis of each output carries ``dim``, found by dataflow: the axes that a proof with ``dim``
        padded by one position finds padded. Empty when that padding cannot be proven."""
        with self._lock:
            return self._output_axes(dim, actual, {**actual, dim: actual[dim] + 1}, branches)

    # -- proofs ----------------------------------------------------------------------------------------

    def _narrowed(self, actual: Mapping[str, int], wanted: Mapping[str, int], branches) -> dict[str, int]:
        """The padded dimensions that can be padded on their own, each tried alone; the others get their
        verdict."""
        kept = {}
        for dim, size in wanted.items():
            if size == actual.get(dim, size):
                kept[dim] = size
                continue
            alone = {d: (s if d == dim else actual.get(d, s)) for d, s in wanted.items()}
            proof = self._proof(actual, alone, branches)
            if proof.exact:
                kept[dim] = size
                self._set_verdict(dim, PADDED)
            else:
                self._set_verdict(dim, f"exact sizes: {proof.problems[0]}")
                _logger.info("%s is compiled at the sizes it comes in: %s", dim, proof.problems[0])
        return kept

    def _output_batch_axes(self, actual: Mapping[str, int], branches) -> dict[str, int | None]:
        batch_dims = [dim for dim in actual if is_batch_dim(dim)]
        if not batch_dims:
            return {}
        one = {**actual, **dict.fromkeys(batch_dims, 1)}
        two = {**actual, **dict.fromkeys(batch_dims, 2)}
        found = self._output_axes(batch_dims[0], one, two, branches)
        for dim in batch_dims:
            if found:
                self._set_verdict(dim, PADDED)
        return found

    def _output_axes(self, dim: str, actual, padded, branches) -> dict[str, int | None]:
        key = (dim, _branch_key(branches))
        found = self._axes.get(key)
        if found is not None:
            return found
        proof = self._proof(actual, padded, branches)
        found = {}
        if proof.exact:
            for name, maps in proof.output_maps.items():
                axes = [axis for axis, axis_map in enumerate(maps) if axis_map is not None]
                found[name] = axes[0] if axes else None
        else:
            self._set_verdict(dim, f"exact sizes: {proof.problems[0]}")
        self._axes[key] = found
        return found

    def _proof(self, actual: Mapping[str, int], padded: Mapping[str, int], branches: Mapping[str, bool]):
        dims = {**actual, **padded}
        key = (_branch_key(branches), tuple(sorted(actual.items())), tuple(sorted(dims.items())))
        proof = self._proofs.get(key)
        if proof is None:
            proof = self._load(key)
        if proof is None:
            inputs = padded_inputs(
                self._inputs.shapes,
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

    def _set_verdict(self, dim: str, verdict: str) -> None:
        if self._verdicts.get(dim) == verdict or (verdict == PADDED and dim in self._verdicts):
            return
        self._verdicts[dim] = verdict
        if self._store is not None:
            _write_json(self._store / "verdicts.json", self._verdicts)

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
