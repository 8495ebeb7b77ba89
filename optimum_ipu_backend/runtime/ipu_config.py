"""The configuration of a session, parsed once: provider options, ``ipu_config.json`` and the environment.

``IPUProviderOptions`` is the one frozen configuration a session is opened with (``runtime.open``): the
session's own options (device, engine, threads, compile mode, ...) and ``IPURuntimeConfig``, the settings
``ipu_config.json`` (beside the model) may also give. An option neither knows is an error, never ignored.

Field names are this package's own (``device_iterations``, ``replication_factor``, ``sequence_lengths``,
...). Graphcore users can bring the ``ipu_config.json`` they used with optimum-graphcore: its fields that
mean the same thing here are accepted under their Graphcore names:

=====================================  ===========================================================
optimum-graphcore IPUConfig field      here
=====================================  ===========================================================
``inference_device_iterations``        ``device_iterations`` (wins over ``device_iterations``)
``device_iterations``                  ``device_iterations`` (when no ``inference_`` twin is given)
``inference_replication_factor``       ``replication_factor`` (wins over ``replication_factor``)
``replication_factor``                 ``replication_factor`` (when no ``inference_`` twin is given)
``inference_ipus_per_replica``         ``ipus_per_replica`` (wins over ``ipus_per_replica``)
``ipus_per_replica``                   ``ipus_per_replica`` (default: the length of ``layers_per_ipu``)
``inference_layers_per_ipu``           ``layers_per_ipu`` (wins over ``layers_per_ipu``)
``layers_per_ipu``                     ``layers_per_ipu``: encoder/decoder layers per IPU, ``-1``
                                       entries share the rest (``compiler.passes.shard_over_ipus``)
``executable_cache_dir``               ``executable_cache_dir``; ``""`` or ``"disabled"`` turns the
                                       cache off, as in optimum-graphcore
=====================================  ===========================================================

Only inference runs here, so the ``inference_*`` value is the one that applies when a file has both.
Values given per pod type (``{"default": 4, "pod16": 8}``, older optimum-graphcore files) use their
``"default"``. Graphcore fields with no meaning here (training, pipelining and memory-planning settings
such as ``gradient_accumulation_steps``, ``matmul_proportion``) are listed in one
``IgnoredIPUConfigFieldsWarning``; any other unknown field is an ``IPUConfigError`` naming the field
and the file. Provider options (same names as the fields, values usually strings) override the file.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from optimum_ipu_backend.config import (
    flag_or_none,
    non_negative_float_or_none,
    positive_float_or_none,
    positive_int_or_none,
)
from optimum_ipu_backend.engines import engine_names
from optimum_ipu_backend.engines.base import DistributedReplicas
from optimum_ipu_backend.engines.popdist import read_popdist
from optimum_ipu_backend.engines.probe import DEVICE_KINDS, SDK_PYTHON_ENV, default_device, resolve_sdk_python
from optimum_ipu_backend.errors import ConfigurationError
from optimum_ipu_backend.runtime.buckets import DEFAULT_SIZES_PER_DIMENSION, BucketOptionError, parse_sizes
from optimum_ipu_backend.runtime.cost_model import OPTION_FIELDS, CostModel, CostOptionError
from optimum_ipu_backend.runtime.executable_cache import parse_byte_size
from optimum_ipu_backend.runtime.progress import progress_enabled

_logger = logging.getLogger(__name__)

IPU_CONFIG_NAME = "ipu_config.json"
# Provider option naming an ipu_config.json to read instead of the one beside the model.
CONFIG_PATH_OPTION = "ipu_config"
PRECISIONS = ("fp32", "fp16")
CACHE_DISABLED_VALUES = ("", "disabled")

# Bucket size fields: field name == provider option name == BucketPlan option name.
SIZE_FIELDS = (
    "batch_size",
    "sequence_lengths",
    "past_sequence_lengths",
    "encoder_sequence_lengths",
    "decoder_sequence_lengths",
    "past_decoder_sequence_lengths",
)
_INT_FIELDS = (
    "device_iterations",
    "replication_factor",
    "ipus_per_replica",
    "max_executables",
    "sizes_per_dimension",
)
# IPU counts: the Poplar SDK's device manager has devices of 1, 2, 4, 8, ... IPUs only, and PopART's
# replicated graphs need the device's IPUs to equal replicas x IPUs per replica. Both must therefore be
# powers of two, on every device, so that a configuration means the same thing on the emulator as on IPUs.
_POWER_OF_TWO_FIELDS = ("replication_factor", "ipus_per_replica")

# Graphcore names -> our field; when both are in one file the inference_* name wins.
_GRAPHCORE_ALIASES = {
    "inference_device_iterations": "device_iterations",
    "inference_replication_factor": "replication_factor",
    "inference_ipus_per_replica": "ipus_per_replica",
    "inference_layers_per_ipu": "layers_per_ipu",
}

# optimum-graphcore IPUConfig fields (current and earlier releases) that have no meaning for this runtime.
GRAPHCORE_IGNORED_FIELDS = frozenset(
    {
        "gradient_accumulation_steps",
        "optimizer_state_offchip",
        "replicated_tensor_sharding",
        "matmul_proportion",
        "inference_matmul_proportion",
        "enable_half_partials",
        "embedding_serialization_factor",
        "inference_embedding_serialization_factor",
        "serialized_embedding_splits_per_ipu",
        "inference_serialized_embedding_splits_per_ipu",
        "projection_serialization_factor",
        "inference_projection_serialization_factor",
        "serialized_projection_splits_per_ipu",
        "inference_serialized_projection_splits_per_ipu",
        "recompute_checkpoint_every_layer",
        "output_mode",
        "seed",
        "auto_loss_scaling",
        "explicit_ir_inference",
        "parallelize_kwargs",
        "inference_parallelize_kwargs",
        "sharded_execution_for_inference",
        "enable_half_first_order_momentum",
        "execute_encoder_on_cpu_for_generation",
        "use_popdist",
        "synthetic_data",
        "profile_dir",
    }
)
# Written by optimum's BaseConfig into every saved file; they describe the file, not a setting.
_METADATA_FIELDS = frozenset({"optimum_version", "transformers_version"})


class IPUConfigError(ConfigurationError):
    """An ``ipu_config.json`` or provider option is unknown or has a bad value."""


class IgnoredIPUConfigFieldsWarning(UserWarning):
    """An ``ipu_config.json`` holds optimum-graphcore fields that this runtime does not use."""


@dataclass(frozen=True)
class IPURuntimeConfig:
    """Everything the static-shape runtime takes from the user.

    Bucket sizes are None when not set (``BucketPlan.for_dims`` then chooses); ``batch_size`` is the
    tuple of compiled batch sizes (micro-batches). ``executable_cache_dir`` None means the default location
    (``OPTIMUM_IPU_CACHE`` or the platform cache directory); ``cache_enabled`` False turns the cache off.
    ``precision`` None leaves the session's default. ``cache_size_limit`` is in bytes (None: the cache's
    default cap). ``sources`` tells, per field that was set, where its value came from; ``ignored_fields``
    lists the Graphcore fields that were reported and not used.
    """

    batch_size: tuple[int, ...] | None = None
    sequence_lengths: tuple[int, ...] | None = None
    past_sequence_lengths: tuple[int, ...] | None = None
    encoder_sequence_lengths: tuple[int, ...] | None = None
    decoder_sequence_lengths: tuple[int, ...] | None = None
    past_decoder_sequence_lengths: tuple[int, ...] | None = None
    #: Default sizes per sequence dimension.
    sizes_per_dimension: int = DEFAULT_SIZES_PER_DIMENSION
    #: How many executables a session may compile in all; None: no cap.
    max_executables: int | None = None
    device_iterations: int = 1
    replication_factor: int = 1
    ipus_per_replica: int = 1
    #: Layers per IPU of a model sharded over ``ipus_per_replica`` IPUs (optimum-graphcore's field, ``-1``
    #: entries share the remaining layers); None: balanced by the memory estimate.
    layers_per_ipu: tuple[int, ...] | None = None
    executable_cache_dir: str | None = None
    cache_enabled: bool = True
    precision: str | None = None
    cache_size_limit: int | None = None
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    ignored_fields: tuple[str, ...] = ()

    def bucket_options(self) -> dict[str, tuple[int, ...]]:
        """The bucket sizes that were set, keyed by option name, for ``BucketPlan.for_dims``."""
        return {name: value for name in SIZE_FIELDS if (value := getattr(self, name)) is not None}

    def samples_per_step(self, micro_batch: int) -> int:
        """Samples one device step consumes with this micro-batch."""
        return micro_batch * self.device_iterations * self.replication_factor

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly settings (without ``sources``)."""
        values = {item.name: getattr(self, item.name) for item in fields(self) if item.name != "sources"}
        return {name: list(value) if isinstance(value, tuple) else value for name, value in values.items()}


