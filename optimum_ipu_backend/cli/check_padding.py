"""`optimum-ipu check --verify-padding`: run a model padded and unpadded on the host emulator and compare.

The runtime pads a dimension only where the padding proof shows no real output can see padded positions
(``runtime.padding``). This check lets a user test that on their own graph, the way the test
suite tests the model matrix: one call at sizes between compiled sizes (so the runtime pads whatever the
proof allows), and the same call through a session compiled at exactly those sizes (nothing padded).
Real outputs must agree within ``atol``. Each dimension's verdict, the compiled shapes and what serving
changed in the graph (for example experts computed densely, and at what cost) are reported with it.

Inputs are made up from their roles (``runtime.roles``): token ids below the vocabulary size, masks of
ones, positions counting on from the past, random values for caches, pixels, audio and the rest.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from optimum_ipu_backend.cli.check_parser import DEFAULT_ATOL
from optimum_ipu_backend.cli.check_sizes import config_dims
from optimum_ipu_backend.runtime.buckets import option_name
from optimum_ipu_backend.runtime.dim_expressions import parse_dim
from optimum_ipu_backend.runtime.padding import evaluate_shape
from optimum_ipu_backend.runtime.roles import DimRole, InputRole, dim_role, input_role

#: Samples in the checked call: not a compiled batch size, so the batch is padded where it may be.
CALL_BATCH = 3
#: Length of the cache in a call of a decoder with past: padded to the next compiled past length.
CALL_PAST = 5


@dataclass
class PaddingCheck:
    """The result for one graph: whether padded and unpadded real outputs agree, and why padding was or
    was not used per dimension."""

    label: str
    call_dims: dict[str, int] = field(default_factory=dict)
    max_abs_diff: float | None = None
    atol: float = DEFAULT_ATOL
    verdicts: dict[str, str] = field(default_factory=dict)
    compiled_shapes: list[dict[str, list[int]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.max_abs_diff is not None and self.max_abs_diff <= self.atol

    def as_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "ok": self.ok,
            "call_dims": self.call_dims,
            "max_abs_diff": self.max_abs_diff,
            "atol": self.atol,
            "padding": self.verdicts,
            "compiled_shapes": self.compiled_shapes,
            "graph_notes": self.notes,
            "error": self.error,
        }

    def format(self) -> str:
        dims = ", ".join(f"{name}={size}" for name, size in self.call_dims.items())
        lines = [f"  padding check at {dims}:"]
        for dim, verdict in self.verdicts.items():
            lines.append(f"    {dim}: {verdict}")
        for shapes in self.compiled_shapes:
            lines.append(
                "    compiled: " + ", ".join(f"{k}={'x'.join(map(str, v))}" for k, v in shapes.items())
            )
        lines.extend(f"    note: {note}" for note in self.notes)
        if self.error is not None:
            lines.append(f"    FAILED: {self.error}")
        else:
            verdict = "equal" if self.ok else "DIFFERENT"
            lines.append(
                f"    padded vs unpadded real outputs: {verdict} (max abs diff {self.max_abs_diff:.3g}, "
                f"atol {self.atol:g})"
            )
        return "\n".join(lines)


def _symbolic_inputs(model: onnx.ModelProto) -> dict[str, tuple[list[int | str], int]]:
    initializers = {init.name for init in model.graph.initializer}
    inputs = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor_type = value.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in tensor_type.shape.dim]
        inputs[value.name] = (shape, tensor_type.elem_type)
    return inputs


def call_dims(
    inputs: Mapping[str, tuple[list[int | str], int]],
    plan_sizes: Mapping[str, list[int]],
    config: Mapping[str, Any],
) -> dict[str, int]:
    """A size per dimension between compiled sizes, so that the runtime pads it where the proof allows."""
    fixed = config_dims(config)
    dims: dict[str, int] = {}
    for shape, _ in inputs.values():
        for dim in shape:
            parsed = parse_dim(dim) if isinstance(dim, str) else None
            for name in sorted(parsed.symbols) if parsed is not None else []:
                if name in dims:
                    continue
                role = dim_role(name)
                sizes = plan_sizes.get(name)
                if role is DimRole.BATCH:
                    dims[name] = CALL_BATCH
                elif role is DimRole.PAST:
                    dims[name] = CALL_PAST
                elif name in fixed:
                    dims[name] = fixed[name]
                elif sizes and len(sizes) > 1:
                    # one past the second smallest compiled size: padded up to the next one
                    dims[name] = sizes[1] + 1 if len(sizes) > 2 else sizes[0] + 1
                elif sizes:
                    dims[name] = max(1, sizes[0] - 1)
                else:
                    dims[name] = 1 if name == "1" else 4
    # a one-token step beside a past, as generation runs it
    if any(dim_role(name) is DimRole.PAST for name in dims):
        for name in dims:
            if dim_role(name) is DimRole.SEQUENCE and f"past_{name}" in dims:
                dims[name] = 1
    return dims


def make_feed(
    inputs: Mapping[str, tuple[list[int | str], int]],
    dims: Mapping[str, int],
    config: Mapping[str, Any],
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Inputs for one call at ``dims``, each made up from its role."""
    rng = np.random.default_rng(seed)
    vocab = int(config.get("vocab_size") or 100)
    past = next((size for name, size in dims.items() if dim_role(name) is DimRole.PAST), 0)
    feed = {}
    for name, (shape, elem_type) in inputs.items():
        concrete = evaluate_shape(tuple(shape), dims)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
        role = input_role(name)
        if role is InputRole.TOKEN_IDS:
            value = rng.integers(1, max(2, vocab), concrete)
        elif role is InputRole.ATTENTION_MASK:
            value = np.ones(concrete)
        elif role is InputRole.TOKEN_TYPES:
            value = np.zeros(concrete)
        elif role is InputRole.POSITIONS:
            value = np.broadcast_to(past + np.arange(concrete[-1]), concrete) if concrete else np.array(past)
        elif role is InputRole.CACHE_BRANCH:
            value = np.array(past > 0)
        elif np.issubdtype(dtype, np.floating):
            value = rng.standard_normal(concrete)
        else:
            value = np.zeros(concrete)
        feed[name] = np.ascontiguousarray(value, dtype=dtype)
    return feed


