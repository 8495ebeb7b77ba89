"""Opens one ONNX graph for serving from the session's configuration (``IPUProviderOptions``).

``open_model`` resolves, in this order, the device and engine, PopRun's share of the replicas, the
executable cache and the graph; then it starts the engine and assembles the runner the session delegates
every call to: bucket plan, executable table, padding decisions and serving settings. Below this function
only plain values travel, never the configuration itself.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from optimum_ipu_backend.compiler.errors import PATTERN_QUANTIZATION, LegalizationError, UnsupportedNode
from optimum_ipu_backend.engines import Engine, load_engine
from optimum_ipu_backend.engines.base import CompileOptions
from optimum_ipu_backend.engines.probe import EMULATION_NOTICE, DeviceResolution, resolve_device
from optimum_ipu_backend.errors import ConfigurationError
from optimum_ipu_backend.runtime.batched_serving import BatchedServing
from optimum_ipu_backend.runtime.buckets import (
    DEFAULT_SAMPLING_RATE,
    BucketPlan,
    model_limit,
    packed_row_lengths,
)
from optimum_ipu_backend.runtime.cache_files import PLANS_DIR, PROOFS_DIR, graph_digest
from optimum_ipu_backend.runtime.dim_expressions import parse_dim
from optimum_ipu_backend.runtime.executable_cache import ExecutableCache
from optimum_ipu_backend.runtime.executables import ExecutableTable
from optimum_ipu_backend.runtime.graph_source import GraphSource
from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions, IPURuntimeConfig
from optimum_ipu_backend.runtime.packing import PackedGraphInterface, PackedRunner
from optimum_ipu_backend.runtime.padding import PaddingDecisions
from optimum_ipu_backend.runtime.precompile import compile_buckets
from optimum_ipu_backend.runtime.roles import (
    audio_sample_dims,
    fill_value,
    generation_step_dims,
    is_batch_dim,
)
from optimum_ipu_backend.runtime.serving import ServingConfig, StaticShapeRunner
from optimum_ipu_backend.runtime.serving_plan import ServingPlanner, measured_times, settings_digest

_logger = logging.getLogger(__name__)
_emulation_announced = threading.Event()


@dataclass(frozen=True)
class OpenModel:
    """What a session serves: its configuration, graph, the device it resolved to, the engine and the
    runner."""

    options: IPUProviderOptions
    source: GraphSource
    resolution: DeviceResolution
    engine: Engine
    runner: StaticShapeRunner
    #: The dynamic batcher in front of the runner (``dynamic_batching``), or None.
    batching: BatchedServing | None = None


def open_model(
    model: str | os.PathLike | bytes, options: IPUProviderOptions, *, threads: int | None = None
) -> OpenModel:
    """Open ``model`` (a path or the bytes of an ONNX file) as ``options`` say; ``threads`` is the host
    thread count the session options ask for when the provider options name none."""
    runtime = options.runtime
    cache = (
        ExecutableCache(runtime.executable_cache_dir, runtime.cache_size_limit)
        if runtime.cache_enabled
        else None
    )
    source = GraphSource(model, None if cache is None else cache.root)
    _check_graph(source, model)
    resolution = resolve_device(options.device, options.engine, sdk_python=options.sdk_python)
    # Engines with a worker process start it here and ask the SDK which IPUs exist.
    engine = load_engine(
        resolution.engine, resolution.device, offline=options.offline, sdk_python=options.sdk_python
    )
    try:
        compile_options = _compile_options(options, engine, threads)
        runner = _runner(source, cache, engine, options, compile_options)
        if options.compile == "eager":
            _compile_smallest_shape(runner)
        batching = (
            _batched_serving(source, cache, engine, options, compile_options, runner)
            if options.dynamic_batching
            else None
        )
    except BaseException:
        engine.close()
        raise
    if resolution.emulated:
        if not _emulation_announced.is_set():
            _emulation_announced.set()
            _logger.warning("IPUExecutionProvider is running on device 'emulator': %s", EMULATION_NOTICE)
        _logger.info("session for %s uses device 'emulator' (%s)", source.path, EMULATION_NOTICE)
    return OpenModel(options, source, resolution, engine, runner, batching)


def _check_graph(source: GraphSource, model: str | os.PathLike | bytes) -> None:
    """Fail at creation, not on the first call, for a graph the compiler cannot take."""
    offending = [UnsupportedNode(*entry) for entry in source.description.unsupported]
    if offending:
        where = "the model" if isinstance(model, (bytes, bytearray)) else str(model)
        # A quantization refusal says what to do itself; the general advice (re-export, other sizes,
        # other precision) does not apply to it.
        only_quantization = all(node.pattern == PATTERN_QUANTIZATION for node in offending)
        raise LegalizationError(
            f"{where} contains operators the IPU compiler cannot legalize",
            offending,
            () if only_quantization else None,
        )


def _compile_smallest_shape(runner: StaticShapeRunner) -> None:
    """compile='eager': compile errors surface now, while providers listed after ipu can still take over."""
    try:
        runner.compiled_shapes()
    except ValueError as exc:  # a dimension compiled at the size it comes in: no shape is known yet
        warnings.warn(f"compile='eager' compiled nothing at creation: {exc}", RuntimeWarning, stacklevel=4)
    else:
        compile_buckets(runner, limit=1)


def _read_config(model_dir: Path | None) -> dict[str, Any]:
    """The model's config.json (bucket limits, pad token), or nothing for a bare .onnx file."""
    if model_dir is None or not (model_dir / "config.json").is_file():
        return {}
    return json.loads((model_dir / "config.json").read_text(encoding="utf-8"))