# Every name a provider option or a file may use for a field.
RUNTIME_OPTION_NAMES = frozenset(
    {item.name for item in fields(IPURuntimeConfig) if item.name not in ("sources", "ignored_fields")}
    | set(_GRAPHCORE_ALIASES)
)


def load_runtime_config(
    model_dir: str | Path | None = None,
    provider_options: Mapping[str, Any] | None = None,
    *,
    config_path: str | Path | None = None,
    other_options: Iterable[str] = (),
) -> IPURuntimeConfig:
    """Read ``ipu_config.json`` and apply ``provider_options`` over it.

    The file is ``config_path`` if given, else the provider option ``ipu_config`` (a path), else
    ``<model_dir>/ipu_config.json`` when it exists; no file means defaults. Provider options may use every
    field name (and the ``inference_*`` aliases); names in ``other_options`` belong to someone else (the
    session's ``device``, ``engine``, ...) and are skipped; any other option raises ``IPUConfigError``.
    """
    options = dict(provider_options or {})
    other = set(other_options)
    path: Path | None = None
    if config_path is not None:
        path = Path(config_path)
    elif options.get(CONFIG_PATH_OPTION):
        path = Path(str(options[CONFIG_PATH_OPTION]))
    elif model_dir is not None and (Path(model_dir) / IPU_CONFIG_NAME).is_file():
        path = Path(model_dir) / IPU_CONFIG_NAME

    config = IPURuntimeConfig()
    if path is not None:
        config = _apply_file(config, path)

    given = {
        name: value for name, value in options.items() if name != CONFIG_PATH_OPTION and name not in other
    }
    unknown = sorted(set(given) - RUNTIME_OPTION_NAMES)
    if unknown:
        known = ", ".join(sorted(RUNTIME_OPTION_NAMES | {CONFIG_PATH_OPTION} | other))
        raise IPUConfigError(
            f"unknown IPUExecutionProvider option(s) {', '.join(map(repr, unknown))}; known options: {known}"
        )
    values = _by_field(given)
    sources = {target: f"provider option {name!r}" for target, (name, _) in values.items()}
    updates = {target: _convert(target, value, sources[target]) for target, (_, value) in values.items()}
    return _sharding_defaults(_with_updates(config, updates, sources))


