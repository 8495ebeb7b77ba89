"""Differential fuzzing of feeds: the ipu provider (host emulator) against CPU onnxruntime.

Hypothesis generates feeds for an encoder (BERT sequence classification), a decoder with past (GPT-2)
and an image model (ViT) from tests/model_zoo.py: shapes (0, 1, the largest compiled size and one past
it), dtypes (every integer and float type, bool), values (extremes, NaN and inf, negative and
out-of-range ids), memory layouts (Fortran order, non-contiguous, read-only, zero-strided) and missing
or extra inputs. Each feed goes to an ipu session and to a CPU onnxruntime session of the same export.

The property, per feed:

* if the ipu session returns, CPU onnxruntime returns too, with the same shapes, dtypes and values
  (NaN and inf where CPU has them);
* otherwise the ipu session raised one of the documented errors (``optimum_ipu_backend.errors``) with an
  input named in its message, the feed had something a session may refuse (a dtype that does not cast
  safely, an index outside its table, an integer outside int32, an empty or too large dimension, a
  shape that disagrees with another input or the model, a missing or unknown input), and a device or
  model error (``DeviceError``, ``UnsupportedModelError``) only where CPU onnxruntime fails as well.

So a feed with valid values (NaN and inf in float inputs included) in any memory layout must give CPU's
answer. One exception, where only shapes and dtypes are compared: a finite float input beyond 1e30 (the
fuzzer puts float32's largest value in). float32 arithmetic overflows on it inside the model, and where
it does depends on the order of operations: onnxruntime's fused CPU kernels stay finite where the
legalized graph, which is what an IPU runs in float32, gives NaN or other values, and the emulator's
own graph fusions move it again (docs/user-guide.md, "Bad input and errors").

The ipu session is deliberately kinder in one way, which the reference follows: an input of a
dtype that casts safely to the graph's (int32 token ids, a bool mask) is cast, where onnxruntime
refuses it; the reference is CPU onnxruntime on the cast feed.

CI runs the ``fuzz-ci`` profile (fixed seed, bounded examples). A longer local search:
``OPTIMUM_IPU_FUZZ_PROFILE=fuzz-long python -m pytest tests/fuzz --hypothesis-show-statistics``.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, Phase, event, given, note, settings
from hypothesis import strategies as st

from optimum_ipu_backend.errors import DeviceError, IPUBackendError, UnsupportedModelError
from optimum_ipu_backend.runtime.dim_expressions import DimExpression
from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions
from optimum_ipu_backend.session import IPUInferenceSession

PROFILE_ENV = "OPTIMUM_IPU_FUZZ_PROFILE"
_COMMON = {
    "deadline": None,  # the first call of a shape compiles an executable
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
    # no "explain" phase: it reruns a failing example hundreds of times, minutes with compiles
    "phases": [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
}
settings.register_profile("fuzz-ci", max_examples=50, derandomize=True, database=None, **_COMMON)
settings.register_profile("fuzz-long", max_examples=1500, **_COMMON)
FUZZ_SETTINGS = settings.get_profile(os.environ.get(PROFILE_ENV, "fuzz-ci"))

DTYPES = tuple(
    np.dtype(name)
    for name in (
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "bool",
    )
)
RTOL, ATOL = 1e-4, 1e-4  # fp32 tiny models: padding and legalization change nothing beyond rounding
INT32 = np.iinfo(np.int32)
NEAR_OVERFLOW = 1e30


@dataclass(frozen=True)
class FuzzModel:
    zoo: tuple[str, str]
    options: dict[str, str]
    # dimension name -> (sizes a session must serve, sizes it may refuse)
    dims: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    # index inputs -> config key of the table size (the test's own source of truth, not the analysis)
    tables: dict[str, str] = field(default_factory=dict)


MODELS = {
    "encoder": FuzzModel(
        ("bert", "text-classification"),
        {"batch_size": "2", "sequence_lengths": "4,8"},
        {"batch_size": ((1, 2, 3), (0,)), "sequence_length": ((1, 3, 8), (0, 9))},
        {"input_ids": "vocab_size", "token_type_ids": "type_vocab_size"},
    ),
    "decoder-with-past": FuzzModel(
        ("gpt2", "text-generation-with-past"),
        {"batch_size": "2", "sequence_lengths": "4", "past_sequence_lengths": "4,8"},
        {
            "batch_size": ((1, 2, 3), (0,)),
            "sequence_length": ((1, 3, 4), (0, 5)),
            "past_sequence_length": ((0, 1, 8), (9,)),
        },
        {"input_ids": "vocab_size", "position_ids": "n_positions"},
    ),
    "image": FuzzModel(
        ("vit", "image-classification"),
        {"batch_size": "2"},
        {
            "batch_size": ((1, 2, 3), (0,)),
            "num_channels": ((3,), (1,)),
            "height": ((32,), (0, 16)),
            "width": ((32,), (0,)),
        },
    ),
}


@dataclass
class Harness:
    model: FuzzModel
    ipu: IPUInferenceSession
    cpu: ort.InferenceSession
    config: dict
    shapes: dict[str, list]  # symbolic input shapes
    dtypes: dict[str, np.dtype]


@pytest.fixture(scope="module")
def harnesses(tmp_path_factory, zoo):
    cache = tmp_path_factory.mktemp("fuzz-executables")
    built: dict[str, Harness] = {}

    def get(kind: str) -> Harness:
        if kind not in built:
            model = MODELS[kind]
            onnx_dir = zoo.onnx(*model.zoo)
            path = str(onnx_dir / "model.onnx")
            options = {"device": "emulator", "executable_cache_dir": str(cache), **model.options}
            ipu = IPUInferenceSession(path, options=IPUProviderOptions.parse(options, onnx_dir))
            quiet = ort.SessionOptions()
            quiet.log_severity_level = 4  # its refusals are expected; the test reads the exceptions
            cpu = ort.InferenceSession(path, sess_options=quiet, providers=["CPUExecutionProvider"])
            built[kind] = Harness(
                model,
                ipu,
                cpu,
                json.loads((Path(onnx_dir) / "config.json").read_text()),
                {arg.name: list(arg.shape) for arg in ipu.get_inputs()},
                {arg.name: np.dtype(cpu_dtype(arg.type)) for arg in ipu.get_inputs()},
            )
        return built[kind]

    return get


def cpu_dtype(type_name: str) -> str:
    name = re.fullmatch(r"tensor\((\w+)\)", type_name).group(1)
    return {"float": "float32", "double": "float64"}.get(name, name)


# ----------------------------------------------------------------------------------------------------
# Drawing a feed
# ----------------------------------------------------------------------------------------------------


@dataclass
class Drawn:
    feed: dict[str, np.ndarray]
    reference: dict[str, np.ndarray]  # what CPU onnxruntime gets
    refusable: list[str]  # why a session may refuse this feed (empty: it must be served)
    # a finite float so large that float32 arithmetic overflows on it (see the module docstring)
    near_overflow: bool = False


def _valid_values(
    harness: Harness, name: str, shape: tuple[int, ...], rng: np.random.Generator
) -> np.ndarray:
    dtype = harness.dtypes[name]
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    table = harness.model.tables.get(name)
    if table:
        return rng.integers(0, harness.config[table], size=shape).astype(dtype)
    return rng.integers(0, 2, size=shape).astype(dtype)  # masks: rows that hide everything included


def _cast(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    with warnings.catch_warnings(), np.errstate(invalid="ignore", over="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        return values.astype(dtype)


def _corrupt_values(data, harness: Harness, name: str, array: np.ndarray) -> np.ndarray:
    """One element set to an extreme, NaN/inf, a negative or an out-of-range value."""
    if array.size == 0:
        return array
    array = array.copy()
    position = tuple(data.draw(st.integers(0, size - 1)) for size in array.shape)
    if array.dtype == np.bool_:
        array[position] = not array[position]
        return array
    if np.issubdtype(array.dtype, np.floating):
        info = np.finfo(array.dtype)
        extremes = [np.nan, np.inf, -np.inf, info.max, info.min, 65504.0, -65504.0, 0.0]
        array[position] = data.draw(st.sampled_from(extremes))
        return array
    info = np.iinfo(array.dtype)
    table = harness.model.tables.get(name)
    candidates = [info.min, info.max, -1, -5, 10**6, 2**31, 2]
    if table:
        candidates += [harness.config[table], harness.config[table] - 1]
    value = data.draw(st.sampled_from([v for v in candidates if info.min <= v <= info.max] or [0]))
    array[position] = value
    return array


def _layout(data, array: np.ndarray) -> np.ndarray:
    kind = data.draw(st.sampled_from(["contiguous", "fortran", "strided", "read-only", "zero-stride"]))
    note(f"layout {kind}")
    if kind == "fortran":
        return np.asfortranarray(array)
    if kind == "strided":
        wide = np.repeat(array, 2, axis=-1) if array.ndim else array
        return wide[..., ::2] if array.ndim else wide
    if kind == "read-only":
        array = array.copy()
        array.flags.writeable = False
        return array
    if kind == "zero-stride" and array.ndim and array.shape[0] > 0:
        return np.broadcast_to(array[:1], array.shape)  # every row is the first: a zero stride on axis 0
    return array


def draw_feed(data, harness: Harness) -> Drawn:
    model = harness.model
    refusable: list[str] = []
    sizes = {}
    for dim, (served, refused) in model.dims.items():
        # served sizes are drawn three times as often as refusable ones
        sizes[dim] = data.draw(st.sampled_from(served * 3 + refused), label=dim)
        if sizes[dim] in refused:
            refusable.append(f"{dim}={sizes[dim]}")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="values seed"))
    feed: dict[str, np.ndarray] = {}
    for name, symbolic in harness.shapes.items():
        shape = tuple(
            dim if isinstance(dim, int) else DimExpression.parse(dim).evaluate(sizes) for dim in symbolic
        )
        feed[name] = _valid_values(harness, name, shape, rng)

    corruptions = data.draw(
        st.lists(
            st.sampled_from(["dtype", "value", "value", "layout", "layout", "missing", "extra", "mismatch"]),
            max_size=3,
        ),
        label="corruptions",
    )
    names = list(feed)
    for corruption in corruptions:
        name = data.draw(st.sampled_from(names), label=f"{corruption} of")
        if name not in feed:
            continue
        if corruption == "dtype":
            feed[name] = _cast(feed[name], data.draw(st.sampled_from(DTYPES), label="dtype"))
        elif corruption == "value":
            feed[name] = _corrupt_values(data, harness, name, feed[name])
        elif corruption == "layout":
            feed[name] = _layout(data, feed[name])
        elif corruption == "missing":
            del feed[name]
            refusable.append(f"{name} missing")
        elif corruption == "extra":
            feed["extra_input"] = np.zeros((1,), np.int64)
            refusable.append("extra input")
        elif corruption == "mismatch" and feed[name].ndim:
            axis = data.draw(st.integers(0, feed[name].ndim - 1))
            widths = [(0, int(i == axis)) for i in range(feed[name].ndim)]
            feed[name] = np.pad(feed[name], widths)  # one more element along ``axis``
            refusable.append(f"{name} axis {axis} + 1")

    reference = {}
    for name, array in feed.items():
        declared = harness.dtypes.get(name)
        if declared is None:
            reference[name] = array
            continue
        if array.dtype != declared:
            if np.can_cast(array.dtype, declared, casting="safe"):
                array = array.astype(declared)  # the one deliberate difference: safe casts are served
            else:
                refusable.append(f"{name} {feed[name].dtype}")
        reference[name] = array
        if np.issubdtype(array.dtype, np.integer) and array.size:
            low, high = int(array.min()), int(array.max())
            if low < INT32.min or high > INT32.max:
                refusable.append(f"{name} outside int32")
            table = harness.model.tables.get(name)
            if table and (low < 0 or high >= harness.config[table]):
                refusable.append(f"{name} outside its table")
    layout = {k: (v.dtype.name, v.shape, v.strides) for k, v in feed.items()}
    note(f"feed: {layout}; refusable: {refusable}")
    near_overflow = any(
        array.dtype.kind == "f"
        and bool((np.abs(array[np.isfinite(array)].astype(np.float64)) > NEAR_OVERFLOW).any())
        for array in feed.values()
    )
    return Drawn(feed, reference, refusable, near_overflow)


# ----------------------------------------------------------------------------------------------------
# The property
# ----------------------------------------------------------------------------------------------------


def _names_an_input(message: str, names) -> bool:
    return any(f"'{name}'" in message for name in names)


@pytest.mark.parametrize("kind", list(MODELS))
@FUZZ_SETTINGS
@given(data=st.data())
def test_ipu_answers_like_cpu_or_refuses_with_a_documented_error(harnesses, kind, data):
    harness = harnesses(kind)
    drawn = draw_feed(data, harness)
    try:
        expected, cpu_error = harness.cpu.run(None, drawn.reference), None
    except Exception as exc:  # onnxruntime's own error types
        expected, cpu_error = None, exc
    try:
        got, ipu_error = harness.ipu.run(None, drawn.feed), None
    except Exception as exc:
        got, ipu_error = None, exc

    if ipu_error is None:
        event(f"{kind}: served")
        assert cpu_error is None, f"ipu answered a feed CPU onnxruntime rejects: {cpu_error}"
        assert len(got) == len(expected)
        for ours, theirs in zip(got, expected, strict=True):
            assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
            if drawn.near_overflow:
                event(f"{kind}: a float near overflow, values not compared")
                continue
            np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL, equal_nan=True)
        return
    event(f"{kind}: refused with {type(ipu_error).__name__}")
    assert isinstance(ipu_error, IPUBackendError), f"undocumented {type(ipu_error).__name__}: {ipu_error}"
    assert _names_an_input(str(ipu_error), set(harness.shapes) | set(drawn.feed)), str(ipu_error)
    assert drawn.refusable, f"a feed with nothing wrong was refused: {ipu_error}"
    if isinstance(ipu_error, (DeviceError, UnsupportedModelError)):
        assert cpu_error is not None, f"a device or model error where CPU answers: {ipu_error}"