def verify_padding(
    path: Path, config: Mapping[str, Any], label: str, atol: float = DEFAULT_ATOL, seed: int = 0
) -> PaddingCheck:
    """Run ``path`` once padded and once at exact sizes on the emulator, and compare real outputs."""
    from optimum_ipu_backend.session import IPUInferenceSession, IPUProviderOptions

    def session(options: dict[str, Any]) -> IPUInferenceSession:
        return IPUInferenceSession(str(path), options=IPUProviderOptions.parse(options, path.parent))

    result = PaddingCheck(label, atol=atol)
    inputs = _symbolic_inputs(onnx.load(path, load_external_data=False))
    with tempfile.TemporaryDirectory(prefix="optimum-ipu-verify-padding-") as scratch:
        options = {"device": "emulator", "executable_cache_dir": scratch}
        try:
            padded_session = session(options)
            dims = call_dims(inputs, padded_session.bucket_sizes(), config)
            result.call_dims = dims
            feed = make_feed(inputs, dims, config, seed)
            padded = padded_session.run(None, feed)
            result.verdicts = padded_session.padding_verdicts()
            result.compiled_shapes = [entry["shapes"] for entry in padded_session.compiled_executables()]
            result.notes = padded_session.graph_notes()
            padded_session.close()
            exact_sizes = {
                option_name(name): [size]
                for name, size in dims.items()
                if name in padded_session.bucket_sizes()
            }
            exact_session = session({**options, **exact_sizes})
            exact = exact_session.run(None, feed)
            exact_session.close()
        except Exception as error:  # reported per graph; the command's status says it failed
            result.error = f"{type(error).__name__}: {error}"
            return result
    shapes = [(a.shape, b.shape) for a, b in zip(padded, exact, strict=True)]
    if any(a != b for a, b in shapes):
        result.error = f"padded and unpadded outputs differ in shape: {shapes}"
        return result
    result.max_abs_diff = max(
        (_max_abs_diff(a, b) for a, b in zip(padded, exact, strict=True)),
        default=0.0,
    )
    return result


def _max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    if a.dtype == np.bool_ or np.issubdtype(a.dtype, np.integer):
        return float(np.count_nonzero(a != b))  # any differing integer or boolean is a failure
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0))
