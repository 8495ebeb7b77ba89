"""Provider options of the ipu provider: parsed once, checked, and reported back as strings the way
onnxruntime reports provider options.

The session's own options (device, engine, threads, progress) are read here; everything else is a
runtime setting (buckets, batching, cache, precision) read by ``runtime.ipu_config`` together with an
``ipu_config.json`` beside the model. An option neither knows is an error, never ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optimum_ipu_backend.engines import engine_names
from optimum_ipu_backend.engines.probe import (
    DEVICES,
    SDK_PYTHON_ENV,
    check_device_name,
    default_device,
    resolve_sdk_python,
)
from optimum_ipu_backend.errors import ConfigurationError
from optimum_ipu_backend.runtime.buckets import BucketOptionError
from optimum_ipu_backend.runtime.ipu_config import IPUConfigError, IPURuntimeConfig, load_runtime_config

COMPILE_MODES = ("lazy", "eager")

SESSION_OPTION_HELP = {
    "device": f"one of {', '.join(DEVICES)}; default from OPTIMUM_IPU_DEVICE, else 'ipu'",
    "engine": (
        f"one of {', '.join(engine_names())}; default: the available engine of highest priority "
        "for the device"
    ),
    "compile": (
        "'lazy' (compile each shape on its first call) or 'eager' (also compile the smallest shape while the "
        "session is created, so that a failure there lets providers listed after ipu take over); default lazy"
    ),
    "compile_timeout": "seconds one compile may take before it is stopped (positive number); "
    "default: no limit",
    "threads": "host threads the emulator may use (positive integer); default: onnxruntime's choice",
    "progress": (
        "1 or 0: progress bars for legalization and compilation; default: on when stderr is a terminal"
    ),
    "trim_padding": (
        "1 or 0: run the rows of an encoder call grouped by real length, skipping the padding they share; "
        "outputs at masked positions are then zeros; default 0"
    ),
    "sdk_python": (
        "path (or name on PATH) of the Python interpreter that runs the Poplar SDK for the popart and "
        "poptorch engines, such as the SDK's own Python with its PopTorch wheel; default from "
        f"{SDK_PYTHON_ENV}, else this interpreter"
    ),
}


class ProviderOptionError(ConfigurationError):
    """A provider option is unknown or has a bad value."""


def _flag(name: str, value: Any) -> bool:
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ProviderOptionError(f"option {name!r}={value!r}: {SESSION_OPTION_HELP[name]}")


@dataclass(frozen=True)
class IPUProviderOptions:
    device: str
    engine: str | None = None
    threads: int | None = None
    progress: bool | None = None
    trim_padding: bool = False
    compile: str = "lazy"
    compile_timeout: float | None = None
    # Compile for an offline IPU target (fills the cache; nothing runs). Set by `optimum-ipu compile`.
    offline: bool = False
    ipu_version: str | None = None  # the IPU architecture an offline compile targets
    # The interpreter the SDK's worker runs on (an absolute path); None: OPTIMUM_IPU_SDK_PYTHON, else this
    # one, resolved when an SDK engine starts. Not part of cache keys: the SDK version it reports is.
    sdk_python: str | None = None
    runtime: IPURuntimeConfig = field(default_factory=IPURuntimeConfig)

    @property
    def precision(self) -> str:
        return self.runtime.precision or "fp32"

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None, model_dir: str | Path | None = None) -> IPUProviderOptions:
        raw = dict(raw or {})
        device = str(raw.get("device") or default_device())
        try:
            check_device_name(device)
        except ValueError as exc:
            raise ProviderOptionError(str(exc)) from None
        engine = raw.get("engine")
        if engine is not None and str(engine) not in engine_names():
            raise ProviderOptionError(f"option 'engine'={engine!r}: {SESSION_OPTION_HELP['engine']}")
        compile_mode = str(raw.get("compile", "lazy")).strip().lower()
        if compile_mode not in COMPILE_MODES:
            raise ProviderOptionError(
                f"option 'compile'={raw['compile']!r}: {SESSION_OPTION_HELP['compile']}"
            )
        compile_timeout = raw.get("compile_timeout")
        if compile_timeout is not None:
            try:
                compile_timeout = float(compile_timeout)
            except (TypeError, ValueError):
                compile_timeout = 0.0
            if not compile_timeout > 0:
                raise ProviderOptionError(
                    f"option 'compile_timeout'={raw['compile_timeout']!r}: "
                    f"{SESSION_OPTION_HELP['compile_timeout']}"
                )
        threads = raw.get("threads")
        if threads is not None:
            try:
                threads = int(threads)
            except (TypeError, ValueError):
                threads = 0
            if threads <= 0:
                raise ProviderOptionError(
                    f"option 'threads'={raw['threads']!r}: {SESSION_OPTION_HELP['threads']}"
                )
        sdk_python = raw.get("sdk_python")
        if sdk_python is not None:
            try:
                sdk_python = resolve_sdk_python(sdk_python)
            except ConfigurationError as exc:
                raise ProviderOptionError(str(exc)) from None
        progress = None if raw.get("progress") is None else _flag("progress", raw["progress"])
        trim_padding = _flag("trim_padding", raw.get("trim_padding", "0"))
        try:
            runtime = load_runtime_config(model_dir, raw, other_options=SESSION_OPTION_HELP)
        except (IPUConfigError, BucketOptionError) as exc:
            raise ProviderOptionError(str(exc)) from exc
        layers = runtime.layers_per_ipu
        if layers is not None and len(layers) != runtime.ipus_per_replica and set(layers) != {-1}:
            raise ProviderOptionError(
                f"layers_per_ipu={list(layers)} ({runtime.sources.get('layers_per_ipu')}) has {len(layers)} "
                f"entries and ipus_per_replica={runtime.ipus_per_replica} "
                f"({runtime.sources.get('ipus_per_replica', 'the default')}); give one layer count per IPU "
                "(-1 shares the remaining layers), or [-1] to split the layers evenly"
            )
        return cls(
            device=device,
            engine=None if engine is None else str(engine),
            threads=threads,
            progress=progress,
            trim_padding=trim_padding,
            compile=compile_mode,
            compile_timeout=compile_timeout,
            sdk_python=sdk_python,
            runtime=runtime,
        )