def _by_field(given: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """Each field's (name it was given under, value); an ``inference_*`` alias wins over the plain name."""
    values: dict[str, tuple[str, Any]] = {}
    for name, value in given.items():
        target = _GRAPHCORE_ALIASES.get(name, name)
        if target not in values or name in _GRAPHCORE_ALIASES:
            values[target] = (name, value)
    return values


def _sharding_defaults(config: IPURuntimeConfig) -> IPURuntimeConfig:
    """optimum-graphcore's rule: without ``ipus_per_replica``, a model takes ``len(layers_per_ipu)`` IPUs."""
    if config.layers_per_ipu is None or "ipus_per_replica" in config.sources:
        return config
    check_ipu_count(
        f"{config.sources['layers_per_ipu']} (its length, the IPUs per replica without ipus_per_replica)",
        len(config.layers_per_ipu),
        " entries",
    )
    return replace(
        config,
        ipus_per_replica=len(config.layers_per_ipu),
        sources={**config.sources, "ipus_per_replica": f"the length of {config.sources['layers_per_ipu']}"},
    )


def _apply_file(config: IPURuntimeConfig, path: Path) -> IPURuntimeConfig:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise IPUConfigError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IPUConfigError(f"{path} is not a readable JSON file: {exc}") from None
    if not isinstance(data, dict):
        raise IPUConfigError(f"{path} must hold a JSON object of settings, not {type(data).__name__}")

    unknown = sorted(
        name
        for name in data
        if name not in RUNTIME_OPTION_NAMES
        and name not in GRAPHCORE_IGNORED_FIELDS
        and name not in _METADATA_FIELDS
    )
    if unknown:
        raise IPUConfigError(
            f"unknown field(s) {', '.join(map(repr, unknown))} in {path}; fields this runtime uses: "
            f"{', '.join(sorted(RUNTIME_OPTION_NAMES))} (optimum-graphcore training and pipelining fields "
            "are accepted and ignored with a warning)"
        )
    ignored = tuple(sorted(name for name in data if name in GRAPHCORE_IGNORED_FIELDS))
    if ignored:
        warnings.warn(
            f"{path}: these optimum-graphcore fields have no effect on ipu inference and are ignored: "
            f"{', '.join(ignored)}",
            IgnoredIPUConfigFieldsWarning,
            stacklevel=3,
        )

    values = _by_field({name: value for name, value in data.items() if name in RUNTIME_OPTION_NAMES})
    updates = {
        target: _convert(target, _pod_default(name, value, path), f"field {name!r} in {path}")
        for target, (name, value) in values.items()
    }
    sources = {target: f"{path}: {name}" for target, (name, _) in values.items()}
    return replace(_with_updates(config, updates, sources), ignored_fields=ignored)


def _pod_default(name: str, value: Any, path: Path) -> Any:
    """Older optimum-graphcore files give some values per pod type; without a pod type, use "default"."""
    if (
        isinstance(value, dict)
        and value
        and set(value) <= {"default", "pod4", "pod16", "pod64", "pod128", "pod256"}
    ):
        if "default" not in value:
            raise IPUConfigError(
                f"field {name!r} in {path} gives values per pod type {sorted(value)} but no 'default'; "
                "add a 'default' value or a plain value"
            )
        return value["default"]
    return value


def _with_updates(
    config: IPURuntimeConfig, updates: Mapping[str, Any], sources: Mapping[str, str]
) -> IPURuntimeConfig:
    updates = dict(updates)
    if "executable_cache_dir" in updates:
        # "" / "disabled" turns the cache off; a directory turns it on unless cache_enabled says otherwise.
        if updates["executable_cache_dir"] is None:
            updates["cache_enabled"] = False
        else:
            updates.setdefault("cache_enabled", True)
    return replace(config, **updates, sources={**config.sources, **sources})


def _convert(target: str, value: Any, where: str) -> Any:
    if target in SIZE_FIELDS:
        try:
            return parse_sizes(target, value)
        except BucketOptionError as exc:
            raise IPUConfigError(f"{where}: {exc}") from None
    if target in _INT_FIELDS:
        number = positive_int_or_none(value)
        if number is None:
            raise IPUConfigError(f"{where} must be a positive integer, got {value!r}")
        if target in _POWER_OF_TWO_FIELDS:
            check_ipu_count(where, number)
        return number
    if target == "executable_cache_dir":
        if value is None or (isinstance(value, str) and value.strip().lower() in CACHE_DISABLED_VALUES):
            return None
        if not isinstance(value, str):
            raise IPUConfigError(f"{where} must be a directory path, '' or 'disabled', got {value!r}")
        return value
    if target == "layers_per_ipu":
        return _layers_per_ipu(value, where)
    if target == "cache_enabled":
        flag = flag_or_none(value)
        if flag is None:
            raise IPUConfigError(f"{where} must be true or false, got {value!r}")
        return flag
    if target == "precision":
        text = str(value).strip().lower()
        if text not in PRECISIONS:
            raise IPUConfigError(f"{where} must be one of {', '.join(PRECISIONS)}, got {value!r}")
        return text
    if target == "cache_size_limit":
        if value is None:
            return None
        try:
            return parse_byte_size(value)
        except ValueError as exc:
            raise IPUConfigError(f"{where}: {exc}") from None
    raise AssertionError(f"no conversion for {target}")


def check_ipu_count(where: str, number: int, unit: str = "") -> None:
    if number & (number - 1):
        below = 1 << (number.bit_length() - 1)
        raise IPUConfigError(
            f"{where} must be a power of two (1, 2, 4, 8, ...), got {number}{unit}: the Poplar SDK acquires "
            f"IPUs in groups of a power of two; use {below} or {below * 2}{unit}"
        )


def _layers_per_ipu(value: Any, where: str) -> tuple[int, ...]:
    """A list of layer counts (``-1``: share the rest), from JSON or ``"2,-1"``."""
    items = value.split(",") if isinstance(value, str) else value
    counts: list[int] = []
    if isinstance(items, list | tuple) and items:
        for item in items:
            try:
                number = int(str(item).strip()) if not isinstance(item, bool) else None
            except ValueError:
                number = None
            if number is None or number < -1:
                break
            counts.append(number)
        else:
            return tuple(counts)
    raise IPUConfigError(
        f"{where} must be a list of layer counts per IPU (integers >= 0, or -1 to share the remaining "
        f"layers), for example [2, -1] or '2,-1'; got {value!r}"
    )


COMPILE_MODES = ("lazy", "eager")
#: How long a call waits in the dynamic batcher for others by default: a few device steps of a small
#: encoder, short beside the latency of a request that crosses a network. The batcher runs a group as
#: soon as every caller it knows of is queued, so the delay binds only where callers are missing: at a
#: burst's start, where 16 client threads reach the queue over 2 to 5 ms on a 2-core host
#: (docs/performance.md, issue 37), and its end.
DEFAULT_MAX_QUEUE_DELAY_MS = 5.0
KV_CACHE_PLACES = ("device", "host")
SERVING_PLANS = ("buckets", "cost")
DEFAULT_COMPILE_WORKERS = 2

SESSION_OPTION_HELP = {
    "device": f"one of {', '.join(DEVICE_KINDS)}; default from OPTIMUM_IPU_DEVICE, else 'ipu'",
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
    "dynamic_batching": (
        "1 or 0: gather run() calls from several threads into one device step (packed rows where the "
        "packing proof holds, else calls of one shape batched together); default 0"
    ),
    "max_queue_delay_ms": (
        "milliseconds a call may wait in the dynamic batcher for others to join its device step "
        "(number >= 0); default 2"
    ),
    "packing": (
        "1 or 0: with dynamic_batching, pack several sequences into each row where the packing proof holds "
        "(outputs at masked positions are then zeros); default 1"
    ),
    "kv_cache": (
        "'device' (a decoder's key/value cache stays on the device between generation steps; only the new "
        "positions cross the link) or 'host' (the whole cache is sent and returned every step); default "
        "device"
    ),
    "serving_plan": (
        "'buckets' (every call at the smallest bucket that holds it, an executable per bucket) or 'cost' "
        "(few executables chosen from the traffic by the IPU cost model, compiled in the background and kept "
        "resident on the session's IPU groups; docs/performance.md, 'IPU cost model'); default buckets"
    ),
    "ipu_groups": (
        "IPU groups (of replication_factor x ipus_per_replica IPUs) the session holds, so the executables "
        "it keeps resident (positive integer); default: with serving_plan='cost' 1, otherwise one per "
        "executable while free IPUs remain"
    ),
    "compile_workers": (
        "host threads that compile planned executables in the background with serving_plan='cost' "
        "(positive integer); default 2"
    ),
    "cost_measured": (
        "1 or 0: with serving_plan='cost', replace the compile and load estimates by the times this session "
        "measured on an IPU (device 'ipu'); default 1"
    ),
    **{
        option: f"the cost model's {name.replace('_', ' ')} (positive number; docs/performance.md)"
        for option, name in OPTION_FIELDS.items()
    },
    "sdk_python": (
        "path (or name on PATH) of the Python interpreter that runs the Poplar SDK for the popart and "
        "poptorch engines, such as the SDK's own Python with its PopTorch wheel; default from "
        f"{SDK_PYTHON_ENV}, else this interpreter"
    ),
}


class ProviderOptionError(ConfigurationError):
    """A provider option is unknown or has a bad value."""


@dataclass(frozen=True)
class IPUProviderOptions:
    """The configuration a session is opened with; ``parse`` reads it, ``runtime.open`` resolves it."""

    device: str
    engine: str | None = None
    threads: int | None = None
    progress: bool = False  # OPTIMUM_IPU_PROGRESS and the terminal decide when the option is not given
    trim_padding: bool = False
    compile: str = "lazy"
    compile_timeout: float | None = None
    kv_cache: str = "device"
    dynamic_batching: bool = False
    max_queue_delay_ms: float = DEFAULT_MAX_QUEUE_DELAY_MS
    packing: bool = True
    # Compile for an offline IPU target (fills the cache; nothing runs). Set by `optimum-ipu compile`.
    offline: bool = False
    ipu_version: str | None = None  # the IPU architecture an offline compile targets
    # The interpreter the SDK's worker runs on (an absolute path); None: OPTIMUM_IPU_SDK_PYTHON, else this
    # one, resolved when an SDK engine starts. Not part of cache keys: the SDK version it reports is.
    sdk_python: str | None = None
    # The runtime settings, with this instance's share of the replicas when PopRun started the process.
    runtime: IPURuntimeConfig = field(default_factory=IPURuntimeConfig)
    distributed: DistributedReplicas | None = None  # that share, for the engine (PopDist's environment)
    serving_plan: str = "buckets"
    ipu_groups: int | None = None
    compile_workers: int = DEFAULT_COMPILE_WORKERS
    cost_measured: bool = True
    cost_model: CostModel = field(default_factory=CostModel)

    @property
    def precision(self) -> str:
        return self.runtime.precision or "fp32"

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None, model_dir: str | Path | None = None) -> IPUProviderOptions:
        raw = dict(raw or {})
        try:
            device = DEVICE_KINDS[str(raw.get("device") or default_device())].name
        except ValueError as exc:
            raise ProviderOptionError(str(exc)) from None
        engine = None if raw.get("engine") is None else str(raw["engine"])
        if engine is not None and engine not in engine_names():
            raise ProviderOptionError(f"option 'engine'={raw['engine']!r}: {SESSION_OPTION_HELP['engine']}")
        compile_mode = str(raw.get("compile", "lazy")).strip().lower()
        if compile_mode not in COMPILE_MODES:
            raise ProviderOptionError(
                f"option 'compile'={raw['compile']!r}: {SESSION_OPTION_HELP['compile']}"
            )
        compile_timeout = _optional(raw, "compile_timeout", positive_float_or_none)
        threads = _optional(raw, "threads", positive_int_or_none)
        try:
            sdk_python = None if raw.get("sdk_python") is None else resolve_sdk_python(raw["sdk_python"])
        except ConfigurationError as exc:
            raise ProviderOptionError(str(exc)) from None
        progress = progress_enabled(_optional(raw, "progress", flag_or_none))
        trim_padding = bool(_optional(raw, "trim_padding", flag_or_none))
        dynamic_batching = bool(_optional(raw, "dynamic_batching", flag_or_none))
        delay = _optional(raw, "max_queue_delay_ms", non_negative_float_or_none)
        packing = _optional(raw, "packing", flag_or_none)
        kv_cache = str(raw.get("kv_cache", "device")).strip().lower()
        if kv_cache not in KV_CACHE_PLACES:
            raise ProviderOptionError(
                f"option 'kv_cache'={raw['kv_cache']!r}: {SESSION_OPTION_HELP['kv_cache']}"
            )
        serving_plan = str(raw.get("serving_plan", "buckets")).strip().lower()
        if serving_plan not in SERVING_PLANS:
            raise ProviderOptionError(
                f"option 'serving_plan'={raw['serving_plan']!r}: {SESSION_OPTION_HELP['serving_plan']}"
            )
        ipu_groups = _optional(raw, "ipu_groups", positive_int_or_none)
        compile_workers = _optional(raw, "compile_workers", positive_int_or_none)
        cost_measured = _optional(raw, "cost_measured", flag_or_none)
        try:
            cost_model = CostModel.from_options(raw)
        except CostOptionError as exc:
            raise ProviderOptionError(str(exc)) from None
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
        runtime, distributed = _popdist_share(runtime)
        return cls(
            device,
            engine,
            threads,
            progress,
            trim_padding,
            compile_mode,
            compile_timeout,
            kv_cache=kv_cache,
            dynamic_batching=dynamic_batching,
            max_queue_delay_ms=DEFAULT_MAX_QUEUE_DELAY_MS if delay is None else delay,
            packing=True if packing is None else packing,
            sdk_python=sdk_python,
            runtime=runtime,
            distributed=distributed,
            serving_plan=serving_plan,
            ipu_groups=ipu_groups if ipu_groups is not None else (1 if serving_plan == "cost" else None),
            compile_workers=compile_workers or DEFAULT_COMPILE_WORKERS,
            cost_measured=True if cost_measured is None else cost_measured,
            cost_model=cost_model,
        )