def sampling_rate(model_dir: Path | None) -> int:
    """The audio sampling rate of the feature extractor saved beside the model
    (``preprocessor_config.json``), or ``DEFAULT_SAMPLING_RATE`` when there is none."""
    if model_dir is not None:
        try:
            stored = json.loads((model_dir / "preprocessor_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            stored = None
        rate = stored.get("sampling_rate") if isinstance(stored, dict) else None
        if isinstance(rate, int) and not isinstance(rate, bool) and rate > 0:
            return rate
    return DEFAULT_SAMPLING_RATE


def dynamic_dims(input_shapes: Mapping[str, Any]) -> list[str]:
    """Every dimension name the inputs' declared shapes use, in order of first appearance."""
    dims: list[str] = []
    for shape in input_shapes.values():
        for dim in shape:
            parsed = parse_dim(dim)
            if parsed is not None:
                dims.extend(name for name in sorted(parsed.symbols) if name not in dims)
    return dims


def plan_buckets(
    input_shapes: Mapping[str, Sequence[Any]],
    elem_types: Mapping[str, int],
    config: Mapping[str, Any],
    runtime: IPURuntimeConfig,
    model_dir: Path | None,
) -> BucketPlan:
    """The compiled sizes of a graph with these inputs: the one plan a session serves and `check` sizes
    graphs at, from the model's ``config.json``, the settings and the audio sampling rate beside it."""
    audio_dims = audio_sample_dims(input_shapes, elem_types)
    rate = sampling_rate(model_dir) if audio_dims else 0
    return BucketPlan.planned(
        config,
        dynamic_dims(input_shapes),
        runtime.bucket_options(),
        sizes_per_dimension=runtime.sizes_per_dimension,
        step_dims=generation_step_dims(input_shapes),
        audio_dims=dict.fromkeys(audio_dims, rate),
    )


def pipeline_device_iterations(runtime: IPURuntimeConfig, engine: Engine) -> int:
    """``device_iterations``, raised to fill the pipeline of a model sharded over several IPUs.

    A pipeline of N stages (at most one per IPU of a replica) runs only with at least N batches per step
    (PopART refuses fewer), so a sharded model's steps take ``max(device_iterations, ipus_per_replica)``
    micro-batches; the runtime pads a short last step as it does for any step.
    """
    if runtime.ipus_per_replica == 1:
        return runtime.device_iterations
    if not engine.shards:
        raise ConfigurationError(
            f"ipus_per_replica={runtime.ipus_per_replica} "
            f"({runtime.sources.get('ipus_per_replica', 'set')}): the {engine.name} engine runs each replica "
            "on one IPU; use engine='popart' to shard a model over several IPUs, or set ipus_per_replica to 1"
        )
    if runtime.device_iterations < runtime.ipus_per_replica:
        _logger.info(
            "device_iterations raised from %d to %d to fill the %d-IPU pipeline",
            runtime.device_iterations,
            runtime.ipus_per_replica,
            runtime.ipus_per_replica,
        )
    return max(runtime.device_iterations, runtime.ipus_per_replica)


def _compile_options(options: IPUProviderOptions, engine: Engine, threads: int | None) -> CompileOptions:
    """How the session's executables are compiled: one set for every graph it serves."""
    runtime = options.runtime
    return CompileOptions(
        device=engine.device,
        precision=options.precision,
        threads=options.threads or threads,
        device_iterations=pipeline_device_iterations(runtime, engine),
        replicas=runtime.replication_factor,
        distributed=options.distributed,
        offline=options.offline,
        ipu_version=options.ipu_version,
        compile_timeout=options.compile_timeout,
        ipus_per_replica=runtime.ipus_per_replica,
        layers_per_ipu=runtime.layers_per_ipu,
        device_groups=options.ipu_groups,
    )


def _runner(
    source: GraphSource,
    cache: ExecutableCache | None,
    engine: Engine,
    options: IPUProviderOptions,
    compile_options: CompileOptions,
) -> StaticShapeRunner:
    """The bucket plan, executable table and padding decisions of ``source``, in one runner."""
    runtime = options.runtime
    device_iterations = compile_options.device_iterations
    description = source.description
    model_dir = None if source.path is None else source.path.parent
    config = _read_config(model_dir)
    input_shapes = {name: tuple(dims) for name, dims in description.served_inputs.items()}
    elem_types = {name: elem_type for name, _, elem_type in description.inputs}
    plan = plan_buckets(input_shapes, elem_types, config, runtime, model_dir)
    table = ExecutableTable(
        source.served_model,
        engine,
        compile_options,
        graph_digest=description.digest,
        branch_inputs=description.branch_inputs,
        cache=cache,
        progress=options.progress,
        model_path=source.path,
    )
    positions, _ = model_limit(config, "sequence_length")
    pad_token_id = config.get("pad_token_id") if isinstance(config.get("pad_token_id"), int) else None
    fills = {name: fill_value(name, pad_token_id) for name in input_shapes}
    masks = description.masks()
    left_padded = tuple(mask.dim for mask in masks if mask.side == "left")
    # inputs the runtime makes itself: (mask input, the dimension whose real positions it marks)
    generated = tuple((mask.input, mask.dim) for mask in masks)
    serving = ServingConfig(
        plan=plan,
        fills=fills,
        max_position_id=None if positions is None else positions - 1,
        device_iterations=device_iterations,
        replicas=runtime.replication_factor,
        left_padded_dims=left_padded,
        generated_masks=generated,
        trim_padding=options.trim_padding,
        kv_cache_on_device=options.kv_cache == "device",
        max_executables=runtime.max_executables,
        token_counts=tuple(description.token_count_checks()),
    )
    decisions = PaddingDecisions(
        source.served_model,
        input_shapes,
        fills,
        left_padded_dims=left_padded,
        generated_masks=generated,
        canonical_sizes={dim: plan.canonical_sizes(dim) for dim in plan.dims},
        store=None if cache is None else cache.root / PROOFS_DIR / description.digest,
    )
    output_dtypes = {
        name: np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
        for name, _, elem_type in description.outputs
    }
    _logger.info("compiled sizes: %s", plan.describe())
    planner = _planner(options, engine, compile_options, plan, cache, description.digest, table)
    return StaticShapeRunner(table, input_shapes, output_dtypes, serving, decisions, planner)


def _planner(
    options: IPUProviderOptions,
    engine: Engine,
    compile_options: CompileOptions,
    plan: BucketPlan,
    cache: ExecutableCache | None,
    digest: str,
    table: ExecutableTable,
) -> ServingPlanner | None:
    """With ``serving_plan="cost"``: the planner that picks the session's few executables, its plan kept in
    the cache under the graph and every setting the plan depends on."""
    if options.serving_plan != "cost":
        return None
    slots = options.ipu_groups or 1
    settings = {
        "sizes": plan.to_dict(),
        "ipu_groups": slots,
        "engine": engine.name,
        "binary": compile_options.binary_settings(),
        "cost": {k: v for k, v in options.cost_model.to_dict().items() if k != "sources"},
    }
    store = None if cache is None else cache.root / PLANS_DIR / digest / f"{settings_digest(settings)}.json"
    measure = None
    if options.cost_measured and engine.device == "ipu":
        measure = lambda: measured_times(table.statistics())  # noqa: E731
    return ServingPlanner(
        model=options.cost_model,
        slots=slots,
        candidates={dim: sizes for dim, sizes in plan.sizes.items() if not is_batch_dim(dim)},
        store=store,
        compile_workers=options.compile_workers,
        measure=measure,
    )


def _batched_serving(
    source: GraphSource,
    cache: ExecutableCache | None,
    engine: Engine,
    options: IPUProviderOptions,
    compile_options: CompileOptions,
    runner: StaticShapeRunner,
) -> BatchedServing:
    """The dynamic batcher in front of ``runner``, with packed rows where the packing proof holds."""
    packed, verdict = None, "not packed: packing=0"
    if options.packing:
        packed, verdict = _packed_runner(source, cache, engine, options, compile_options, runner)
    _logger.info("dynamic batching: %s", verdict)
    return BatchedServing(
        runner, packed, max_delay_s=options.max_queue_delay_ms / 1000, packing_verdict=verdict
    )


def _packed_runner(
    source: GraphSource,
    cache: ExecutableCache | None,
    engine: Engine,
    options: IPUProviderOptions,
    compile_options: CompileOptions,
    runner: StaticShapeRunner,
) -> tuple[PackedRunner | None, str]:
    """The packed runner of an encoder whose packed graph is proven, and the packing verdict."""
    from optimum_ipu_backend.compiler.graph_rewrites import packing

    if source.description.branch_inputs or source.description.generated_masks:
        return None, "not packed: only encoders without a cache or generated masks are packed"
    result = packing.pack_encoder(source.served_model(), None if source.path is None else source.path.parent)
    if isinstance(result, packing.PackingRefused):
        return None, packing.describe(result)
    mask_shape = runner.input_shapes.get(result.mask_input, ())
    sequence_dim = str(mask_shape[1]) if len(mask_shape) == 2 else None
    batch_dim = str(mask_shape[0]) if len(mask_shape) == 2 else None
    if sequence_dim not in runner.plan.sizes or batch_dim not in runner.plan.sizes:
        return None, f"not packed: {result.mask_input} has no compiled batch and sequence sizes"
    packed_model = result.model
    input_dtypes = {
        value.name: np.dtype(onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type))
        for value in packed_model.graph.input
    }
    interface = PackedGraphInterface(
        mask_input=result.mask_input,
        token_inputs=result.token_inputs,
        token_outputs=dict(result.token_outputs),
        pooled_outputs=dict(result.pooled_outputs),
        input_dtypes=input_dtypes,
        segment_ids=packing.SEGMENT_IDS,
        position_ids=packing.POSITION_IDS,
        segment_starts=packing.SEGMENT_STARTS,
    )
    table = ExecutableTable(
        lambda: packed_model,
        engine,
        compile_options,
        graph_digest=graph_digest(f"{source.description.digest}-packed-{packing.PACKING_FORMAT}"),
        cache=cache,
        progress=options.progress,
        model_path=source.path,
    )
    cap = options.runtime.max_executables

    def may_compile(shapes: Mapping[str, tuple[int, ...]]) -> bool:
        # max_executables counts the session's executables of both graphs
        return cap is None or table.has(shapes, {}) or runner.executables.count + table.count < cap

    packed_runner = PackedRunner(
        interface,
        table,
        row_counts=runner.plan.sizes[batch_dim],
        row_lengths=packed_row_lengths(runner.plan.sizes[sequence_dim]),
        fills={name: int(runner.config.fills.get(name, 0)) for name in result.token_inputs},
        output_dtypes=runner.output_dtypes,
        device_iterations=compile_options.device_iterations,
        replicas=compile_options.replicas,
        trimming_proven=lambda: not runner.decisions.is_exact(sequence_dim),
        may_compile=may_compile,
        planner=runner.planner,
    )
    return packed_runner, f"{packing.describe(result)}; rows of up to {packed_runner.longest_row} tokens"
