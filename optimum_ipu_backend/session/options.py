"""Provider options of the ipu provider: parsed once, checked, and reported back as strings the way
onnxruntime reports provider options."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from optimum_ipu_backend.engines.probe import DEVICES, check_device_name, default_device

PRECISIONS = ("fp32", "fp16")
ENGINE_NAMES = ("emulator", "popart", "poptorch")

OPTION_HELP = {
    "device": f"one of {', '.join(DEVICES)}; default from OPTIMUM_IPU_DEVICE, else 'ipu'",
    "engine": f"one of {', '.join(ENGINE_NAMES)}; default: chosen from the device and the SDK found",
    "precision": f"one of {', '.join(PRECISIONS)}; default 'fp32'",
    "threads": "host threads the emulator may use (positive integer); default: onnxruntime's choice",
}


class ProviderOptionError(ValueError):
    """A provider option is unknown or has a bad value."""


@dataclass(frozen=True)
class IPUProviderOptions:
    device: str
    engine: str | None = None
    precision: str = "fp32"
    threads: int | None = None

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None) -> IPUProviderOptions:
        raw = dict(raw or {})
        unknown = sorted(set(raw) - set(OPTION_HELP))
        if unknown:
            known = "; ".join(f"{name}: {text}" for name, text in OPTION_HELP.items())
            raise ProviderOptionError(
                f"unknown IPUExecutionProvider option(s) {', '.join(map(repr, unknown))}. "
                f"Known options: {known}"
            )
        device = str(raw.get("device") or default_device())
        try:
            check_device_name(device)
        except ValueError as exc:
            raise ProviderOptionError(str(exc)) from None
        engine = raw.get("engine")
        if engine is not None and str(engine) not in ENGINE_NAMES:
            raise ProviderOptionError(f"option 'engine'={engine!r}: {OPTION_HELP['engine']}")
        precision = str(raw.get("precision", "fp32")).lower()
        if precision not in PRECISIONS:
            raise ProviderOptionError(f"option 'precision'={raw['precision']!r}: {OPTION_HELP['precision']}")
        threads = raw.get("threads")
        if threads is not None:
            try:
                threads = int(threads)
            except (TypeError, ValueError):
                threads = 0
            if threads <= 0:
                raise ProviderOptionError(f"option 'threads'={raw['threads']!r}: {OPTION_HELP['threads']}")
        return cls(
            device=device,
            engine=None if engine is None else str(engine),
            precision=precision,
            threads=threads,
        )