def _optional(raw: Mapping[str, Any], name: str, parse: Callable[[Any], Any]) -> Any:
    """Option ``name`` through ``parse``, None when not given; a value ``parse`` refuses is an error."""
    if raw.get(name) is None:
        return None
    value = parse(raw[name])
    if value is None:
        raise ProviderOptionError(f"option {name!r}={raw[name]!r}: {SESSION_OPTION_HELP[name]}")
    return value


def _popdist_share(runtime: IPURuntimeConfig) -> tuple[IPURuntimeConfig, DistributedReplicas | None]:
    """The runtime settings with this instance's share of the replicas when PopRun started the process
    (PopDist's environment), and that share for the engine."""
    try:
        share = read_popdist()
    except ValueError as exc:
        raise ProviderOptionError(str(exc)) from None
    if share is None:
        return runtime, None
    if share.ipus_per_replica != 1:
        raise ProviderOptionError(
            f"PopRun gives each replica {share.ipus_per_replica} IPUs (POPDIST_NUM_IPUS_PER_REPLICA); "
            "sharding a replica over several IPUs under PopRun is not supported yet (ipus_per_replica "
            "works without PopRun): run poprun with --ipus-per-replica 1"
        )
    given = runtime.sources.get("replication_factor")
    if given is not None and runtime.replication_factor != share.local_replicas:
        raise ProviderOptionError(
            f"replication_factor={runtime.replication_factor} ({given}) conflicts with PopRun, "
            f"which gives "
            f"this instance {share.local_replicas} of {share.total_replicas} replicas (poprun "
            "--num-replicas / --num-instances); remove the setting"
        )
    _logger.info(
        "PopRun instance %d of %d: replicas %d..%d of %d",
        share.instance_index,
        share.instances,
        share.replica_offset,
        share.replica_offset + share.local_replicas - 1,
        share.total_replicas,
    )
    return replace(runtime, replication_factor=share.local_replicas), share.replicas()
