"""``ORTModel.to(device)`` for models on a provider plugin, and for devices onnxruntime has no provider for.

optimum-onnx's ``ORTSessionMixin.to`` maps a torch device to an onnxruntime provider (``cuda`` to CUDA or
ROCm, every other device type to the CPU), returns at once when that device equals the model's, and
otherwise calls ``session.set_providers``. A plugin session reports the host (``cpu``) as its device, since
its inputs and outputs live in host memory, so ``to("cpu")`` on an ipu model returned it unchanged, still
on ipu, in silence; and a device such as ``"ipu"`` or ``"mps"`` became a CPU session that reports that
device. Here (the patches in ``patches.py`` route ``ORTSessionMixin.to`` and ``ORTParentMixin.to``):

* a plugin model moved to ``cpu`` or ``cuda`` gets a new onnxruntime session of that provider on the same
  model file, with the same session options, as ``from_pretrained(path, provider=...)`` would create it;
  the plugin session is released with its last reference;
* any other device type is refused for every model (``UnsupportedDeviceMoveError``), naming ``provider=``:
  onnxruntime's providers are chosen when a model is loaded, not by a torch device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from optimum_ipu_backend.errors import ConfigurationError

#: The torch device types ``to()`` moves a model between, each to the provider optimum-onnx maps it to.
MOVABLE_DEVICE_TYPES = ("cpu", "cuda")

_logger = logging.getLogger(__name__)


class UnsupportedDeviceMoveError(ConfigurationError):
    """``model.to(device)`` with a device no onnxruntime provider is moved to; the message names
    ``provider=``."""


def _device_and_dtype(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The device and dtype of a ``to()`` call, read as optimum-onnx's ``ORTSessionMixin.to`` reads them."""
    import torch

    device = dtype = None
    for arg in args:
        if isinstance(arg, (str, torch.device)):
            device = arg
        elif isinstance(arg, int):
            device = torch.device(arg)
        elif isinstance(arg, torch.dtype):
            dtype = arg
    return kwargs.get("device", device), kwargs.get("dtype", dtype)


def move_session(
    model: Any, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``ORTSessionMixin.to``: moves a plugin model to a new onnxruntime session, refuses devices without a
    provider, and leaves every other call to optimum-onnx's ``original``."""
    from optimum.onnxruntime.utils import (
        get_provider_for_device,
        parse_device,
        validate_provider_availability,
    )

    device, dtype = _device_and_dtype(args, kwargs)
    if device is None or dtype is not None:  # optimum-onnx changes nothing for these; neither do we
        return original(model, *args, **kwargs)
    device, provider_options = parse_device(device)
    session = model.session
    plugin = getattr(session, "is_provider_plugin_session", False)
    if device.type not in MOVABLE_DEVICE_TYPES:
        current = session.get_providers()[0]
        raise UnsupportedDeviceMoveError(
            f"{type(model).__name__}.to({str(device)!r}): onnxruntime models move only to the devices "
            f"{', '.join(repr(t) for t in MOVABLE_DEVICE_TYPES)} (CPUExecutionProvider and "
            f"CUDAExecutionProvider); this model runs on {current}. A provider is chosen when the model is "
            "loaded: "
            f"load it again with from_pretrained(path, provider=...)"
            + (', for example provider="ipu"' if device.type == "ipu" else "")
        )
    if not plugin:
        return original(model, *args, **kwargs)
    provider = get_provider_for_device(device)
    validate_provider_availability(provider)
    import onnxruntime

    moved = onnxruntime.InferenceSession(
        session._model_path,
        sess_options=session.get_session_options(),
        providers=[provider],
        provider_options=[provider_options],
    )
    model.initialize_ort_attributes(moved, model.use_io_binding)
    if getattr(model, "model", None) is session:  # ORTModel keeps its session as ``model`` too
        model.model = moved
    _logger.info("moved %s from %s to %s", type(model).__name__, session.get_providers()[0], provider)
    return model


def move_parts(
    model: Any, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``ORTParentMixin.to``: optimum-onnx moves each part; a model whose ``model`` is one of its parts'
    sessions (a seq2seq model's encoder session) then points at that part's new session."""
    held = getattr(model, "model", None)
    owner = next((part for part in model.parts if part.session is held), None)
    result = original(model, *args, **kwargs)
    if owner is not None and owner.session is not held:
        model.model = owner.session
    return result
