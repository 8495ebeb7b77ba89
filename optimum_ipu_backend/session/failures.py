"""Failures below the session, reported with the call they failed on.

A call whose feed passed validation can still fail further down: a shape the graph cannot be compiled
for (an image size the position embeddings do not fit, ...), or the engine's own library refusing
what it runs. The caller then gets one of the documented errors (``optimum_ipu_backend.errors``)
whose message names every input with its dtype and shape, chained to the original error; errors of
our own code that are not one of those pass through unchanged, so a bug is never disguised.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import numpy as np

from optimum_ipu_backend.compiler.errors import LegalizationError
from optimum_ipu_backend.errors import DeviceError, UnsupportedModelError

# Top-level modules of the libraries engines run on; an exception of theirs is the engine failing.
ENGINE_LIBRARIES = ("onnxruntime", "popart", "poptorch", "poplar")


class UnsupportedShapeError(UnsupportedModelError):
    """The graph cannot be compiled for the shapes of one call."""


class DeviceRunError(DeviceError):
    """The engine failed while compiling or running the executable of one call."""


def describe_feed(feed: Mapping[str, np.ndarray]) -> str:
    return ", ".join(f"input {name!r} {array.dtype}{list(array.shape)}" for name, array in feed.items())


def _from_engine_library(exc: BaseException) -> bool:
    return type(exc).__module__.split(".")[0] in ENGINE_LIBRARIES


@contextmanager
def failures_name_the_call(
    feed: Mapping[str, np.ndarray], engine: str, *, fixed_shapes: bool
) -> Iterator[None]:
    """Re-raise a compile failure or an engine library's error with the inputs of the call.

    A compile failure is about the call's shapes only where the model leaves a dimension to the call
    (not ``fixed_shapes``) and the failure may depend on sizes (``LegalizationError.about_shapes``: not a
    compiler bug, an opset, a custom domain, an operator or a type PopART lacks). Otherwise it reaches
    the caller as the compiler raised it, without advice about sizes."""
    try:
        yield
    except UnsupportedModelError as exc:
        about_shapes = not isinstance(exc, LegalizationError) or exc.about_shapes
        if isinstance(exc, LegalizationError) and (fixed_shapes or not about_shapes):
            exc.for_fixed_shapes()  # the same error, without advice about sizes that are not the cause
        if fixed_shapes or not about_shapes or isinstance(exc, UnsupportedShapeError):
            raise
        raise UnsupportedShapeError(
            f"the model cannot be compiled for the shapes of this call ({describe_feed(feed)}); "
            f"dimensions without compiled sizes are compiled at the size they come in, so check them "
            f"against what the model takes (for an image model, its processor's size):\n{exc}"
        ) from exc
    except Exception as exc:
        if not _from_engine_library(exc):
            raise
        raise DeviceRunError(
            f"the {engine!r} engine failed on this call ({describe_feed(feed)}): {type(exc).__name__}: {exc}"
        ) from exc
